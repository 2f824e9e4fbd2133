"""vLLM's per-batch attention metadata as kgen calls (docs/vllm.md, "How a batch is served").

vLLM reorders each batch so that requests with one new token come first (the builder's reorder
threshold is 1). Those rows are decode rows: one `paged_decode` launch over their sequences.
The rest are prefill chunks: one `paged_prefill` launch whose `q_indptr` is vLLM's
`query_start_loc` shifted to start at 0. A batch with both is split there; with
`split=False` every row goes through `paged_prefill` (decode is its q_len = 1 case).
Lengths and tables are vLLM's own tensors, sliced, never copied. Plans are made from the host's
lengths (`seq_lens_cpu_upper_bound`, else `max_seq_len` for every row): an upper bound is enough
for a kgen plan (a partition past a sequence's end exits at once), and reading the device's
lengths would cost a device-to-host copy, a synchronisation, every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RowGroup:
    """The requests one kgen launch serves: rows [row_start, row_end) of q and out."""

    row_start: int
    row_end: int
    seq_lens: torch.Tensor  # [num_seqs] int32, KV tokens including the new ones
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens_cpu: torch.Tensor  # [num_seqs] on the host: an upper bound of seq_lens, for the plan
    q_indptr: torch.Tensor | None = None  # prefill only: [num_seqs + 1], starting at 0
    q_indptr_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class KgenAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # int32 [num_actual_tokens] (the builder's persistent copy of vLLM's int64)
    decode: RowGroup | None
    prefill: RowGroup | None
    # kgen plans made in build(), by the name of the layer type they serve: {name: (decode plan, prefill plan)}
    plans: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def translate(common, split: bool = True, slot_mapping: torch.Tensor | None = None) -> KgenAttentionMetadata:
    """The kgen row groups of one batch (`common`: vLLM's CommonAttentionMetadata, reordered with
    decode requests first). `slot_mapping`: the slots as the kernels take them (vLLM's when None).
    Reads only host tensors' values: nothing here waits for the device."""
    if common.causal is not True:
        what = "a per-request causal tensor" if isinstance(common.causal, torch.Tensor) else f"causal={common.causal!r}"
        raise ValueError(f"kgen's vLLM backend serves causal attention only, got {what} for this batch "
                         "(attention_config.use_non_causal is refused at start-up)")
    num_reqs, n_tokens = common.num_reqs, common.num_actual_tokens
    qsl_cpu = common.query_start_loc_cpu[: num_reqs + 1]
    seq_lens = common.seq_lens[:num_reqs]
    bound = common.seq_lens_cpu_upper_bound
    lens_cpu = (bound[:num_reqs] if bound is not None
                else torch.full((num_reqs,), int(common.max_seq_len), dtype=torch.int32))
    tables = common.block_table_tensor[:num_reqs]
    num_decodes = _leading_single_token_requests(qsl_cpu) if split else 0
    decode = prefill = None
    if num_decodes:
        decode = RowGroup(0, num_decodes, seq_lens[:num_decodes], tables[:num_decodes], lens_cpu[:num_decodes])
    if num_decodes < num_reqs:
        start = int(qsl_cpu[num_decodes])
        q_indptr_cpu = (qsl_cpu[num_decodes:] - start).to(torch.int32)
        q_indptr = (common.query_start_loc[num_decodes: num_reqs + 1] - start).to(torch.int32)
        prefill = RowGroup(start, int(qsl_cpu[num_reqs]), seq_lens[num_decodes:], tables[num_decodes:],
                           lens_cpu[num_decodes:], q_indptr, q_indptr_cpu)
    slots = common.slot_mapping[:n_tokens] if slot_mapping is None else slot_mapping[:n_tokens]
    return KgenAttentionMetadata(n_tokens, slots, decode, prefill)


def _leading_single_token_requests(qsl_cpu: torch.Tensor) -> int:
    """How many requests at the front have exactly one query row (vLLM's reorder puts them there)."""
    lens = (qsl_cpu[1:] - qsl_cpu[:-1]).tolist()
    count = 0
    for n in lens:
        if n != 1:
            break
        count += 1
    return count
