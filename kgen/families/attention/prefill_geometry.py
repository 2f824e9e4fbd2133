"""The geometry of kgen's paged-prefill kernels (templates/common/paged_prefill.cuh, the mma.sync
body, and paged_prefill_wgmma.cuh, the Hopper body; docs/prefill-family.md): which body a config
builds, its row and key tiles, pipeline depth, shared memory and threads, resolved once per
(spec, config, arch) into a frozen PrefillGeometry that every reader (the template context, the
kernel declarations, the checks, the call's grid, the benchmarks) takes as is.

The rules run in one fixed order, each reading only what the steps before it settled:

0. the copy path (kv_path): a property of the spec (its cache's type, scale and layout); every
   shared-memory size below depends on it, so it comes first.
1. the path: the Hopper (wgmma) candidate is always tiled (its consumer warps, key tile and depth
   are its own: `_hopper`), giving the refusal (None: it builds); `path` 0 takes it where it builds.
2. m_tiles (mma.sync): the config's, else 2 where the two-m-tile candidate's stages and tiles fit
   (the rules of steps 3 and 4 evaluated with m_tiles 2, not a recursive call).
3. stages: the config's, else AUTO_STAGES where the tiles step 4 gives at that depth fit the
   targets' opt-in shared memory, else 1. (The depth is settled before the final tiles because the
   automatic tiles shrink under the depth's shared memory.)
4. tiles (warps, kv_tile): the config's, automatic ones shrunk under SMEM_TARGET.
5. shared memory, threads and registers of the launch.

`spec.targets` is the arch being rendered (kgen/bodies.py renders each arch's body with the spec
narrowed to it); a multi-target spec (the hand-written ABI launch) gets the limits common to all."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

from kgen.families.attention.decode_geometry import vector_width
from kgen.families.base import Config
from kgen.formats.cache import (
    BLOCK_GROUP,
    CacheFormat,
    describe,
    head_dims_text,
    scale_dtype,
    vllm_x,
)
from kgen.formats.dtypes import dtype
from kgen.plan.arch import limits_for, smem_limit

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
PRODUCER_THREADS = 128  # the Hopper path's producer warpgroup
SETMAXNREG_CONSUMER = 232  # 128 x 40 (producer) + 256 x 232 = 384 x 168: the registers at launch
LAUNCH_REGISTERS_384 = limits_for("sm_90").regs_per_block // 384 // 8 * 8  # 168: __launch_bounds__(384)'s per thread
_PARAMS = ("warps", "kv_tile", "stages", "m_tiles", "path")  # the config parameters the geometry reads
MEMO_SIZE = 4096  # resolved geometries kept (a tuner's space is a few hundred configs per arch)


@dataclass(frozen=True)
class PrefillGeometry:
    """How one config of a paged-prefill spec cuts its work, for one arch (`spec.targets`)."""

    path: str              # "wgmma" (the Hopper body) or "mma" (paged_prefill.cuh: mma.sync, or fp32 FMAs)
    refusal: str | None    # why the Hopper body cannot build this config (None: it can), whatever `path` asks
    m_tiles: int           # m16 row tiles per warp (1 on the Hopper path: a warpgroup owns 64 rows)
    stages: int            # K/V tiles in flight (cp.async pipeline)
    warps: int             # warps of 16 query rows per m tile (the Hopper path: consumer warps)
    kv_tile: int           # keys per shared-memory tile
    kv_path: str           # KV_PATHS: how K/V tiles reach the operand tiles
    fma_scratch: bool      # fp32 products through a P tile in shared memory
    smem_bytes: int        # dynamic shared memory of the main kernel
    threads: int           # of the main kernel's block (the Hopper path: consumers + a producer warpgroup)
    max_registers: int     # __maxnreg__ of the main kernel (0: __launch_bounds__)
    setmaxnreg: bool       # the Hopper consumers take the producer's registers
    launch_registers: int  # registers a thread must get at launch (0: any): the setmaxnreg split's

    @property
    def wgmma(self) -> bool:
        return self.path == "wgmma"

    @property
    def rows(self) -> int:
        """Packed (token, group head) query rows per block: 16 per m tile of every (consumer) warp."""
        return 16 * self.warps * self.m_tiles


class _Request(NamedTuple):
    """The config's geometry parameters (0: automatic; an absent one is automatic)."""

    warps: int
    kv_tile: int
    stages: int
    m_tiles: int
    path: int


# Two memos: by the spec's hash (equal specs share one geometry: each render narrows the spec to
# the arch into a new object), and in front of it by the spec object itself (a frozen model), as
# hashing a spec costs more than resolving: a call's grid reads the geometry on every call.
_BY_HASH: dict[tuple, PrefillGeometry] = {}
_BY_SPEC: dict[int, tuple[weakref.ref, dict[tuple, PrefillGeometry]]] = {}


