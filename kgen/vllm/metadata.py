"""vLLM's per-batch attention metadata as kgen calls (docs/vllm.md, "How a batch is served").

vLLM reorders each batch so that requests with few new tokens come first (the builder's reorder
threshold: 1, or with speculative decoding 1 + the draft tokens), in no order of length within
that front region. When every front request has one new token they are decode rows: one
`paged_decode` launch over their sequences; when some have more (draft verification), the whole
front region is one launch of the prefill kernel fitted to requests of at most the threshold's
tokens (`drafts`; a one-token request is its q_len = 1 case). The rest are prefill chunks: one `paged_prefill` launch whose `q_indptr` is
vLLM's `query_start_loc` shifted to start at 0. With `split=False` every row goes through
`paged_prefill` (decode is its q_len = 1 case).
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
    drafts: RowGroup | None = None  # draft-verification requests (speculative decoding)
    # kgen plans made in build(), by the name of the layer type they serve: {name: (decode plan, prefill plan)}
    plans: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    draft_plans: dict[str, Any] = field(default_factory=dict)  # {name: the drafts kernel's plan}


def translate(common, split: bool = True, slot_mapping: torch.Tensor | None = None,
              draft_q_len: int = 1) -> KgenAttentionMetadata:
    """The kgen row groups of one batch (`common`: vLLM's CommonAttentionMetadata, reordered with
    decode requests first). `slot_mapping`: the slots as the kernels take them (vLLM's when None).
    `draft_q_len` > 1 (with `split`): the front requests of at most draft_q_len tokens form the
    `drafts` group when any of them has more than one. Reads only host tensors' values: nothing here waits for
    the device."""
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
    tables = _whole_rows(common.block_table_tensor[:num_reqs])
    # vLLM's front region: every request of at most the threshold's tokens, in no order of length.
    front = _leading_requests(qsl_cpu, max(1, draft_q_len)) if split else 0
    one_token = front and int(qsl_cpu[front]) == front  # all of them decode rows
    num_decodes = front if one_token else 0
    decode = None
    if num_decodes:
        decode = RowGroup(0, num_decodes, seq_lens[:num_decodes], tables[:num_decodes], lens_cpu[:num_decodes])

    def packed(first: int, end: int) -> RowGroup | None:
        """Requests [first, end) as one prefill-style group (q_indptr from 0)."""
        if first == end:
            return None
        start = int(qsl_cpu[first])
        q_indptr_cpu = (qsl_cpu[first:end + 1] - start).to(torch.int32)
        q_indptr = (common.query_start_loc[first:end + 1] - start).to(torch.int32)
        return RowGroup(start, int(qsl_cpu[end]), seq_lens[first:end], tables[first:end], lens_cpu[first:end],
                        q_indptr, q_indptr_cpu)

    slots = common.slot_mapping[:n_tokens] if slot_mapping is None else slot_mapping[:n_tokens]
    return KgenAttentionMetadata(n_tokens, slots, decode, packed(front, num_reqs),
                                 drafts=packed(num_decodes, front))


def _whole_rows(table: torch.Tensor) -> torch.Tensor:
    """The block table as kgen takes it, C-contiguous, without a copy where it can be: vLLM's tables
    are rows of a persistent buffer, and with kernel-block splitting (a cache block larger than
    kgen's largest, split by vLLM's AttentionGroup) it passes the first columns of each row only;
    the whole rows are the same entries followed by ones past every sequence's end, which kgen
    never reads (it reads a sequence's first ceil(seq_len / block_size) entries)."""
    if table.is_contiguous() or table.dim() != 2 or table.stride(1) != 1:
        return table.contiguous()
    rows, width = table.shape[0], table.stride(0)
    needed = table.storage_offset() + (rows - 1) * width + width
    if rows == 0 or table.untyped_storage().nbytes() < needed * table.element_size():
        return table.contiguous()
    return table.as_strided((rows, width), (width, 1))


def _leading_requests(qsl_cpu: torch.Tensor, most: int) -> int:
    """How many requests at the front have 1 .. `most` query rows (vLLM's reorder puts them there)."""
    lens = (qsl_cpu[1:] - qsl_cpu[:-1]).tolist()
    count = 0
    while count < len(lens) and 1 <= lens[count] <= most:
        count += 1
    return count
