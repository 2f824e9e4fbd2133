"""The paged-prefill family (docs/prefill-family.md, docs/abi.md): chunks of query tokens, packed
by sequence (q_indptr), against their sequences' paged KV caches, the chunk's own K/V included
(seq_lens counts them). Tensor cores (mma.sync m16n8k16) for fp16/bf16 q, fp32 FMAs for fp32 q;
K/V tiles streamed by a cp.async pipeline (`stages`); split over KV partitions chosen at call time
by the plan (decode's planner, kgen/families/decode_split.py) with a merge kernel. The argument
table here is the kernel ABI; the call binding checks a call against it and packs the launches."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, as_array_arg, empty_like_library
from kgen.dtypes import dtype
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array, scalar, stride
from kgen.families.attention import prefill_cases
from kgen.families.attention.decode import _PARTITION_TOKENS, MERGE_THREADS, _Binder, _c_float, vector_width
from kgen.families.base import Config, FamilyBase, TunableParam, resolve_config
from kgen.families.binding import host_values
from kgen.families.decode_split import check_forced_partition, choose_split
from kgen.families.layout import (
    SCALE_MODES,
    bind_scales,
    cache_args,
    cache_names,
    cache_rows,
    cache_shapes,
    cache_strides,
    describe,
    layout_problems,
    scale_args,
    stride_args,
    stride_values,
    vllm_x,
)
from kgen.plan import DEFAULT_TARGET_BLOCKS, Plan

WARPS = (1, 2, 4, 8)
KV_TILES = (16, 32, 64, 128)
STAGES = (1, 2, 3, 4)
AUTO_STAGES = 2  # `stages: 0`: one tile in flight while one is computed, where shared memory allows
KV_PATHS = ("copy", "stage", "gather")  # the template's KV_PATH is the index
SMEM_TARGET = 96 * 1024  # the automatic tile choice stays under this (occupancy)
SMEM_LIMIT = 163 * 1024  # opt-in dynamic shared memory of sm_80 (sm_90: 227 KiB)
OUT_SLICE = 256  # output columns per block: larger heads are sliced over grid z


def tiles(spec, config: Config) -> tuple[int, int]:
    """(warps, kv_tile) of a config; 0 means automatic: 4 warps and 64-key tiles (32 past head_dim
    128), halved while the shared memory exceeds SMEM_TARGET: the one with more rows in shared
    memory first (the Q tile's 16 * warps, or the stages' 2 * stages * kv_tile), warps on a tie."""
    auto_w, auto_t = not config.get("warps", 0), not config.get("kv_tile", 0)
    warps = config.get("warps", 0) or 4
    kv_tile = config.get("kv_tile", 0) or (64 if spec.attention.head_dim <= 128 else 32)
    stages = stages_of(spec, config)
    while smem_bytes(spec, warps, kv_tile, stages) > SMEM_TARGET:
        can_w, can_t = auto_w and warps > 1, auto_t and kv_tile > 16
        if can_w and (not can_t or 16 * warps >= 2 * stages * kv_tile):
            warps //= 2
        elif can_t:
            kv_tile //= 2
        else:
            break
    return warps, kv_tile


def stages_of(spec, config: Config) -> int:
    """The pipeline depth of a config: its `stages`, or for 0 (automatic) AUTO_STAGES, one stage
    when even the smallest automatic tiles need more shared memory than SMEM_LIMIT with it (wide
    heads of a staged cache: head_dim 512 of an fp32 cache)."""
    if config.get("stages", 0):
        return config["stages"]
    fits = smem_bytes(spec, *tiles(spec, {**config, "stages": AUTO_STAGES}), AUTO_STAGES) <= SMEM_LIMIT
    return AUTO_STAGES if fits else 1


def kv_path(spec) -> str:
    """How K/V tiles reach the MMA operand tiles in shared memory: "copy", cp.async straight into
    them (a cache in q's type, unscaled, 16-byte vectors); "stage", cp.async of the stored bytes
    into a staging tile, then one pass dequantizes it with the packed conversions (quantized or
    wider caches); "gather", plain loads that dequantize on the way (a VEC-element chunk of a key's
    row that is not contiguous in memory, as in vLLM's head_dim-major V, or a copy of 1 or 2 bytes)."""
    kv, D = spec.kv_cache, spec.attention.head_dim
    vec, item = vector_width(spec), dtype(kv.dtype).itemsize
    k_run, v_run = (vllm_x(spec), 1) if kv.layout == "vllm" else (D, D)
    if k_run % vec or v_run % vec or vec * item not in (4, 8, 16):
        return "gather"
    if kv.dtype == spec.dtype.q and kv.scale == "none" and vec * item == 16:
        return "copy"
    return "stage"


def smem_bytes(spec, warps: int, kv_tile: int, stages: int = 2) -> int:
    """The Q tile, then K/V (templates/common/paged_prefill.cuh, PrefillShape): operand tiles in q's
    type with rows padded by 16 bytes, `stages` of them on the copy path; on the stage path one
    operand pair plus `stages` staging tiles as stored (and per-token scales); on the gather path one
    operand pair. Plus fp32 P per warp where the products are fp32 FMAs (fp32 q, or a target older
    than sm_80: no mma.sync m16n8k16)."""
    item = dtype(spec.dtype.q).itemsize
    ld = -(-spec.attention.head_dim // 16) * 16 + 16 // item
    tile = kv_tile * ld * item
    path = kv_path(spec)
    if path == "copy":
        kv = stages * 2 * tile
    elif path == "stage":
        raw = -(-kv_tile * spec.attention.head_dim * dtype(spec.kv_cache.dtype).itemsize // 16) * 16
        kv = 2 * tile + stages * (2 * raw + (8 * kv_tile if spec.kv_cache.scale == "per_token_head" else 0))
    else:
        kv = 2 * tile
    fma = item == 4 or any(int(arch.removeprefix("sm_")) < 80 for arch in spec.targets)
    return 16 * warps * ld * item + kv + (warps * 16 * kv_tile * 4 if fma else 0)


def slices(spec) -> int:
    return -(-spec.attention.head_dim // OUT_SLICE)


class PagedPrefillFamily(FamilyBase):
    kind = "paged_prefill"
    template = "paged_prefill.cu.j2"
    params = {"warps": TunableParam("warps", 0), "kv_tile": TunableParam("kv_tile", 0),
              "stages": TunableParam("stages", 0), "partition_size": TunableParam("partition_size", 256)}

    # ---- generation -------------------------------------------------------------------
    def unsupported(self, spec) -> list[str]:
        return layout_problems(spec)

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
        p = config["partition_size"]
        if p < 0 or p % 16:
            problems.append(f"partition_size must be 0 or a positive multiple of 16 (got {p})")
        if not problems:
            need = smem_bytes(spec, *tiles(spec, config), stages_of(spec, config))
            if need > SMEM_LIMIT:
                problems.append(f"warps, kv_tile and stages need {need} bytes of shared memory, more than "
                                f"{SMEM_LIMIT}: use fewer warps or stages or a smaller kv_tile")
        return problems

    def abi_config(self, spec) -> Config:
        return {"partition_size": 0}  # a hand-written kernel implements the single-pass launch

    def default_space(self, spec) -> dict[str, list[int]]:
        return {"warps": [2, 4], "kv_tile": [32, 64], "stages": [1, 2], "partition_size": [0, 256]}

    def arguments(self, spec, config: Config) -> list[Arg]:
        a, d = spec.attention, spec.dtype
        Hq, D = a.num_q_heads, a.head_dim
        single_pass = not config["partition_size"]
        return [
            array("out", d.resolved_out, "output", ("num_q_tokens", Hq, D), "attention output of each query row"),
            array("q", d.q, "input", ("num_q_tokens", Hq, D), "queries, packed by sequence (q_indptr)"),
            *cache_args(spec, "input", const=True),
            array("q_indptr", "int32", "input", ("num_seqs + 1",),
                  "sequence s owns query rows q_indptr[s] .. q_indptr[s+1]-1; q_indptr[0] = 0, non-decreasing"),
            array("block_tables", "int32", "input", ("num_seqs", "max_blocks_per_seq"),
                  "physical block ids; entries past ceil(seq_len / block_size) are never read"),
            array("seq_lens", "int32", "input", ("num_seqs",),
                  "KV tokens of each sequence including its chunk; q_len <= seq_len <= max_blocks_per_seq * "
                  "block_size"),
            *scale_args(spec),
            array("alibi_slopes", "fp32", "input", (Hq,),
                  "ALiBi slope of each query head" if a.alibi else "null: the spec has no ALiBi", optional=not a.alibi),
            array("part_o", "fp32", "scratch", ("num_q_tokens", Hq, "max_partitions", D),
                  "split-KV: each partition's normalised output (null without split)", optional=single_pass),
            array("part_ml", "fp32", "scratch", ("num_q_tokens", Hq, "max_partitions", 2),
                  "split-KV: each partition's (max, sum) of exp (null without split)", optional=single_pass),
            array("lse", "fp32", "output", ("num_q_tokens", Hq),
                  "natural-log log-sum-exp of the final logits, -inf for no key (null unless requested)",
                  optional=True),
            scalar("num_seqs", "int32", "sequences in the batch"),
            scalar("max_blocks_per_seq", "int32", "columns of block_tables"),
            scalar("max_partitions", "int32", "partitions per sequence (grid z / head_dim slices); 1 without split"),
            stride("q_s_tok", "q stride between query rows"), stride("q_s_head", "q stride between heads"),
            stride("o_s_tok", "out stride between query rows"), stride("o_s_head", "out stride between heads"),
            *stride_args(),
            *([] if single_pass else [_PARTITION_TOKENS]),
        ]

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        a, P = spec.attention, config["partition_size"]
        warps, kv_tile = tiles(spec, config)
        table = self.arguments(spec, config)
        main = KernelDecl(spec.name, tuple(table), ("q_tiles", a.num_kv_heads, "z"), 32 * warps,
                          smem=smem_bytes(spec, warps, kv_tile, stages_of(spec, config)))
        if not P:
            return [main]
        by_name = {arg.name: arg for arg in table}
        reads = [replace(by_name[n], ctype="const " + by_name[n].ctype, role="input") for n in ("part_o", "part_ml")]
        merge = KernelDecl(f"{spec.name}_merge", (by_name["out"], *reads, *(by_name[n] for n in (
            "lse", "q_indptr", "seq_lens", "num_seqs", "max_partitions", "partition_tokens", "o_s_tok",
            "o_s_head"))),
            (a.num_q_heads, "num_q_tokens", 1), MERGE_THREADS)
        return [main, merge]

    def template_context(self, spec, config: Config) -> dict[str, Any]:
        a, kv = spec.attention, spec.kv_cache
        layout_vllm = kv.layout == "vllm"
        warps, kv_tile = tiles(spec, config)
        kernels = self.kernels(spec, config)
        return {
            "q_ctype": dtype(spec.dtype.q).ctype,
            "out_ctype": dtype(spec.dtype.resolved_out).ctype,
            "kv_ctype": dtype(kv.dtype).ctype,
            "scale_mode": SCALE_MODES[kv.scale],
            "softmax_scale": _c_float(spec.softmax_scale_value),
            "sliding_window": int(a.sliding_window or 0),
            "soft_cap": _c_float(a.logits_soft_cap or 0.0),
            "k_run": vllm_x(spec) if layout_vllm else a.head_dim,
            "v_run": 1 if layout_vllm else a.head_dim,
            "vec": vector_width(spec),
            "warps": warps,
            "kv_tile": kv_tile,
            "stages": stages_of(spec, config),
            "kv_path": KV_PATHS.index(kv_path(spec)),
            "smem_bytes": kernels[0].smem,
            "partition_size": config["partition_size"],
            "main": kernels[0],
            "merge": kernels[1] if len(kernels) > 1 else None,
        }

    def abi_notes(self, spec) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        rows = 16 * tiles(spec, resolve_config(self, spec, self.abi_config(spec)))[0]  # the ABI launch's
        names = ["q", *cache_names(spec), "q_indptr", "block_tables", "seq_lens"]
        names += ["k_scale", "v_scale"] if kv.scale != "none" else []
        names += ["alibi_slopes"] if a.alibi else []
        visible = ("keys p-" + str(a.sliding_window - 1) + " .. p" if a.sliding_window else "keys 0 .. p") \
            if a.causal else "all seq_len keys (causal: false)"
        return [
            f"num_q_heads {a.num_q_heads}, num_kv_heads {a.num_kv_heads} (query head h reads KV head h / "
            f"{spec.group_size}), head_dim {a.head_dim}, block_size {kv.block_size}, cache {describe(spec)}, "
            f"scale {kv.scale}",
            f"softmax scale {spec.softmax_scale_value!r}"
            + (f", logits soft-cap {a.logits_soft_cap} (s = cap*tanh(s/cap), applied before ALiBi)"
               if a.logits_soft_cap else "")
            + (", ALiBi: logit += alibi_slopes[h] * (key - p)" if a.alibi else ""),
            "Query row j of sequence s (rows q_indptr[s] ..) sits at position p = seq_lens[s] - q_len + j, "
            f"q_len = q_indptr[s+1] - q_indptr[s], and sees {visible}. A sequence with q_len 0 writes nothing.",
            "",
            f"Call: kern({', '.join(names)}, out=None, return_lse=False) -> out, or (out, lse); the cache arrays:",
            *cache_rows(spec),
            "",
            "Rules: slots past a sequence's length in its last block hold garbage and must not be read"
            + ("" if spec.tail_masking else
               " (tail_masking: false: every seq_len is promised to be a multiple of block_size)") + ".",
            f"Loads: {vector_width(spec)} elements per vector load; pointers and strides must keep them aligned.",
            f"Grid x: q_tiles = ceil(num_q_tokens * {spec.group_size} / {rows}) + num_seqs: blockIdx.x counts the "
            f"tiles of {rows} packed (token, group head) rows of every sequence in order (spare blocks exit); "
            f"grid z: {slices(spec)} slice(s) of {min(OUT_SLICE, a.head_dim)} output columns.",
            "A hand-written kernel implements the single-pass launch below (part_o and part_ml null, max_partitions "
            "1); kgen's split-KV configs add partitions on grid z and a merge kernel.",
        ]

    # ---- the call ---------------------------------------------------------------------
    def schedule(self, spec, config: Config, seq_lens: np.ndarray, target_blocks: int, partition_tokens: int | None = None,
                 q_indptr: np.ndarray | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Launch sizes for these lengths and chunks (decode's planner, kgen/families/decode_split.py:
        one block per (tile of query rows, KV head, partition)) and the kernels launched."""
        if q_indptr is None:
            raise ArgumentError(f"q_indptr: required to plan a {spec.kind} call: kern.plan(seq_lens, q_indptr=...)")
        granule = config["partition_size"]
        check_forced_partition(partition_tokens, granule)
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        ind = np.asarray(q_indptr, dtype=np.int64).reshape(-1)
        if ind.size != lens.size + 1 or ind[0] != 0 or np.any(np.diff(ind) < 0):
            raise ArgumentError(f"q_indptr: expected {lens.size + 1} non-decreasing offsets from 0 (one more than "
                                f"seq_lens), got {ind.tolist()!r:.80}")
        q_lens = np.diff(ind)
        bad = np.nonzero(q_lens > lens)[0]
        if bad.size:
            s = int(bad[0])
            raise ArgumentError(f"sequence {s}: q_len = {int(q_lens[s])} is larger than seq_lens[{s}] = {int(lens[s])}")
        warps, _ = tiles(spec, config)
        row_tiles = -(-q_lens * spec.group_size // (16 * warps))
        window = spec.attention.sliding_window or 0
        split = choose_split(np.where(q_lens > 0, lens, 0), spec.attention.num_kv_heads, target_blocks, granule,
                             q_lens + window - 1 if window else 0, partition_tokens, row_tiles)
        T = int(ind[-1])
        sizes = {"num_seqs": int(lens.size), "num_q_tokens": T, "max_partitions": split.max_partitions,
                 "partition_tokens": split.partition_tokens, "q_tiles": int(np.sum(row_tiles)) + int(lens.size),
                 "z": split.max_partitions * slices(spec)}
        kernels = self.kernels(spec, config)
        return sizes, kernels if split.merged else kernels[:1]

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan: Plan | None = None,
             target_blocks: int | None = None):
        """Check the call's arguments against the ABI and return (launches, result); without a plan
        the call plans itself from its lengths (host arrays) or its shapes."""
        return _PrefillBinder(spec, call).bind_prefill(self, config, checked, plan,
                                                       target_blocks or DEFAULT_TARGET_BLOCKS)

    # ---- verification and benchmarks (kgen/families/attention/prefill_cases.py) -------------------
    def cases(self, spec, config: Config, rng: np.random.Generator):
        return prefill_cases.matrix_cases(spec, config, rng)

    def run_case(self, kernel, case, rng: np.random.Generator):
        return prefill_cases.run_case(kernel, case, rng)

    def bucket_of(self, spec, call):
        """batch = sequences (block-table rows), context = the block table's capacity in tokens."""
        bt = call.get("block_tables")
        if bt is None or len(bt.shape) != 2:
            return None
        return int(bt.shape[0]), int(bt.shape[1]) * spec.kv_cache.block_size

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        return prefill_cases.bench(spec, bucket, rng)


class _PrefillBinder(_Binder):
    """Checks one prefill call's arguments and plans its launches (decode's checks of caches,
    alignment and scales; q_indptr and the chunk lengths in addition)."""

    def bind_prefill(self, family: PagedPrefillFamily, config: Config, checked: bool, plan: Plan | None,
                     target_blocks: int):
        spec, a, kv = self.spec, self.spec.attention, self.spec.kv_cache
        D, B, Hq = a.head_dim, kv.block_size, a.num_q_heads
        q = self.take("q", True)
        self.device = q.device
        if len(q.shape) != 3:
            raise ArgumentError(f"q: expected shape [num_q_tokens, {Hq}, {D}], got {list(q.shape)}")
        T = q.shape[0]
        self.check(q, (T, Hq, D), spec.dtype.q)

        self.refuse_other_layouts()
        caches = [self.take(n, True) for n in cache_names(spec)]
        N = caches[0].shape[0] if caches[0].shape else 0
        for c, shape in zip(caches, cache_shapes(spec, N).values(), strict=True):
            self.check(c, shape, kv.dtype)
        vec = vector_width(spec)
        st = cache_strides(spec, caches)
        if kv.layout == "vllm":
            self._aligned(caches[0], min(vec, vllm_x(spec)), st.k)
        else:
            for c in caches:
                self._aligned(c, vec, (*st.k[:3], *st.v[:3], 0, st.v_offset))

        bt = self.take("block_tables", True)
        if len(bt.shape) != 2:
            raise ArgumentError(f"block_tables: expected shape [num_seqs, max_blocks_per_seq], got {list(bt.shape)}")
        S, M = bt.shape
        self.check(bt, (S, M), "int32", contiguous=True)
        sl = self.take("seq_lens", True)
        self.check(sl, (S,), "int32", contiguous=True)
        ind = self.take("q_indptr", True)
        self.check(ind, (S + 1,), "int32", contiguous=True)
        (ks, vs), scale_strides = bind_scales(self, spec, N)

        alibi = self.take("alibi_slopes", False)
        if a.alibi:
            if alibi is None:
                raise ArgumentError(f"alibi_slopes: required (spec has alibi: true), fp32 shape [{Hq}]")
            self.check(alibi, (Hq,), "fp32", contiguous=True)
        elif alibi is not None:
            raise ArgumentError("alibi_slopes: given, but the spec has alibi: false")

        out = self.take("out", False)
        out_dtype = spec.dtype.resolved_out
        if out is None:
            out = as_array_arg("out", empty_like_library(q, (T, Hq, D), out_dtype))
        self.check(out, (T, Hq, D), out_dtype)
        return_lse = bool(self.call.pop("return_lse", False))
        lse = as_array_arg("lse", empty_like_library(q, (T, Hq), "fp32")) if return_lse else None
        if checked:  # before planning: the plan trusts q_indptr and seq_lens
            self._check_prefill_values(ind, bt, sl, N, M, T)
        if plan is None:  # host lengths are planned for; device ones by shapes (full tables, rows spread evenly)
            if sl.device == "cpu" and ind.device == "cpu":
                lens, indptr = host_values(sl), host_values(ind)
            else:
                per_seq = -(-T // max(S, 1))
                lens, indptr = np.full(S, max(M * B, per_seq)), np.minimum(np.arange(S + 1) * per_seq, T)
            sizes, kernels = family.schedule(spec, config, lens, target_blocks, q_indptr=indptr)
            rows_planned = T
        else:
            sizes, kernels = self._planned(family, config, plan, S)
            rows_planned = plan.sizes["num_q_tokens"]
            if T > rows_planned:
                raise ArgumentError(f"plan: made for at most {rows_planned} query rows, the call has {T} "
                                    "(make the plan for the largest batch)")
        max_parts = sizes["max_partitions"]
        part_o = part_ml = None
        if max_parts > 1 and T:  # scratch for the plan's rows: the plan's own (made at its first call)
            part_o = self._scratch(plan, q, None, "part_o", (rows_planned, Hq, max_parts, D))
            part_ml = self._scratch(plan, q, None, "part_ml", (rows_planned, Hq, max_parts, 2))
        self.refuse_unknown()
        self.refuse_aliasing([out, lse], [q, *caches, ind, bt, sl, ks, vs, alibi])

        ptr = self.pointer
        values = {
            "out": ptr(out), "q": ptr(q), "k_cache": self.raw(st.k_base), "v_cache": self.raw(st.v_base),
            "q_indptr": ptr(ind), "block_tables": ptr(bt), "seq_lens": ptr(sl), "k_scale": ptr(ks),
            "v_scale": ptr(vs), "alibi_slopes": ptr(alibi), "part_o": ptr(part_o), "part_ml": ptr(part_ml),
            "lse": ptr(lse), "num_seqs": S, "max_blocks_per_seq": M, "max_partitions": max_parts,
            "partition_tokens": sizes["partition_tokens"],
            "q_s_tok": q.strides[0], "q_s_head": q.strides[1], "o_s_tok": out.strides[0],
            "o_s_head": out.strides[1], **stride_values(st, scale_strides),
        }
        rows = kernels[0].block // 32 * 16  # grid x from the call's shapes (a plan may be for other chunks)
        grid = {"q_tiles": -(-T * spec.group_size // rows) + S, "num_q_tokens": T, "z": max_parts * slices(spec)}
        reached = [c.native for c in caches]  # fused: K/V by address (an isolated child maps them too)
        launches = [k.launch(grid, values, reached) for k in kernels] if T else []  # no query row: nothing to launch
        result = (out.obj, lse.obj) if lse is not None else out.obj
        return launches, result

    def _check_prefill_values(self, ind: ArrayArg, bt: ArrayArg, sl: ArrayArg, num_blocks: int, max_blocks: int,
                              num_rows: int):
        """Host-side checks of the values the kernel trusts: q_indptr, the chunk and KV lengths, the
        block-table entries the kernel reads."""
        spec, B = self.spec, self.spec.kv_cache.block_size
        indptr = host_values(ind).astype(np.int64)
        lens = host_values(sl).astype(np.int64)
        table = host_values(bt)
        if indptr[0] != 0:
            raise ArgumentError(f"q_indptr[0] = {int(indptr[0])}: must be 0 (sequence 0 starts at query row 0)")
        q_lens = np.diff(indptr)
        bad = np.nonzero(q_lens < 0)[0]
        if bad.size:
            s = int(bad[0])
            raise ArgumentError(f"q_indptr[{s + 1}] = {int(indptr[s + 1])} < q_indptr[{s}] = {int(indptr[s])}: "
                                f"q_indptr must be non-decreasing (sequence {s} would have a negative q_len)")
        if indptr[-1] != num_rows:
            raise ArgumentError(f"q_indptr[{len(indptr) - 1}] = {int(indptr[-1])}: must equal the number of query "
                                f"rows, q.shape[0] = {num_rows}")
        cap = max_blocks * B
        bad = np.nonzero((lens < 0) | (lens > cap))[0]
        if bad.size:
            i = int(bad[0])
            raise ArgumentError(f"seq_lens[{i}] = {int(lens[i])}: must be in 0..{cap} "
                                f"(max_blocks_per_seq {max_blocks} × block_size {B})")
        bad = np.nonzero(q_lens > lens)[0]
        if bad.size:
            s = int(bad[0])
            raise ArgumentError(f"sequence {s}: q_len = q_indptr[{s + 1}] - q_indptr[{s}] = {int(q_lens[s])} is "
                                f"larger than seq_lens[{s}] = {int(lens[s])} (seq_lens counts the KV tokens "
                                "including the chunk)")
        if not spec.tail_masking:
            bad = np.nonzero(lens % B)[0]
            if bad.size:
                i = int(bad[0])
                raise ArgumentError(
                    f"seq_lens[{i}] = {int(lens[i])} is not a multiple of block_size {B}: the spec has "
                    f"tail_masking: false, a promise that every length is")
        # The entries the kernel reads: from the window of the chunk's first row to ceil(seq_len / B);
        # a sequence without query rows reads none.
        window = spec.attention.sliding_window or 0
        first = np.maximum(0, lens - q_lens - window + 1) // B if window else np.zeros_like(lens)
        last = np.where(q_lens > 0, -(-lens // B), 0)
        cols = np.arange(table.shape[1])
        used = (cols >= first[:, None]) & (cols < last[:, None])
        wrong = np.argwhere(used & ((table < 0) | (table >= num_blocks)))
        if wrong.size:
            i, j = (int(x) for x in wrong[0])
            raise ArgumentError(
                f"block_tables[{i}, {j}] = {int(table[i, j])}: not a block of the pool "
                f"(0..{num_blocks - 1}); sequence {i} has {int(lens[i])} tokens"
            )


PAGED_PREFILL = PagedPrefillFamily()
