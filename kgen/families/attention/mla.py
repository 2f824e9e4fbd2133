"""paged_decode and paged_prefill over the mla layout's latent pool (docs/mla.md, docs/abi.md section 8):
every query head of a sequence (decode) or query token (prefill) against its latent rows, K the whole
row and V its first v_head_dim elements, read once into shared memory for both products
(templates/common/paged_mla.cuh; sm_90: paged_mla_wgmma.cuh), optionally split over KV partitions with
a merge kernel at v_head_dim. The pool's rows and binding are kgen/families/pool.py's LatentPool, the
rows, split-KV planning and binding steps the attention kinds' (common.py); what is here is the
bodies', the table's order and the ABI notes."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array, scalar
from kgen.families.attention import mla_cases, sparse_cases
from kgen.families.attention.common import (
    BODY_DEFAULTS,
    DECODE_ROWS,
    PARTITION_TOKENS,
    PREFILL_ROWS,
    AttentionBinder,
    AttentionFamily,
    c_float,
    call_lengths,
    call_names,
    checked_q_lens,
    merge_kernel,
    planned_rows,
    q_indptr_arg,
    row_stride_args,
    split_scratch_args,
    table_args,
)
from kgen.families.attention.mla_geometry import mla_geometry
from kgen.families.attention.mla_sparse import (
    bind_indices,
    indices_arg,
    refuse_block_tables,
    sparse_notes,
    topk,
)
from kgen.families.attention.mla_wgmma import (
    path_of,
    path_problems,
    wgmma_geometry,
    wgmma_refusal,
)
from kgen.families.base import Config, PerfModel, TunableParam, resolve_config
from kgen.families.binding import host_values
from kgen.families.pool import pool_of
from kgen.formats.cache import CacheFormat, describe
from kgen.formats.dtypes import dtype
from kgen.plan import Plan

FP8 = ("fp8_e4m3", "fp8_e5m2")


def mla_unsupported(spec) -> list[str]:
    """What the mla attention body does not build (each line says what is accepted)."""
    a, kv, q = spec.attention, spec.kv_cache, spec.dtype.q
    out = []
    if q not in ("fp16", "bf16"):
        out.append(f"dtype.q: the mla kernels run Q K^T and P V on the tensor cores with fp16 or bf16 operands "
                   f"(got {q})")
    if kv.dtype == "nvfp4" or kv.dtype == "int8" or (kv.dtype != q and kv.dtype not in (*FP8, "fp8_ds_mla")):
        out.append(f"kv_cache.dtype: {kv.dtype} is not built for the mla layout's attention (allowed: q's dtype "
                   f"{q}, fp8_e4m3, fp8_e5m2" + (", fp8_ds_mla)" if q == "bf16" else ")"))
    elif kv.dtype in FP8 and kv.scale == "per_token_head" and q == "fp16":
        out.append("kv_cache.scale: per-token fp8 scales with fp16 q are not built for the mla layout (P times "
                   "the scales may leave fp16's range; allowed: bf16 q, or per_tensor)")
    if a.alibi or a.sliding_window or a.logits_soft_cap:
        out.append("attention: ALiBi, sliding windows and soft-caps are not built for the mla layout "
                   "(DeepSeek-style MLA uses none of them)")
    if a.sinks:
        out.append("attention.sinks: attention sinks are not built for the mla layout (DeepSeek-style MLA has none; "
                   "allowed: sinks false)")
    if a.head_dim % 16 or spec.v_head_dim_value % 16:
        out.append(f"attention: the mla body takes head_dim and v_head_dim in whole k16 steps (multiples of 16; "
                   f"got {a.head_dim} and {spec.v_head_dim_value})")
    old = [t for t in spec.targets if int(t.removeprefix("sm_")) < 80]
    if old:
        out.append(f"targets: {old[0]} has no mma.sync m16n8k16 / cp.async (the mla body needs sm_80 or newer)")
    return out


GEOMETRY_PARAMS = {"row_tiles": TunableParam("row_tiles", 1), "col_warps": TunableParam("col_warps", 2),
                   "stages": TunableParam("stages", 2)}


class MlaAttentionFamily(AttentionFamily):
    """mla decode and prefill: the latent pool (kgen/families/pool.py's LatentPool) under the attention
    kinds' common code (kgen/families/attention/common.py: rows, split-KV, planning, binding steps);
    what they share beyond it: the body, its geometry, the refusals and the ABI notes."""

    template = "paged_mla.cu.j2"
    cases_module = None  # the matrix is mla_cases' or sparse_cases' (cases() below)
    body = ""  # the body function of templates/common/paged_mla.cuh
    sparse_body = ""  # the same for a sparse spec (attention.sparse_topk)
    q_text = ""  # q's row in the argument table
    single_pass_scratch = True  # the single-pass table keeps the split scratch (null) and max_partitions

    def causal(self, spec) -> bool:
        """Whether a row sees keys up to its own position only (decode's query is the last key anyway;
        a sparse row sees what its indices name)."""
        return not topk(spec)

    def unsupported(self, spec) -> list[str]:
        return mla_unsupported(spec)

    def default_space(self, spec) -> dict[str, list[int]]:
        return {"row_tiles": [1, 2], "col_warps": [2, 4]}

    def split(self, spec, config: Config) -> bool:
        """Whether the config splits the keys over partitions (a merge kernel follows)."""
        return bool(config.get("partition_size", 0))

    def arguments(self, spec, config: Config) -> list[Arg]:
        """The table of both kinds: the attention rows (common.py's) around the latent pool's; no ALiBi
        or sinks; a sparse spec's indices in place of the block table."""
        a, d, rows, pool = spec.attention, spec.dtype, self.rows, pool_of(spec)
        Hq, D, Dv, R = a.num_q_heads, a.head_dim, spec.v_head_dim_value, self.rows.count
        split, sparse = self.split(spec, config), topk(spec)
        keys = [indices_arg(spec, R), array("seq_lens", "int32", "input", ("num_seqs",), ("KV tokens" if rows.packed
                                            else "tokens") + " of each sequence (not read by kgen's kernel: the "
                                            "indices bound every row)")] if sparse else table_args(rows)
        partitions = split or self.single_pass_scratch
        return [
            array("out", d.resolved_out, "output", (R, Hq, Dv), rows.out_text),
            array("q", d.q, "input", (R, Hq, D), self.q_text.format(Dv=Dv, rope=D - Dv)),
            *pool.cache_args("input", const=True),
            *([q_indptr_arg(" (not read by kgen's sparse kernel)" if sparse else "")] if rows.packed else []),
            *keys,
            *pool.scale_args(use="real = stored * scale, for K and V"),
            *(split_scratch_args(spec, rows, not split) if partitions else []),
            array("lse", "fp32", "output", (R, Hq),
                  "natural-log log-sum-exp of the final logits" + (", -inf for no key" if rows.packed else "")
                  + " (null unless requested)", optional=True),
            *([scalar("num_seqs", "int32", "sequences in the batch")] if rows.packed else []),
            *([] if sparse else [scalar("max_blocks_per_seq", "int32", "columns of block_tables")]),
            *([scalar("max_partitions", "int32", "partitions per sequence (grid z); 1 without split")]
              if partitions else []),
            *row_stride_args(rows),
            *pool.stride_args(),
            *([PARTITION_TOKENS] if split else []),
        ]

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        main_params, merge_params = self.params_structs(spec, kernels)
        return {"main_params": main_params, "merge_params": merge_params, "q_ctype": dtype(spec.dtype.q).ctype, "out_ctype": dtype(spec.dtype.resolved_out).ctype,
                **pool_of(spec).template_constants(), "softmax_scale": c_float(spec.softmax_scale_value),
                "causal": self.causal(spec),
                "partition_size": config.get("partition_size", 0), "geo": mla_geometry(spec, config)[0],
                "sparse_topk": topk(spec),
                "main": kernels[0], "merge": kernels[1] if len(kernels) > 1 else None, "body": self.body_name(spec, config),
                "wgmma": self.wgmma(spec, config), "wgeo": wgmma_geometry(spec) if self.wgmma(spec, config) else None}

    def params_structs(self, spec, kernels: list[KernelDecl]) -> tuple[str, str | None]:
        """The Params struct every mla body takes (`const Params&`), and the merge's MergeParams
        (None: decode's merge takes positional parameters)."""
        return kernels[0].params_struct("Params", BODY_ABSENT), None

    # ---- the body of the arch being rendered (kgen/families/attention/mla_wgmma.py) ----------
    wgmma_body = ""  # the Hopper body's function (paged_mla_wgmma.cuh); "" where there is none
    wgmma_sparse_body = ""  # the same for a sparse spec

    def wgmma(self, spec, config: Config) -> bool:
        """Whether the arch being rendered takes the Hopper body."""
        return path_of(spec, config) == "wgmma"

    def body_name(self, spec, config: Config) -> str:
        if self.wgmma(spec, config):
            return self.wgmma_sparse_body if topk(spec) else self.wgmma_body
        return self.sparse_body if topk(spec) else self.body

    def check_config(self, spec, config: Config) -> list[str]:
        problems = path_problems(spec, config) + self.partition_problems(config)
        if problems or self.wgmma(spec, config):
            return problems
        return problems + mla_geometry(spec, config)[1]

    def body_choice(self, spec, config: Config) -> tuple[str, str] | None:
        """(body, why) of the arch being rendered (`spec.targets`, one arch: kgen/bodies.py); None for
        a family with no Hopper body for this kind of spec (dense mla prefill)."""
        if not (self.wgmma_sparse_body if topk(spec) else self.wgmma_body):
            return None
        if self.wgmma(spec, config):
            geo = wgmma_geometry(spec)
            rows = "a query token" if self.rows.packed else "a sequence"
            cache = "cache" if spec.kv_cache.dtype == spec.dtype.q else f"{spec.kv_cache.dtype} cache"
            return "wgmma", (f"Hopper body: {spec.dtype.q} q and {cache}, head_dim {spec.attention.head_dim}, "
                             f"v_head_dim {spec.v_head_dim_value}: {geo.rows} heads of {rows} a block in two "
                             f"warpgroups, {geo.kv_tile}-key tiles x {geo.stages} stages; compiled for sm_90a")
        if config.get("path", 0) == 1:
            return "mma.sync", "path 1 (mma) in the config"
        return "mma.sync", f"not the Hopper body: {wgmma_refusal(spec)}"

    def main_kernel(self, spec, config: Config, grid: tuple) -> KernelDecl:
        if self.wgmma(spec, config):
            wgeo = wgmma_geometry(spec)
            return KernelDecl(spec.name, tuple(self.arguments(spec, config)), grid, wgeo.threads, smem=wgeo.smem_bytes)
        geo, problems = mla_geometry(spec, config)
        if geo is None:
            raise ValueError("; ".join(problems))
        return KernelDecl(spec.name, tuple(self.arguments(spec, config)), grid, geo.threads, smem=geo.smem_bytes)

    def notes(self, spec, rows_text: str) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        Dv = spec.v_head_dim_value
        geo = mla_geometry(spec, resolve_config(self, spec, None))[0]
        keys = ("indices", "seq_lens") if topk(spec) else ("block_tables", "seq_lens")
        return [
            f"mla layout: num_q_heads {a.num_q_heads} over one latent head, head_dim {a.head_dim} (K: the whole row), "
            f"v_head_dim {Dv} (V and out: the row's first {Dv} elements), block_size {kv.block_size}, "
            f"cache {describe(spec)}, {pool_of(spec).scale_text}",
            f"softmax scale {spec.softmax_scale_value!r} (the model's, given in the spec)",
            *([rows_text] if rows_text else []),
            *self.call_lines(spec, call_names(spec, self.rows, keys),
                             sparse_notes(spec, self.sparse_row_text) if topk(spec) else None),
            "Loads: 16-byte vectors; q, out and kv_cache pointers and strides must be multiples of 8 elements"
            + (" (kv_cache: 16 bytes)" if CacheFormat.of(spec).ds_mla else "") + ".",
            *(["fp8_ds_mla rows: bytes 0..511 e4m3 latent, 512..527 four fp32 scales (scale t for latent values "
               "128t..128t+127), 528..655 the 64 bf16 rope values; real latent = e4m3 * its tile's scale."]
              if CacheFormat.of(spec).ds_mla else []),
            f"kgen's own kernel, default config: tensor cores, {geo.rows} query rows per block in "
            f"{geo.col_warps} warps splitting v_head_dim, {geo.tile_tokens} latent rows per stage x {geo.stages} stages, "
            f"{geo.smem_bytes} bytes of dynamic shared memory.",
        ]

    # ---- the call ---------------------------------------------------------------------
    def bind_keys(self, b: AttentionBinder, num_rows: int, num_seqs: int | None, num_blocks: int, checked: bool):
        """(block_tables or a sparse spec's indices, seq_lens, max_blocks_per_seq: 0 for indices);
        `num_seqs` None: the keys' rows say how many."""
        if not topk(b.spec):
            bt, sl = b.table(num_seqs)
            return bt, sl, bt.shape[1]
        refuse_block_tables(b)
        indices = bind_indices(b, num_rows, num_blocks, checked)
        sl = b.take("seq_lens", True)
        if num_seqs is None:
            if len(sl.shape) != 1:
                raise ArgumentError(f"seq_lens: expected shape [num_seqs], got {list(sl.shape)}")
            num_seqs = sl.shape[0]
        b.check(sl, (num_seqs,), "int32", contiguous=True)
        return indices, sl, 0

    def bucket_of(self, spec, call):
        """As the attention kinds' (the block table's capacity in tokens); sparse: q's rows and the top-k."""
        if topk(spec):
            q = call.get("q")
            return None if q is None or len(q.shape) < 1 else (int(q.shape[0]), topk(spec))
        return super().bucket_of(spec, call)


class MlaDecodeFamily(MlaAttentionFamily):
    kind, rows, body = "paged_decode", DECODE_ROWS, "paged_mla_decode_body"
    sparse_body = "paged_mla_sparse_decode_body"
    wgmma_body, wgmma_sparse_body = "paged_mla_decode_wgmma_body", "paged_mla_sparse_decode_wgmma_body"
    sparse_row_text = "each sequence's query token (all its heads)"
    q_text = "absorbed query of each sequence's last token (q_nope {Dv}, then q_pe {rope})"
    perf_model, fib_kind = PerfModel.LATENT, "mla_paged_decode"  # kgen/perf/mla_model.py; kgen/fib/mla.py
    params = {**GEOMETRY_PARAMS, "partition_size": TunableParam("partition_size", 0),
              "path": TunableParam("path", 0)}  # kgen/families/attention/mla_wgmma.py's PATHS: 0 auto, 1 mma, 2 wgmma

    def default_space(self, spec) -> dict[str, list[int]]:
        return {**super().default_space(spec), "partition_size": [0, 64, 256]}

    def abi_config(self, spec) -> Config:
        # the hand-written kernel contract keeps the mma.sync launch (its rows a block), also on sm_90
        return {"partition_size": 0, "path": 1}

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        P = config["partition_size"]
        main = self.main_kernel(spec, config, (row_blocks(spec, config, self), "num_seqs", "max_partitions" if P else 1))
        return [main, merge_kernel(spec, list(main.params), DECODE_ROWS)] if P else [main]

    def schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                 partition_tokens: int | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Launch sizes for these lengths (kgen/plan/split.py: the row blocks of a sequence stand for
        its KV heads; a sparse row's keys are its top-k entries, whatever its sequence's length) and
        the kernels launched."""
        return self.split_schedule(spec, config, lengths, target_blocks, partition_tokens,
                                   row_blocks(spec, config, self), keys=topk(spec))

    def abi_notes(self, spec) -> list[str]:
        return self.notes(spec, "") + [
            "Split-KV configs add partitions on grid z and a merge kernel; a hand-written kernel implements the "
            "single-pass launch below (part_o and part_ml null, max_partitions 1)."]

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan: Plan | None = None,
             target_blocks: int | None = None):
        b = AttentionBinder(spec, call)
        q, S = b.query(DECODE_ROWS)
        pool = b.latent_pool(q)
        bt, sl, M = self.bind_keys(b, S, S, pool.num_blocks, checked)
        (scale,) = b.scales(pool, "given by the caller")
        out = b.out(q, S)
        b.aligned(out, 1, out.strides[:2])
        lse = b.lse(q, S)
        if checked and not topk(spec):
            b.check_lengths(sl, bt, pool.num_blocks, min_len=0)  # 0: a padded row (CUDA graphs)
        if plan is not None:
            lens = None
        elif topk(spec):  # the schedule sizes every sparse row by the top-k
            lens = np.zeros(S, dtype=np.int64)
        else:
            lens = host_values(sl) if sl.device == "cpu" else np.full(S, M * spec.kv_cache.block_size)
        sizes, kernels = b.planned_sizes(self, config, plan, S, {"seq_lens": lens}, target_blocks)
        part_o, part_ml = b.split_scratch(config, plan, q, sizes["max_partitions"], sizes["num_seqs"])
        b.refuse_unknown()
        written = [out, lse, part_o, part_ml]
        b.refuse_aliasing(written, [q, *pool.caches, bt, sl, scale, *written])
        values = b.values(DECODE_ROWS, q, out, pool, bt, sl, part_o, part_ml, lse, sizes, M, indices=bt)
        launches = [k.launch({**sizes, "num_seqs": S}, values, reached=pool.reached) for k in kernels]
        return launches, ((out.obj, lse.obj) if lse is not None else out.obj)

    # ---- verification and benchmarks (kgen/families/attention/mla_cases.py) ----------------
    def cases(self, spec, config: Config, rng: np.random.Generator):
        if topk(spec):
            return sparse_cases.decode_cases(spec, config, rng)
        return mla_cases.matrix_cases(spec, config, rng)

    def run_case(self, kernel, case, rng: np.random.Generator):
        if topk(kernel.spec):
            return sparse_cases.run_decode_case(kernel, case, rng)
        return mla_cases.run_case(kernel, case, rng)

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        if topk(spec):
            return sparse_cases.decode_bench(spec, bucket, rng)
        return mla_cases.bench(spec, bucket, rng)


class MlaPrefillFamily(MlaAttentionFamily):
    kind, rows, body = "paged_prefill", PREFILL_ROWS, "paged_mla_prefill_body"
    sparse_body = "paged_mla_sparse_prefill_body"
    wgmma_sparse_body = "paged_mla_sparse_prefill_wgmma_body"  # dense prefill has no Hopper body
    sparse_row_text = "each query token (all its heads)"
    q_text = "absorbed queries (q_nope {Dv}, then q_pe {rope}), packed by sequence (q_indptr)"
    single_pass_scratch = False  # ABI 1's single-pass table has no split scratch
    params = {**GEOMETRY_PARAMS, "partition_size": TunableParam("partition_size", 0),
              "path": TunableParam("path", 0)}  # path: sparse specs' body, mla_wgmma.py's PATHS
    fib_kind = "mla_paged_prefill"  # kgen/fib/mla.py

    def causal(self, spec) -> bool:
        return spec.attention.causal and not topk(spec)

    def split(self, spec, config: Config) -> bool:
        return super().split(spec, config) and not topk(spec)  # the single-pass table is ABI 1's

    def check_config(self, spec, config: Config) -> list[str]:
        if topk(spec) and config.get("partition_size", 0):
            return [f"partition_size {config['partition_size']}: split-KV is not built for sparse mla prefill "
                    "(attention.sparse_topk; allowed: 0)"]
        return super().check_config(spec, config)

    def default_space(self, spec) -> dict[str, list[int]]:
        space = super().default_space(spec)
        return space if topk(spec) else {**space, "partition_size": [0, 64, 256]}

    def abi_config(self, spec) -> Config:
        # the hand-written kernel contract: the single-pass launch of the mma.sync body (its rows a block),
        # also on sm_90
        return {"partition_size": 0, "path": 1}

    def params_structs(self, spec, kernels: list[KernelDecl]) -> tuple[str, str | None]:
        """Dense prefill's merge is the packed-row merge, which takes MergeParams."""
        return (kernels[0].params_struct("Params", BODY_ABSENT),
                kernels[1].params_struct("MergeParams", BODY_DEFAULTS) if len(kernels) > 1 else None)

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        if topk(spec):  # a block per (query token, head tile): every token is a row of its own
            return [self.main_kernel(spec, config, ("num_q_tokens", row_blocks(spec, config, self), 1))]
        split = bool(config["partition_size"])
        main = self.main_kernel(spec, config, ("q_row_blocks", "num_seqs", "max_partitions" if split else 1))
        return [main, merge_kernel(spec, list(main.params), PREFILL_ROWS)] if split else [main]

    def schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                 partition_tokens: int | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Launch sizes for these chunks: one block per 16 * row_tiles rows of the longest chunk and
        sequence, and (split configs) per partition of the longest sequence (decode's planner,
        kgen/plan/split.py: a sequence's row blocks stand for its KV heads)."""
        if topk(spec):
            if partition_tokens:
                raise ArgumentError(f"partition_tokens {partition_tokens}: sparse mla prefill has no split-KV")
            ind = np.asarray(lengths.get("q_indptr", [0]), dtype=np.int64).reshape(-1)
            sizes = {"num_seqs": int(ind.size - 1), "num_q_tokens": int(ind[-1]), "max_partitions": 1,
                     "partition_tokens": 0, "q_row_blocks": q_row_blocks(spec, config, ind)}
            return sizes, self.kernels(spec, config)
        sizes, _, ind, kernels = self.packed_split(spec, config, lengths, target_blocks, partition_tokens, 1,
                                                   spec.attention.num_q_heads, 16 * config["row_tiles"])
        return {**sizes, "q_row_blocks": q_row_blocks(spec, config, ind)}, kernels

    def abi_notes(self, spec) -> list[str]:
        rows = 16 * resolve_config(self, spec, None)["row_tiles"]
        if topk(spec):
            return self.notes(spec, "Query row j of sequence s is q's row q_indptr[s] + j; indices row t belongs to "
                              "q's row t.") + [
                f"Grid: x = num_q_tokens, y = ceil({spec.attention.num_q_heads} / {rows}) tiles of {rows} heads."]
        visible = "keys 0 .. p" if spec.attention.causal else "all seq_len keys (causal: false)"
        return self.notes(spec, "Query row j of sequence s (rows q_indptr[s] ..) sits at position p = seq_lens[s] - "
                          f"q_len + j and sees {visible}. A sequence with q_len 0 writes nothing.") + [
            f"Grid x: q_row_blocks = ceil(max q_len * {spec.attention.num_q_heads} / {rows}) tiles of {rows} (token, "
            "head) rows, token-major, of each sequence (grid y); blocks past a sequence's rows exit.",
            "Split-KV configs add part_o, part_ml, max_partitions and partition_tokens, partitions on grid z and a "
            "merge kernel; a hand-written kernel implements the single-pass launch below."]

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan: Plan | None = None,
             target_blocks: int | None = None):
        b = AttentionBinder(spec, call)
        q, T = b.query(PREFILL_ROWS)
        pool = b.latent_pool(q)
        bt, sl, M = self.bind_keys(b, T, None, pool.num_blocks, checked)
        S = sl.shape[0]
        ind = b.take("q_indptr", True)
        b.check(ind, (S + 1,), "int32", contiguous=True)
        (scale,) = b.scales(pool, "given by the caller")
        out = b.out(q, T)
        lse = b.lse(q, T)
        if plan is not None and topk(spec):
            raise ArgumentError("plan: sparse mla prefill has no call-time plan (no split-KV); call it without one")
        if checked and not topk(spec):  # before planning: the plan trusts q_indptr and seq_lens
            b.check_lengths(sl, bt, pool.num_blocks, q_lens=checked_q_lens(host_values(ind), T), min_len=0)
        elif checked:
            checked_q_lens(host_values(ind), T)
        if topk(spec):
            sizes, kernels = self.schedule(spec, config, {"q_indptr": host_values(ind) if ind.device == "cpu"
                                                          else np.asarray([0, T])}, 0)
        else:  # without a plan: host lengths are planned for; device ones by shapes (full tables, rows spread evenly)
            lens = None if plan is not None else call_lengths(sl, ind, T, M * spec.kv_cache.block_size)
            sizes, kernels = b.planned_sizes(self, config, plan, S, lens, target_blocks)
        part_o, part_ml = b.split_scratch(config, plan, q, sizes["max_partitions"], planned_rows(plan, T) if T else 0)
        b.refuse_unknown()
        written = [out, lse, part_o, part_ml]
        b.refuse_aliasing(written, [q, *pool.caches, ind, bt, sl, scale, *written])
        values = b.values(PREFILL_ROWS, q, out, pool, bt, sl, part_o, part_ml, lse, sizes, M, q_indptr=ind,
                          indices=bt, num_seqs=S)
        # grid x from the call's own chunks (a plan may be for others; a device q_indptr: all rows in one chunk)
        grid = {**sizes, "num_seqs": S, "num_q_tokens": T,
                "q_row_blocks": q_row_blocks(spec, config, host_values(ind) if ind.device == "cpu" else [0, T])}
        launches = [k.launch(grid, values, reached=pool.reached) for k in kernels] if T else []
        return launches, ((out.obj, lse.obj) if lse is not None else out.obj)

    def cases(self, spec, config: Config, rng: np.random.Generator):
        if topk(spec):
            return sparse_cases.prefill_cases(spec, config, rng)
        return mla_cases.prefill_matrix_cases(spec, config, rng)

    def run_case(self, kernel, case, rng: np.random.Generator):
        if topk(kernel.spec):
            return sparse_cases.run_prefill_case(kernel, case, rng)
        return mla_cases.run_prefill_case(kernel, case, rng)

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        if topk(spec):
            return sparse_cases.prefill_bench(spec, bucket, rng)
        return mla_cases.prefill_bench(spec, bucket, rng)


def decode_geometry(spec, config: Config, family: MlaAttentionFamily | None = None):
    """The geometry of the body the arch being rendered takes (of `family`, mla decode unless given):
    MlaWgmmaGeometry (the Hopper body) or MlaGeometry (mma.sync); both give rows, threads, stages,
    tile_tokens and smem_bytes."""
    return wgmma_geometry(spec) if (family or MLA_DECODE).wgmma(spec, config) else mla_geometry(spec, config)[0]


def row_blocks(spec, config: Config, family: MlaAttentionFamily | None = None) -> int:
    """Blocks per row (decode: sequence; sparse prefill: token) along the head axis: the query heads
    in tiles of 16 * row_tiles (the Hopper body: 64)."""
    return -(-spec.attention.num_q_heads // decode_geometry(spec, config, family).rows)


def q_row_blocks(spec, config: Config, q_indptr) -> int:
    """Grid x of dense mla prefill: the row blocks of 16 * row_tiles (token, head) rows of the longest chunk."""
    longest = int(np.diff(np.asarray(q_indptr, dtype=np.int64).reshape(-1)).max(initial=0))
    return max(1, -(-longest * spec.attention.num_q_heads // (16 * config["row_tiles"])))


# What the mla bodies read that a kernel does not take (kgen/families/argtable.py): a single pass's split-KV
# scratch, and sinks, which the mla layout has none of (the shared epilogue, attention/epilogue.cuh, reads them)
BODY_ABSENT = {"part_o": ("float*", "nullptr"), "part_ml": ("float*", "nullptr"), "max_partitions": ("int", "1"),
               "partition_tokens": ("int", "0"), "sinks": ("const float*", "nullptr")}


MLA_DECODE = MlaDecodeFamily()
MLA_PREFILL = MlaPrefillFamily()
