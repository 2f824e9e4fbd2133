"""The paged-prefill family (docs/prefill-family.md, docs/abi.md): chunks of query tokens, packed
by sequence (q_indptr), against their sequences' paged KV caches, the chunk's own K/V included
(seq_lens counts them). Tensor cores (mma.sync m16n8k16) for fp16/bf16 q, fp32 FMAs for fp32 q;
K/V tiles streamed by a cp.async pipeline (`stages`); split over KV partitions chosen at call time
by the plan (decode's planner, kgen/plan/split.py) with a merge kernel. The argument
table here is the kernel ABI; the call binding checks a call against it and packs the launches."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.errors import ArgumentError
from kgen.families.argtable import KernelDecl
from kgen.families.attention import prefill_cases
from kgen.families.attention.common import (
    PREFILL_ROWS,
    AttentionBinder,
    AttentionFamily,
    checked_q_lens,
    merge_kernel,
    sinks_note,
    template_context,
)
from kgen.families.attention.decode_geometry import vector_width
from kgen.families.base import Config, PerfModel, TunableParam, resolve_config
from kgen.families.binding import host_values
from kgen.formats.cache import (
    BLOCK_GROUP,
    CacheFormat,
    describe,
    head_dims_text,
    scale_dtype,
    vllm_x,
)
from kgen.formats.dtypes import dtype
from kgen.plan import DEFAULT_TARGET_BLOCKS, Plan
from kgen.plan.arch import limits_for, smem_limit
from kgen.plan.split import (
    STEP_TOKENS,
    Split,
    check_forced_partition,
    choose_split,
    working_partitions,
)

WARPS = (1, 2, 4, 8)
KV_TILES = (16, 32, 64, 128)
STAGES = (1, 2, 3, 4)
M_TILES = (1, 2)  # m16 row tiles per warp
MAX_REGISTERS = 232  # the main kernel's cap (__maxnreg__): ptxas takes up to 255 when free to, none spill at 232
M2_ACCUMULATORS = 160  # the most fp32 accumulators (O and S) a lane holds with 2 m tiles (automatic m_tiles)
AUTO_STAGES = 2  # `stages: 0`: one tile in flight while one is computed, where shared memory allows
KV_PATHS = ("copy", "stage", "gather")  # the template's KV_PATH is the index
SMEM_TARGET = 96 * 1024  # the automatic tile choice stays under this (occupancy)
OUT_SLICE = 256  # output columns per block: larger heads are sliced over grid z
PATHS = ("auto", "mma", "wgmma")  # the `path` parameter's values (its index): auto = wgmma where it builds
WGMMA_WARPS = (4, 8)  # consumer warps of the Hopper path: one or two warpgroups of 64 rows
WGMMA_BARRIER_BYTES = 16 * max(STAGES)  # the full/empty mbarriers (static shared memory)


def path_of(spec, config: Config) -> str:
    """The body a config builds: "wgmma" (the Hopper path, templates/common/paged_prefill_wgmma.cuh)
    or "mma" (paged_prefill.cuh). `path` 0 (auto) takes wgmma where wgmma_refusal finds nothing."""
    chosen = PATHS[config.get("path", 0)] if config.get("path", 0) in range(len(PATHS)) else "mma"
    if chosen == "auto":
        return "mma" if wgmma_refusal(spec, config) else "wgmma"
    return chosen


def wgmma_refusal(spec, config: Config) -> str | None:
    """Why the Hopper path cannot build this spec and config (None: it can). A spec renders once per
    target arch (kgen/bodies.py), so `spec.targets` is the one arch being rendered: it must be sm_90
    (wgmma is an sm_90a instruction)."""
    a = spec.attention
    for target in spec.targets:
        if target != "sm_90":
            return ("no wgmma before sm_90" if int(target.removeprefix("sm_")) < 90 else
                    f"{target} has no wgmma (an sm_90a instruction)")
    if spec.dtype.q not in ("fp16", "bf16"):
        return f"wgmma takes fp16 or bf16 operands (q is {spec.dtype.q})"
    if kv_path(spec) != "copy" or CacheFormat.of(spec).vllm:
        return f"it copies a cache in q's type, unscaled (this one is {describe(spec)})"
    dims = (a.head_dim, spec.v_head_dim_value)
    if any(d % 64 or d > 256 for d in dims):
        return f"head dims must be multiples of 64 up to 256 (got {head_dims_text(spec)})"
    if config.get("warps", 0) not in (0, *WGMMA_WARPS):
        return f"warps {config['warps']}: the consumers are 4 or 8 warps (one or two warpgroups)"
    warps, kv_tile = wgmma_tiles(spec, config)
    return wgmma_fit_problem(spec, warps, kv_tile, stages_of(spec, {**config, "path": 2}))


def wgmma_fit_problem(spec, warps: int, kv_tile: int, stages: int) -> str | None:
    """Why a Hopper-path launch of these tiles cannot run: shared memory past the opt-in limit, or a
    consumer thread needing more registers than it can have (estimated, wgmma_registers): 255 with one
    consumer warpgroup (256 threads); with two (384 threads, 168 each at launch), 168, or 232 where
    setmaxnreg moves the producer's registers to the consumers (wgmma_setmaxnreg)."""
    need = wgmma_smem_bytes(spec, warps, kv_tile, stages) + WGMMA_BARRIER_BYTES
    if need > smem_limit(spec.targets):
        return (f"warps {warps}, kv_tile {kv_tile} and stages {stages} need {need} bytes of shared memory, "
                f"more than {smem_limit(spec.targets)}")
    regs, cap = wgmma_registers(spec, kv_tile), 255 if warps == 4 else SETMAXNREG_CONSUMER
    if regs > cap:
        return (f"kv_tile {kv_tile} with {warps // 4} consumer warpgroup(s) needs about {regs} registers a "
                f"consumer thread, more than {cap}")
    return None


