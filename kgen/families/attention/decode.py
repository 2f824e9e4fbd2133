"""The paged-decode family (docs/decode-family.md, docs/abi.md): one query token per sequence
against its paged KV cache, optionally split over KV partitions (flash-decoding) with a
merge kernel. The argument table here is the kernel ABI; the call binding checks a call
against it and packs the launches."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.families.argtable import KernelDecl
from kgen.families.attention import decode_cases
from kgen.families.attention.common import (
    DECODE_ROWS,
    AttentionBinder,
    AttentionFamily,
    heads_line,
    merge_kernel,
    sinks_note,
    template_context,
)
from kgen.families.attention.decode_geometry import (
    decode_geometry,
    vector_width,
    vllm_v_copy,
)
from kgen.families.attention.decode_mma_geometry import (
    body_note,
    mma_geometry,
    mma_unsupported,
    uses_tensor_cores,
)
from kgen.families.base import (
    Config,
    PerfModel,
    TunableParam,
    resolve_config,
    threads_problems,
)
from kgen.families.binding import host_values
from kgen.formats.cache import CacheFormat
from kgen.formats.dtypes import dtype
from kgen.plan import Plan


class PagedDecodeFamily(AttentionFamily):
    # the kind's identity: its name, template, query rows and cases (the rest is AttentionFamily's)
    kind, template, rows, cases_module = "paged_decode", "paged_decode.cu.j2", DECODE_ROWS, decode_cases
    perf_model, fib_kind = PerfModel.STREAMING, "gqa_paged_decode"  # capabilities (kgen/families/base.py)
    params = {"threads": TunableParam("threads", 128), "partition_size": TunableParam("partition_size", 64),
              "stages": TunableParam("stages", 0), "heads_per_thread": TunableParam("heads_per_thread", 0),
              # the tensor-core body (paged_decode_mma.cuh) for GQA groups of at least this many heads; 0: never
              "mma_min_group": TunableParam("mma_min_group", -1)}

    # ---- generation -------------------------------------------------------------------
    def check_config(self, spec, config: Config) -> list[str]:
        problems = threads_problems(config["threads"]) + self.partition_problems(config)
        if config["mma_min_group"] < -1:
            problems.append(f"mma_min_group must be -1 (auto), 0 (never) or a group size "
                            f"(got {config['mma_min_group']})")
        if not problems and uses_tensor_cores(spec, config):
            hpt, G = config["heads_per_thread"], spec.group_size  # the CUDA-core body's, still checked
            if not 0 <= hpt <= G:
                problems.append(f"heads_per_thread must be 0 (auto) or 1 to the GQA group {G} (got {hpt})")
            problems += mma_geometry(spec, config)[1]
        elif not problems:
            problems += decode_geometry(spec, config)[1]
        return problems

    def default_space(self, spec) -> dict[str, list[int]]:
        space = {"threads": [64, 128, 256], "partition_size": [0, 64, 256], "stages": [2, 3]}
        if spec.group_size >= 4 and mma_unsupported(spec) is None:  # both bodies are worth a try
            space["mma_min_group"] = [0, 4]
        return space

    def abi_config(self, spec) -> Config:
        # The hand-written contract (ABI 1) is the single-pass launch with `threads` threads: the
        # CUDA-core body's; kgen's tensor-core body (which may launch fewer) is kgen's own choice.
        return {"partition_size": 0, "mma_min_group": 0}

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        a, P = spec.attention, config["partition_size"]
        table = self.arguments(spec, config)
        # ABI 1 launches G x head_dim fp32 of dynamic shared memory (the group's queries); kgen's own
        # split configs keep everything in static shared memory and launch none, for occupancy.
        # the tensor-core body runs as many warps of `threads` as its tiles fit in shared memory
        threads = mma_geometry(spec, config)[0].threads if uses_tensor_cores(spec, config) else config["threads"]
        main = KernelDecl(spec.name, tuple(table), (a.num_kv_heads, "num_seqs", "max_partitions" if P else 1),
                          threads, smem=0 if P else spec.group_size * a.head_dim * 4)
        return [main, merge_kernel(spec, table, DECODE_ROWS)] if P else [main]

    def schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                 partition_tokens: int | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Launch sizes for these lengths (kgen/plan/split.py: a block per KV head) and the kernels launched."""
        return self.split_schedule(spec, config, lengths, target_blocks, partition_tokens, spec.attention.num_kv_heads,
                                   spec.attention.sliding_window or 0)

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        mma = uses_tensor_cores(spec, config)
        geo, problems = (mma_geometry if mma else decode_geometry)(spec, config)
        if geo is None:
            raise ValueError("; ".join(problems))  # render() runs check_config first
        return {**template_context(spec, config, kernels), "threads": config["threads"],
                "geo": geo, "tensor_cores": mma, "body_note": body_note(spec, config)}

    def abi_notes(self, spec) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        return [
            heads_line(spec),
            f"softmax scale {spec.softmax_scale_value!r}"
            + (f", sliding window {a.sliding_window} (query at seq_len-1 sees keys seq_len-{a.sliding_window} .. "
               "seq_len-1)" if a.sliding_window else "")
            + (f", logits soft-cap {a.logits_soft_cap} (s = cap*tanh(s/cap), applied before ALiBi)"
               if a.logits_soft_cap else "")
            + (", ALiBi: logit += alibi_slopes[h] * (j - (seq_len - 1))" if a.alibi else "") + sinks_note(spec),
            *self.call_lines(spec),
            f"Loads: {vector_width(spec)} elements per vector load; pointers and strides must keep them aligned"
            + (f" (V: {vllm_v_copy(spec) // dtype(kv.dtype).itemsize} tokens per load along its block_size axis)"
               if CacheFormat.of(spec).vllm else "") + ".",
            "kgen's own kernel, default config: " + body_note(spec, resolve_config(self, spec, None)),
            "A hand-written kernel implements the single-pass launch below (part_o and part_ml null, max_partitions "
            "1); kgen's split-KV configs add partitions on grid z and a merge kernel.",
        ]

    # ---- the call ---------------------------------------------------------------------
    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan: Plan | None = None,
             target_blocks: int | None = None):
        """Check the call's arguments against the ABI and return (launches, result); without a
        plan the call plans itself from its lengths (host arrays) or its block table's width."""
        b = AttentionBinder(spec, call)
        q, S = b.query(DECODE_ROWS)
        pool = b.pool(v_by_token=True)
        bt, sl = b.table(S)
        M = bt.shape[1]
        ks, vs = b.scales(pool)
        alibi = b.alibi()
        sinks = b.sinks()
        out = b.out(q, S)
        lse = b.lse(q, S)
        if checked:
            b.check_lengths(sl, bt, pool.num_blocks, min_len=0)  # 0: a padded row (CUDA graphs)
        # without a plan: lengths known on the host are planned for; a device array's by its table's width
        lens = None if plan is not None else host_values(sl) if sl.device == "cpu" else np.full(S, M * spec.kv_cache.block_size)
        sizes, kernels = b.planned_sizes(self, config, plan, S, {"seq_lens": lens}, target_blocks)
        part_o, part_ml = b.split_scratch(config, plan, q, sizes["max_partitions"], sizes["num_seqs"])
        b.refuse_unknown()
        written = [out, lse, part_o, part_ml]
        b.refuse_aliasing(written, [q, *pool.caches, bt, sl, ks, vs, alibi, sinks, *written])
        values = b.values(DECODE_ROWS, q, out, pool, bt, sl, part_o, part_ml, lse, sizes, M, alibi_slopes=alibi,
                          sinks=sinks)
        launches = [k.launch({**sizes, "num_seqs": S}, values, reached=pool.reached) for k in kernels]
        return launches, ((out.obj, lse.obj) if lse is not None else out.obj)


PAGED_DECODE = PagedDecodeFamily()