def prefill_geometry(spec, config: Config) -> PrefillGeometry:
    """The geometry of `config` for `spec` on the arch(s) of `spec.targets`, resolved once per
    (spec, config's geometry parameters, targets)."""
    key = (tuple(spec.targets), _Request(*(int(config.get(name, 0)) for name in _PARAMS)))
    entry = _BY_SPEC.get(id(spec))
    if entry is None or entry[0]() is not spec:
        entry = _BY_SPEC[id(spec)] = (weakref.ref(spec, _forget(id(spec))), {})
    geometry = entry[1].get(key)
    if geometry is None:
        shared = (spec.spec_hash(), *key)
        geometry = _BY_HASH.get(shared)
        if geometry is None:
            if len(_BY_HASH) >= MEMO_SIZE:
                _BY_HASH.pop(next(iter(_BY_HASH)))  # the oldest
            geometry = _BY_HASH[shared] = _resolve(spec, key[1])
        entry[1][key] = geometry
    return geometry


def _forget(spec_id: int):
    """The callback that drops a collected spec's memo (its id may be reused)."""
    def forget(ref: weakref.ref) -> None:
        if _BY_SPEC.get(spec_id, (None,))[0] is ref:
            del _BY_SPEC[spec_id]
    return forget


def _resolve(spec, req: _Request) -> PrefillGeometry:
    copy = kv_path(spec)  # 0: the spec's
    scratch = fma_scratch(spec)
    h_warps, h_kv_tile, h_stages, refusal = _hopper(spec, req, copy)  # 1: the path
    chosen = PATHS[req.path] if req.path in range(len(PATHS)) else "mma"
    if chosen == "wgmma" or (chosen == "auto" and refusal is None):
        split = wgmma_setmaxnreg(spec, h_warps, h_kv_tile)
        return PrefillGeometry("wgmma", refusal, 1, h_stages, h_warps, h_kv_tile, copy, scratch,
                               wgmma_smem_bytes(spec, h_warps, h_kv_tile, h_stages),
                               32 * h_warps + PRODUCER_THREADS, 0, split, LAUNCH_REGISTERS_384 if split else 0)
    m_tiles = _m_tiles(spec, req)  # 2
    stages = _stages(spec, req, m_tiles)  # 3
    warps, kv_tile = _tiles(spec, req, m_tiles, stages)  # 4
    return PrefillGeometry("mma", refusal, m_tiles, stages, warps, kv_tile, copy, scratch,  # 5
                           smem_bytes(spec, warps, kv_tile, stages, m_tiles), 32 * warps, MAX_REGISTERS, False, 0)


# ---- 1. the Hopper candidate ----------------------------------------------------------------------
def _hopper(spec, req: _Request, copy: str) -> tuple[int, int, int, str | None]:
    """(consumer warps, kv_tile, stages, refusal) of the Hopper body for this request. Its tiles
    (0: automatic) start at two consumer warpgroups and 128-key tiles, the key tile halved down to
    64, then one warpgroup, then smaller tiles, until shared memory and the register estimate fit
    (_hopper_fit); its depth is the config's or AUTO_STAGES. The refusal: the first rule the spec
    or config breaks. `spec.targets` must be sm_90 alone (wgmma is an sm_90a instruction)."""
    stages = req.stages or AUTO_STAGES
    warps, kv_tile = req.warps or 8, req.kv_tile or 128
    while _hopper_fit(spec, warps, kv_tile, stages):
        if not req.kv_tile and kv_tile > 64:
            kv_tile //= 2
        elif not req.warps and warps > 4:
            warps //= 2
        elif not req.kv_tile and kv_tile > 16:
            kv_tile //= 2
        else:
            break
    return warps, kv_tile, stages, _hopper_refusal(spec, req, copy, warps, kv_tile, stages)


def _hopper_refusal(spec, req: _Request, copy: str, warps: int, kv_tile: int, stages: int) -> str | None:
    for target in spec.targets:
        if target != "sm_90":
            return ("no wgmma before sm_90" if int(target.removeprefix("sm_")) < 90 else
                    f"{target} has no wgmma (an sm_90a instruction)")
    if spec.dtype.q not in ("fp16", "bf16"):
        return f"wgmma takes fp16 or bf16 operands (q is {spec.dtype.q})"
    if copy != "copy" or CacheFormat.of(spec).vllm:
        return f"it copies a cache in q's type, unscaled (this one is {describe(spec)})"
    if any(d % 64 or d > 256 for d in (spec.attention.head_dim, spec.v_head_dim_value)):
        return f"head dims must be multiples of 64 up to 256 (got {head_dims_text(spec)})"
    if req.warps not in (0, *WGMMA_WARPS):
        return f"warps {req.warps}: the consumers are 4 or 8 warps (one or two warpgroups)"
    return _hopper_fit(spec, warps, kv_tile, stages)


def _hopper_fit(spec, warps: int, kv_tile: int, stages: int) -> str | None:
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