SETMAXNREG_CONSUMER = 232  # 128 x 40 (producer) + 256 x 232 = 384 x 168: the registers at launch
LAUNCH_REGISTERS_384 = limits_for("sm_90").regs_per_block // 384 // 8 * 8  # 168: __launch_bounds__(384)'s per thread


def wgmma_setmaxnreg(spec, warps: int, kv_tile: int) -> bool:
    """Whether the consumers take the producer's registers (setmaxnreg): two consumer warpgroups
    whose estimate passes the 168 registers a thread of 384 gets at launch. Only then: the split's
    counts assume the kernel is allocated exactly 168, which ptxas does when the code needs more."""
    return warps == 8 and wgmma_registers(spec, kv_tile) > LAUNCH_REGISTERS_384


def wgmma_registers(spec, kv_tile: int) -> int:
    """A consumer thread's registers, estimated: S (kv_tile/2), P (kv_tile/4), O (v_head_dim/2), 40 more."""
    return kv_tile // 2 + kv_tile // 4 + spec.v_head_dim_value // 2 + 40


def wgmma_tiles(spec, config: Config) -> tuple[int, int]:
    """(consumer warps, kv_tile) of a Hopper-path config; 0 means automatic: two consumer
    warpgroups and 128-key tiles, the key tile halved down to 64, then one warpgroup, then smaller
    tiles, until shared memory and the register estimate fit (wgmma_fit_problem)."""
    auto_w, auto_t = not config.get("warps", 0), not config.get("kv_tile", 0)
    warps = config.get("warps", 0) or 8
    kv_tile = config.get("kv_tile", 0) or 128
    stages = config.get("stages", 0) or AUTO_STAGES
    while wgmma_fit_problem(spec, warps, kv_tile, stages):
        if auto_t and kv_tile > 64:
            kv_tile //= 2
        elif auto_w and warps > 4:
            warps //= 2
        elif auto_t and kv_tile > 16:
            kv_tile //= 2
        else:
            break
    return warps, kv_tile


def wgmma_smem_bytes(spec, warps: int, kv_tile: int, stages: int) -> int:
    """Dynamic shared memory of the Hopper path (WgmmaPrefillShape): 1024 bytes of alignment slack,
    Q [16 * warps rows x head_dim], then `stages` K [kv_tile x head_dim] and V [kv_tile x v_head_dim]
    tiles, all in q's type, unpadded (the 128-byte swizzle spreads the rows over the banks)."""
    item = dtype(spec.dtype.q).itemsize
    return 1024 + 16 * warps * spec.attention.head_dim * item + \
        stages * kv_tile * (spec.attention.head_dim + spec.v_head_dim_value) * item


