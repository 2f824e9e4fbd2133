"""The paged-prefill family (docs/prefill-family.md, docs/abi.md): chunks of query tokens, packed
by sequence (q_indptr), against their sequences' paged KV caches, the chunk's own K/V included
(seq_lens counts them). Tensor cores (mma.sync m16n8k16) for fp16/bf16 q, fp32 FMAs for fp32 q;
K/V tiles streamed by a cp.async pipeline (`stages`); split over KV partitions chosen at call time
by the plan (decode's planner, kgen/plan/split.py) with a merge kernel. The argument
table here is the kernel ABI; the call binding checks a call against it and packs the launches."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.families.argtable import KernelDecl
from kgen.families.attention import prefill_cases
from kgen.families.attention.common import (
    PREFILL_ROWS,
    AttentionBinder,
    AttentionFamily,
    call_lengths,
    checked_q_lens,
    heads_line,
    merge_kernel,
    planned_rows,
    sinks_note,
    template_context,
)
from kgen.families.attention.decode_geometry import vector_width
from kgen.families.attention.prefill_geometry import (
    KV_PATHS,
    KV_TILES,
    M_TILES,
    OUT_SLICE,
    PATHS,
    STAGES,
    WARPS,
    prefill_geometry,
    slices,
)
from kgen.families.base import Config, PerfModel, TunableParam, resolve_config
from kgen.families.binding import host_values
from kgen.formats.cache import describe, head_dims_text
from kgen.plan import Plan
from kgen.plan.arch import smem_limit


def fitted_to_short_rows(spec, config: Config, max_q_len: int) -> Config:
    """`config` with the smallest row tile that holds a request of `max_q_len` query tokens (its
    packed rows: max_q_len x the GQA group): speculative decoding's verification requests, a few
    tokens each, would fill a fraction of a tile sized for prompt chunks (4 warps x 2 m tiles = 128
    rows). One m tile a warp, the mma.sync body (the Hopper body's tile is 64 rows or more)."""
    rows = max(1, int(max_q_len)) * spec.group_size
    warps = next((w for w in WARPS if 16 * w >= rows), WARPS[-1])
    return {**config, "warps": warps, "m_tiles": 1, "path": 1}



class PagedPrefillFamily(AttentionFamily):
    # the kind's identity: its name, template, query rows and cases (the rest is AttentionFamily's)
    kind, template, rows, cases_module = "paged_prefill", "paged_prefill.cu.j2", PREFILL_ROWS, prefill_cases
    perf_model, fib_kind = PerfModel.TILES, "gqa_paged_prefill"  # capabilities (kgen/families/base.py)
    params = {"warps": TunableParam("warps", 0), "kv_tile": TunableParam("kv_tile", 0),
              "stages": TunableParam("stages", 0), "m_tiles": TunableParam("m_tiles", 0),
              "partition_size": TunableParam("partition_size", 256),
              "path": TunableParam("path", 0)}  # PATHS: 0 auto, 1 mma.sync, 2 the Hopper wgmma path

    # ---- generation -------------------------------------------------------------------
    def check_config(self, spec, config: Config) -> list[str]:
        problems = []
        if config["warps"] and config["warps"] not in WARPS:
            problems.append(f"warps must be 0 (automatic) or one of {', '.join(map(str, WARPS))} "
                            f"(got {config['warps']})")
        if config["kv_tile"] and config["kv_tile"] not in KV_TILES:
            problems.append(f"kv_tile must be 0 (automatic) or one of {', '.join(map(str, KV_TILES))} "
                            f"(got {config['kv_tile']})")
        if config["stages"] and config["stages"] not in STAGES:
            problems.append(f"stages must be 0 (automatic) or 1 to 4 (got {config['stages']})")
        if config["m_tiles"] and config["m_tiles"] not in M_TILES:
            problems.append(f"m_tiles must be 0 (automatic) or one of {', '.join(map(str, M_TILES))} "
                            f"(got {config['m_tiles']})")
        problems += self.partition_problems(config)
        if config["path"] not in range(len(PATHS)):
            problems.append(f"path must be 0 (auto), 1 (mma) or 2 (wgmma) (got {config['path']})")
        if problems:
            return problems
        geo = prefill_geometry(spec, config)
        if config["path"] == 2:
            if geo.refusal:
                problems.append(f"path 2 (wgmma) cannot build for {', '.join(spec.targets)}: {geo.refusal} "
                                "(accepted there: path 0, auto, or 1, mma.sync)")
        elif not geo.wgmma:  # the Hopper path's tiles fit by construction (its refusal says when not)
            need = geo.smem_bytes
            if need > smem_limit(spec.targets):
                problems.append(f"warps, kv_tile and stages need {need} bytes of shared memory, more than "
                                f"{smem_limit(spec.targets)} (the opt-in limit of {', '.join(spec.targets)}): "
                                "use fewer warps, stages or m_tiles or a smaller kv_tile")
        return problems

    def abi_config(self, spec) -> Config:
        # the hand-written kernel contract keeps its launch of 16 rows a warp, single pass, one
        # thread block of `warps` warps (the mma.sync geometry, also where the Hopper path is the default)
        return {"partition_size": 0, "m_tiles": 1, "path": 1}

    def default_space(self, spec) -> dict[str, list[int]]:
        return {"warps": [2, 4], "kv_tile": [32, 64], "stages": [1, 2], "partition_size": [0, 256]}

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        a, P = spec.attention, config["partition_size"]
        geo = prefill_geometry(spec, config)  # the Hopper path: a producer warpgroup besides the consumers
        table = self.arguments(spec, config)
        main = KernelDecl(spec.name, tuple(table), ("q_tiles", a.num_kv_heads, "z"), geo.threads, smem=geo.smem_bytes,
                          max_registers=geo.max_registers, launch_registers=geo.launch_registers)
        return [main, merge_kernel(spec, table, PREFILL_ROWS)] if P else [main]

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        geo = prefill_geometry(spec, config)
        return {
            **template_context(spec, config, kernels),
            "warps": geo.warps,
            "kv_tile": geo.kv_tile,
            "stages": geo.stages,
            "m_tiles": geo.m_tiles,
            "kv_path": KV_PATHS.index(geo.kv_path),
            "smem_bytes": geo.smem_bytes,
            "fma_scratch": geo.fma_scratch,
            "wgmma": geo.wgmma,
            "setmaxnreg": geo.setmaxnreg,
        }

    def body_choice(self, spec, config: Config) -> tuple[str, str]:
        """(body, why) of the arch being rendered (`spec.targets`, one arch: kgen/bodies.py): "wgmma"
        (the Hopper body), "mma.sync", or "fma" (fp32 products: fp32 q, or no mma.sync m16n8k16)."""
        geo = prefill_geometry(spec, config)
        if geo.wgmma:
            split = ", setmaxnreg 40/232" if geo.setmaxnreg else ""
            return "wgmma", (f"Hopper body: {head_dims_text(spec)}, {spec.dtype.q} q, cache {describe(spec)}, "
                             f"block_size {spec.kv_cache.block_size} fit the TMA-free wgmma tiling: "
                             f"{geo.warps // 4} consumer warpgroup(s) + a producer, {geo.kv_tile}-key tiles, "
                             f"{geo.stages} stages{split}; compiled for sm_90a")
        body = "fma" if geo.fma_scratch else "mma.sync"
        if config.get("path", 0) == 1:
            return body, "path 1 (mma) in the config"
        return body, f"not the Hopper body: {geo.refusal}"

    def abi_notes(self, spec) -> list[str]:
        a = spec.attention
        rows = prefill_geometry(spec, resolve_config(self, spec, self.abi_config(spec))).rows  # the ABI launch's
        visible = ("keys p-" + str(a.sliding_window - 1) + " .. p" if a.sliding_window else "keys 0 .. p") \
            if a.causal else "all seq_len keys (causal: false)"
        return [
            heads_line(spec),
            f"softmax scale {spec.softmax_scale_value!r}"
            + (f", logits soft-cap {a.logits_soft_cap} (s = cap*tanh(s/cap), applied before ALiBi)"
               if a.logits_soft_cap else "")
            + (", ALiBi: logit += alibi_slopes[h] * (key - p)" if a.alibi else "") + sinks_note(spec),
            "Query row j of sequence s (rows q_indptr[s] ..) sits at position p = seq_lens[s] - q_len + j, "
            f"q_len = q_indptr[s+1] - q_indptr[s], and sees {visible}. A sequence with q_len 0 writes nothing.",
            *self.call_lines(spec),
            f"Loads: {vector_width(spec)} elements per vector load; pointers and strides must keep them aligned.",
            f"Grid x: q_tiles = ceil(num_q_tokens * {spec.group_size} / {rows}) + num_seqs: blockIdx.x counts the "
            f"tiles of {rows} packed (token, group head) rows of every sequence in order (spare blocks exit); "
            f"grid z: {slices(spec)} slice(s) of {min(OUT_SLICE, spec.v_head_dim_value)} output columns.",
            "A hand-written kernel implements the single-pass launch below (part_o and part_ml null, max_partitions "
            "1); kgen's split-KV configs add partitions on grid z and a merge kernel.",
        ]

    # ---- the call ---------------------------------------------------------------------
    def schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                 partition_tokens: int | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Launch sizes for these lengths and chunks (the call's seq_lens and q_indptr; decode's
        planner, kgen/plan/split.py: one block per (tile of query rows, KV head,
        partition)) and the kernels launched."""
        a = spec.attention
        sizes, row_tiles, _, kernels = self.packed_split(
            spec, config, lengths, target_blocks, partition_tokens, a.num_kv_heads, spec.group_size,
            prefill_geometry(spec, config).rows, a.sliding_window or 0)
        sizes |= {"q_tiles": int(np.sum(row_tiles)) + sizes["num_seqs"], "z": sizes["max_partitions"] * slices(spec)}
        return sizes, kernels

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan: Plan | None = None,
             target_blocks: int | None = None):
        """Check the call's arguments against the ABI and return (launches, result); without a plan
        the call plans itself from its lengths (host arrays) or its shapes."""
        B = spec.kv_cache.block_size
        b = AttentionBinder(spec, call)
        q, T = b.query(PREFILL_ROWS)
        pool = b.pool(v_by_token=False)
        bt, sl = b.table(None)
        S, M = bt.shape
        ind = b.take("q_indptr", True)
        b.check(ind, (S + 1,), "int32", contiguous=True)
        ks, vs = b.scales(pool)
        alibi = b.alibi()
        sinks = b.sinks()
        out = b.out(q, T)
        lse = b.lse(q, T)
        if checked:  # before planning: the plan trusts q_indptr and seq_lens
            b.check_lengths(sl, bt, pool.num_blocks, q_lens=checked_q_lens(host_values(ind), T), min_len=0)
        # without a plan: host lengths are planned for; device ones by shapes (full tables, rows spread evenly)
        lens = None if plan is not None else call_lengths(sl, ind, T, M * B)
        sizes, kernels = b.planned_sizes(self, config, plan, S, lens, target_blocks)
        max_parts = sizes["max_partitions"]
        part_o, part_ml = b.split_scratch(config, plan, q, max_parts, planned_rows(plan, T) if T else 0)
        b.refuse_unknown()
        written = [out, lse, part_o, part_ml]
        b.refuse_aliasing(written, [q, *pool.caches, ind, bt, sl, ks, vs, alibi, sinks, *written])
        values = b.values(PREFILL_ROWS, q, out, pool, bt, sl, part_o, part_ml, lse, sizes, M, q_indptr=ind,
                          num_seqs=S, alibi_slopes=alibi, sinks=sinks)
        rows = prefill_geometry(spec, config).rows  # grid x from the call's shapes (a plan may be for other chunks)
        grid = {"q_tiles": -(-T * spec.group_size // rows) + S, "num_q_tokens": T, "z": max_parts * slices(spec)}
        # fused: K/V by address (an isolated child maps them too); no query row: nothing to launch
        launches = [k.launch(grid, values, pool.reached) for k in kernels] if T else []  # no query row: nothing to launch
        return launches, ((out.obj, lse.obj) if lse is not None else out.obj)


PAGED_PREFILL = PagedPrefillFamily()