# ---- 2-4. the mma.sync body -------------------------------------------------------------------------
def _m_tiles(spec, req: _Request) -> int:
    """The config's `m_tiles`, or for 0 (automatic) 2 where the products are mma.sync (16-bit q),
    head dims <= 128, and the two-m-tile candidate (its stages and tiles by the rules of steps 3
    and 4) has a lane's accumulators of both m tiles (v_head_dim floats of O, kv_tile of S) within
    M2_ACCUMULATORS (more spill on sm_90), 32 keys or more (fewer, and rescaling the output each tile
    costs more than the shared fragments save) and its tiles under SMEM_TARGET: each K/V fragment
    then feeds two MMAs (fewer ldmatrix and instructions per MMA); else 1."""
    if req.m_tiles:
        return req.m_tiles
    if dtype(spec.dtype.q).itemsize != 2 or max(spec.attention.head_dim, spec.v_head_dim_value) > 128:
        return 1
    stages = _stages(spec, req, 2)
    warps, kv_tile = _tiles(spec, req, 2, stages)
    fits = spec.v_head_dim_value + kv_tile <= M2_ACCUMULATORS
    return 2 if fits and kv_tile >= 32 and smem_bytes(spec, warps, kv_tile, stages, 2) <= SMEM_TARGET else 1


def _stages(spec, req: _Request, m_tiles: int) -> int:
    """The config's `stages`, or for 0 (automatic) AUTO_STAGES, one stage when even the smallest
    automatic tiles need more shared memory than the targets' opt-in limit (kgen.plan.arch.smem_limit)
    with it (wide heads of a staged cache: head_dim 512 of an fp32 cache)."""
    if req.stages:
        return req.stages
    fits = smem_bytes(spec, *_tiles(spec, req, m_tiles, AUTO_STAGES), AUTO_STAGES, m_tiles) <= smem_limit(spec.targets)
    return AUTO_STAGES if fits else 1


def _tiles(spec, req: _Request, m_tiles: int, stages: int) -> tuple[int, int]:
    """(warps, kv_tile): the config's, or automatic: 4 warps and 64-key tiles (32 past head_dim 128,
    or with 2 m tiles a warp: their scores' registers), halved while the shared memory exceeds
    SMEM_TARGET: the one with more rows in shared memory first (the Q tile's 16 * warps * m_tiles,
    or the stages' 2 * stages * kv_tile), warps on a tie."""
    warps = req.warps or 4
    wide = max(spec.attention.head_dim, spec.v_head_dim_value) > 128 or m_tiles > 1
    kv_tile = req.kv_tile or (32 if wide else 64)
    while smem_bytes(spec, warps, kv_tile, stages, m_tiles) > SMEM_TARGET:
        can_w, can_t = not req.warps and warps > 1, not req.kv_tile and kv_tile > 16
        if can_w and (not can_t or 16 * warps * m_tiles >= 2 * stages * kv_tile):
            warps //= 2
        elif can_t:
            kv_tile //= 2
        else:
            break
    return warps, kv_tile


# ---- sizes (functions of explicit tiles: the rules above and the tests read them) --------------------
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
    """The mma.sync body's dynamic shared memory: the Q tile, then K/V (templates/common/paged_prefill.cuh,
    PrefillShape): operand tiles in q's type with rows padded by 16 bytes, `stages` of them on the
    copy path; on the stage path one operand pair plus `stages` staging tiles as stored (and
    per-token scales, or nvfp4's block scales: a byte per 16 elements of each K and V row); on the
    gather path one operand pair (and per-token scales). The Q tile has 16 * warps * m_tiles rows.
    Plus fp32 P per warp where the products are fp32 FMAs (fma_scratch)."""
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


def wgmma_smem_bytes(spec, warps: int, kv_tile: int, stages: int) -> int:
    """Dynamic shared memory of the Hopper path (WgmmaPrefillShape): 1024 bytes of alignment slack,
    Q [16 * warps rows x head_dim], then `stages` K [kv_tile x head_dim] and V [kv_tile x v_head_dim]
    tiles, all in q's type, unpadded (the 128-byte swizzle spreads the rows over the banks)."""
    item = dtype(spec.dtype.q).itemsize
    return 1024 + 16 * warps * spec.attention.head_dim * item + \
        stages * kv_tile * (spec.attention.head_dim + spec.v_head_dim_value) * item


def wgmma_registers(spec, kv_tile: int) -> int:
    """A consumer thread's registers, estimated: S (kv_tile/2), P (kv_tile/4), O (v_head_dim/2), 40 more."""
    return kv_tile // 2 + kv_tile // 4 + spec.v_head_dim_value // 2 + 40


def wgmma_setmaxnreg(spec, warps: int, kv_tile: int) -> bool:
    """Whether the consumers take the producer's registers (setmaxnreg): two consumer warpgroups
    whose estimate passes the 168 registers a thread of 384 gets at launch. Only then: the split's
    counts assume the kernel is allocated exactly 168, which ptxas does when the code needs more."""
    return warps == 8 and wgmma_registers(spec, kv_tile) > LAUNCH_REGISTERS_384


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