def m_tiles_of(spec, config: Config) -> int:
    """m16 row tiles per warp: the config's `m_tiles`, or for 0 (automatic) 2 where the products are
    mma.sync (16-bit q), head dims <= 128, a lane's accumulators of both m tiles (v_head_dim + kv_tile)
    within M2_ACCUMULATORS and the tiles under SMEM_TARGET with 32 keys or more (fewer, and
    rescaling the output each tile costs more than the shared fragments save): each K/V fragment then feeds two MMAs (fewer
    ldmatrix and instructions per MMA); else 1. The Hopper path's warpgroups own 64 rows: 1."""
    if path_of(spec, config) == "wgmma":
        return 1
    if config.get("m_tiles", 0):
        return config["m_tiles"]
    mma = dtype(spec.dtype.q).itemsize == 2
    if not mma or max(spec.attention.head_dim, spec.v_head_dim_value) > 128:
        return 1
    two = {**config, "m_tiles": 2}
    warps, kv_tile = tiles(spec, two)
    # a lane's accumulators of both m tiles: v_head_dim floats of O, kv_tile of S (more spill on sm_90)
    fits = spec.v_head_dim_value + kv_tile <= M2_ACCUMULATORS
    return 2 if fits and kv_tile >= 32 and smem_bytes(spec, warps, kv_tile, stages_of(spec, two), 2) <= SMEM_TARGET else 1


def block_rows(spec, config: Config) -> int:
    """Packed query rows per block: 16 per m tile of every warp."""
    return 16 * tiles(spec, config)[0] * m_tiles_of(spec, config)


def fitted_to_short_rows(spec, config: Config, max_q_len: int) -> Config:
    """`config` with the smallest row tile that holds a request of `max_q_len` query tokens (its
    packed rows: max_q_len x the GQA group): speculative decoding's verification requests, a few
    tokens each, would fill a fraction of a tile sized for prompt chunks (4 warps x 2 m tiles = 128
    rows). One m tile a warp, the mma.sync body (the Hopper body's tile is 64 rows or more)."""
    rows = max(1, int(max_q_len)) * spec.group_size
    warps = next((w for w in WARPS if 16 * w >= rows), WARPS[-1])
    return {**config, "warps": warps, "m_tiles": 1, "path": 1}


def tiles(spec, config: Config) -> tuple[int, int]:
    """(warps, kv_tile) of a config; 0 means automatic: 4 warps and 64-key tiles (32 past head_dim
    128, or with 2 m tiles a warp: their scores' registers), halved while the shared memory exceeds
    SMEM_TARGET: the one with more rows in shared memory first (the Q tile's 16 * warps * m_tiles,
    or the stages' 2 * stages * kv_tile), warps on a tie. The Hopper path's (consumer warps) come
    from wgmma_tiles."""
    if path_of(spec, config) == "wgmma":
        return wgmma_tiles(spec, config)
    auto_w, auto_t = not config.get("warps", 0), not config.get("kv_tile", 0)
    mt = m_tiles_of(spec, config)
    warps = config.get("warps", 0) or 4
    wide = max(spec.attention.head_dim, spec.v_head_dim_value) > 128 or mt > 1
    kv_tile = config.get("kv_tile", 0) or (32 if wide else 64)
    stages = stages_of(spec, config)
    while smem_bytes(spec, warps, kv_tile, stages, mt) > SMEM_TARGET:
        can_w, can_t = auto_w and warps > 1, auto_t and kv_tile > 16
        if can_w and (not can_t or 16 * warps * mt >= 2 * stages * kv_tile):
            warps //= 2
        elif can_t:
            kv_tile //= 2
        else:
            break
    return warps, kv_tile


def stages_of(spec, config: Config) -> int:
    """The pipeline depth of a config: its `stages`, or for 0 (automatic) AUTO_STAGES, one stage
    when even the smallest automatic tiles need more shared memory than the targets' opt-in limit
    (kgen.plan.arch.smem_limit) with it (wide heads of a staged cache: head_dim 512 of an fp32 cache)."""
    if config.get("stages", 0):
        return config["stages"]
    if config.get("path", 0) == 2 or path_of(spec, config) == "wgmma":
        return AUTO_STAGES
    fits = smem_bytes(spec, *tiles(spec, {**config, "stages": AUTO_STAGES}), AUTO_STAGES,
                      m_tiles_of(spec, config)) <= smem_limit(spec.targets)
    return AUTO_STAGES if fits else 1


def kv_path(spec) -> str:
    """How K/V tiles reach the MMA operand tiles in shared memory: "copy", cp.async straight into
    them (a cache in q's type, unscaled, 16-byte vectors); "stage", cp.async of the stored bytes
    into a staging tile, then one pass dequantizes it with the packed conversions (quantized or
    wider caches); "gather", plain loads that dequantize on the way (a VEC-element chunk of a key's
    row that is not contiguous in memory, as in vLLM's head_dim-major V, or a copy of 1 or 2 bytes)."""
    kv = spec.kv_cache
    vec = vector_width(spec)
    copy = dtype(kv.dtype).bytes_for(vec)  # bytes per vector load (nvfp4: two elements a byte)
    k_run, v_run = (vllm_x(spec), 1) if CacheFormat.of(spec).vllm else (spec.attention.head_dim, spec.v_head_dim_value)
    if k_run % vec or v_run % vec or copy not in (4, 8, 16):
        return "gather"
    if kv.dtype == spec.dtype.q and kv.scale == "none" and copy == 16:
        return "copy"
    return "stage"


def smem_bytes(spec, warps: int, kv_tile: int, stages: int = 2, m_tiles: int = 1) -> int:
    """The Q tile, then K/V (templates/common/paged_prefill.cuh, PrefillShape): operand tiles in q's
    type with rows padded by 16 bytes, `stages` of them on the copy path; on the stage path one
    operand pair plus `stages` staging tiles as stored (and per-token scales, or nvfp4's block
    scales: a byte per 16 elements of each K and V row); on the gather path one operand pair (and
    per-token scales). The Q tile has 16 * warps * m_tiles rows. Plus fp32 P per warp where the products are fp32 FMAs (fp32 q, or a target older
    than sm_80: no mma.sync m16n8k16)."""
    item = dtype(spec.dtype.q).itemsize
    D, DV = spec.attention.head_dim, spec.v_head_dim_value  # K's rows and V's
    ld, ldv = (-(-dim // 16) * 16 + 16 // item for dim in (D, DV))
    tiles = kv_tile * (ld + ldv) * item  # one K and one V operand tile
    path = kv_path(spec)
    fmt = CacheFormat.of(spec)
    scales = 8 * kv_tile if fmt.per_token else 0  # a tile's K and V scales, fp32
    if fmt.block_scaled:  # a tile's K and V block-scale rows, one e4m3 byte per BLOCK_GROUP elements
        scales = _align16(2 * kv_tile * dtype(scale_dtype(spec)).bytes_for(spec.attention.head_dim // BLOCK_GROUP))
    if path == "copy":
        kv = stages * tiles
    elif path == "stage":
        raws = sum(_align16(fmt.dtype.bytes_for(kv_tile * dim)) for dim in (D, DV))
        kv = tiles + stages * (raws + scales)
    else:
        kv = tiles + scales
    rows = 16 * warps * m_tiles
    return rows * ld * item + kv + (rows * kv_tile * 4 if fma_scratch(spec) else 0)


def fma_scratch(spec) -> bool:
    """Whether the body computes the products as fp32 FMAs through a P tile in shared memory (fp32
    q, or a target older than sm_80). Rendered per arch (kgen/bodies.py), `spec.targets` is that
    arch; the hand-written ABI launch, one for every target, reserves the tile if any target needs it."""
    return dtype(spec.dtype.q).itemsize == 4 or any(int(arch.removeprefix("sm_")) < 80 for arch in spec.targets)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def slices(spec) -> int:
    """Output slices on grid z: v_head_dim in OUT_SLICE columns each."""
    return -(-spec.v_head_dim_value // OUT_SLICE)


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
        elif config["path"] == 2 and not problems:
            refusal = wgmma_refusal(spec, config)
            if refusal:
                problems.append(f"path 2 (wgmma) cannot build for {', '.join(spec.targets)}: {refusal} "
                                "(accepted there: path 0, auto, or 1, mma.sync)")
            return problems
        if not problems and path_of(spec, config) == "wgmma":
            return problems
        if not problems:
            need = smem_bytes(spec, *tiles(spec, config), stages_of(spec, config), m_tiles_of(spec, config))
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
        warps, kv_tile = tiles(spec, config)
        table = self.arguments(spec, config)
        if path_of(spec, config) == "wgmma":  # a producer warpgroup besides the consumer warps
            split = wgmma_setmaxnreg(spec, warps, kv_tile)  # its counts assume 168 registers at launch
            main = KernelDecl(spec.name, tuple(table), ("q_tiles", a.num_kv_heads, "z"), 32 * warps + 128,
                              smem=wgmma_smem_bytes(spec, warps, kv_tile, stages_of(spec, config)),
                              launch_registers=LAUNCH_REGISTERS_384 if split else 0)
        else:
            main = KernelDecl(spec.name, tuple(table), ("q_tiles", a.num_kv_heads, "z"), 32 * warps,
                              smem=smem_bytes(spec, warps, kv_tile, stages_of(spec, config), m_tiles_of(spec, config)),
                              max_registers=MAX_REGISTERS)
        return [main, merge_kernel(spec, table, PREFILL_ROWS)] if P else [main]

    def template_context(self, spec, config: Config) -> dict[str, Any]:
        warps, kv_tile = tiles(spec, config)
        kernels = self.kernels(spec, config)
        return {
            **template_context(spec, config, kernels),
            "warps": warps,
            "kv_tile": kv_tile,
            "stages": stages_of(spec, config),
            "m_tiles": m_tiles_of(spec, config),
            "kv_path": KV_PATHS.index(kv_path(spec)),
            "smem_bytes": kernels[0].smem,
            "fma_scratch": fma_scratch(spec),
            "wgmma": path_of(spec, config) == "wgmma",
            "setmaxnreg": path_of(spec, config) == "wgmma" and wgmma_setmaxnreg(spec, warps, kv_tile),
        }

    def body_choice(self, spec, config: Config) -> tuple[str, str]:
        """(body, why) of the arch being rendered (`spec.targets`, one arch: kgen/bodies.py): "wgmma"
        (the Hopper body), "mma.sync", or "fma" (fp32 products: fp32 q, or no mma.sync m16n8k16)."""
        if path_of(spec, config) == "wgmma":
            warps, kv_tile = wgmma_tiles(spec, config)
            split = ", setmaxnreg 40/232" if wgmma_setmaxnreg(spec, warps, kv_tile) else ""
            return "wgmma", (f"Hopper body: {head_dims_text(spec)}, {spec.dtype.q} q, cache {describe(spec)}, "
                             f"block_size {spec.kv_cache.block_size} fit the TMA-free wgmma tiling: "
                             f"{warps // 4} consumer warpgroup(s) + a producer, {kv_tile}-key tiles, "
                             f"{stages_of(spec, config)} stages{split}; compiled for sm_90a")
        body = "fma" if fma_scratch(spec) else "mma.sync"
        if config.get("path", 0) == 1:
            return body, "path 1 (mma) in the config"
        return body, f"not the Hopper body: {wgmma_refusal(spec, config)}"

    def abi_notes(self, spec) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        rows = block_rows(spec, resolve_config(self, spec, self.abi_config(spec)))  # the ABI launch's
        visible = ("keys p-" + str(a.sliding_window - 1) + " .. p" if a.sliding_window else "keys 0 .. p") \
            if a.causal else "all seq_len keys (causal: false)"
        return [
            f"num_q_heads {a.num_q_heads}, num_kv_heads {a.num_kv_heads} (query head h reads KV head h / "
            f"{spec.group_size}), {head_dims_text(spec)}, block_size {kv.block_size}, cache {describe(spec)}, "
            + ("scales: e4m3 per 16 elements and a tensor scale" if CacheFormat.of(spec).block_scaled
               else f"scale {kv.scale}"),
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
        seq_lens, q_indptr = lengths["seq_lens"], lengths.get("q_indptr")
        extra = sorted(set(lengths) - {"seq_lens", "q_indptr"})
        if extra:
            raise ArgumentError(f"{extra[0]}: not a length of a {spec.kind} call (plan it with seq_lens and q_indptr)")
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
        row_tiles = -(-q_lens * spec.group_size // block_rows(spec, config))
        window = spec.attention.sliding_window or 0
        live = np.where(q_lens > 0, lens, 0)
        wins = q_lens + window - 1 if window else 0
        split = choose_split(live, spec.attention.num_kv_heads, target_blocks, granule, wins, partition_tokens,
                             row_tiles)
        if partition_tokens is None and split.merged:
            split = whole_waves(split, live, spec.attention.num_kv_heads, target_blocks, granule, wins, row_tiles)
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
        B = spec.kv_cache.block_size
        b = AttentionBinder(spec, call)
        q, T = b.query(PREFILL_ROWS)
        pool = b.pool(v_by_token=False)
        bt, sl = b.table(None)
        S, M = bt.shape
        ind = b.take("q_indptr", True)
        b.check(ind, (S + 1,), "int32", contiguous=True)
        (ks, vs), scale_strides = b.scales(pool)
        alibi = b.alibi()
        sinks = b.sinks()
        out = b.out(q, T)
        lse = b.lse(q, T)
        if checked:  # before planning: the plan trusts q_indptr and seq_lens
            b.check_lengths(sl, bt, pool.num_blocks, q_lens=checked_q_lens(host_values(ind), T), min_len=0)
        if plan is None:  # host lengths are planned for; device ones by shapes (full tables, rows spread evenly)
            if sl.device == "cpu" and ind.device == "cpu":
                lens, indptr = host_values(sl), host_values(ind)
            else:
                per_seq = -(-T // max(S, 1))
                lens, indptr = np.full(S, max(M * B, per_seq)), np.minimum(np.arange(S + 1) * per_seq, T)
            sizes, kernels = self.schedule(spec, config, {"seq_lens": lens, "q_indptr": indptr},
                                           target_blocks or DEFAULT_TARGET_BLOCKS)
            rows_planned = T
        else:
            sizes, kernels = b.planned(self, config, plan, S)
            rows_planned = plan.sizes["num_q_tokens"]
            if T > rows_planned:
                raise ArgumentError(f"plan: made for at most {rows_planned} query rows, the call has {T} "
                                    "(make the plan for the largest batch)")
        max_parts = sizes["max_partitions"]
        part_o, part_ml = b.split_scratch(config, plan, q, max_parts, rows_planned if T else 0)
        b.refuse_unknown()
        written = [out, lse, part_o, part_ml]
        b.refuse_aliasing(written, [q, *pool.caches, ind, bt, sl, ks, vs, alibi, sinks, *written])
        values = b.values(PREFILL_ROWS, q, out, pool, bt, sl, (ks, vs), scale_strides, alibi, part_o, part_ml, lse,
                          sizes, M, q_indptr=b.pointer(ind), num_seqs=S, sinks=sinks)
        rows = block_rows(spec, config)  # grid x from the call's shapes (a plan may be for other chunks)
        grid = {"q_tiles": -(-T * spec.group_size // rows) + S, "num_q_tokens": T, "z": max_parts * slices(spec)}
        reached = [c.native for c in pool.caches]  # fused: K/V by address (an isolated child maps them too)
        launches = [k.launch(grid, values, reached) for k in kernels] if T else []  # no query row: nothing to launch
        return launches, ((out.obj, lse.obj) if lse is not None else out.obj)

    # ---- verification and benchmarks (kgen/families/attention/prefill_cases.py) -------------------
    def bucket_of(self, spec, call):
        """batch = sequences (block-table rows), context = the block table's capacity in tokens."""
        bt = call.get("block_tables")
        if bt is None or len(bt.shape) != 2:
            return None
        return int(bt.shape[0]), int(bt.shape[1]) * spec.kv_cache.block_size


def whole_waves(split: Split, lens: np.ndarray, num_kv_heads: int, target: int, granule: int, window,
                weights) -> Split:
    """Prefill's split in whole waves of `target` blocks: a block's time is about its keys, so a
    launch takes about (waves of blocks) x (keys per partition). choose_split reaches the target
    with the largest partition, which can leave a few blocks for a second wave (a 256-token chunk
    over 32K keys: 8 row tiles x 8 KV heads x 5 partitions = 320 blocks on 264 slots); of 1 to 2 x
    its partitions, the count with the least waves x partition (then the fewest) is taken."""
    longest = int(lens.max())
    best = None
    for parts in range(1, 2 * split.max_partitions + 1):
        size = max(granule, -(-longest // (parts * STEP_TOKENS)) * STEP_TOKENS)
        blocks = num_kv_heads * working_partitions(lens, size, window, weights)
        cost = -(-blocks // max(1, target)) * min(size, longest)
        if best is None or cost < best[0]:
            best = (cost, size)
    size = best[1]
    return Split(0, 1) if size >= longest else Split(size, -(-longest // size))


PAGED_PREFILL = PagedPrefillFamily()
