"""A static performance model of tensor-core prefill kernels on one GPU (no GPU needed; ESTIMATES).

Decode streams bytes (kgen/perf/model.py); prefill multiplies tiles. This module reuses model.py's
SASS parsing (`parse_sass`, `loops`, `smem_wavefronts`, `mma_flop`, `loop_mlp`), its Device presets
and kgen.plan.occupancy, and adds what a tensor-core kernel needs:

- `main_loop` / `tile_work`: the CTA's main loop (the loop whose body holds the most tensor-core FLOP)
  and one warp's work in one iteration of it, counted in the SASS: HMMA/HGMMA count, shape and FLOP,
  shared-memory wavefronts (LDSM, LDS, STS, LDGSTS), FP32 (FFMA/FMUL/FADD/FMNMX) and MUFU (MUFU.EX2)
  instructions, total warp-instructions, global bytes per thread.
- `cta_seconds`: one CTA's time for `tiles` iterations of that loop while `k` CTAs share its SM: the
  slowest of the tensor, issue, MUFU, FP32, smem and latency terms (`PrefillPipes` states the rates).
- `launch_estimate`: every CTA of a launch, in launch order, placed on the first free of SMs x k slots
  (list scheduling: a long causal CTA does not hold a whole wave back); the launch takes the latest
  finish, at least its DRAM bytes over the copy bandwidth; the binding term is the one charged the
  most CTA-time. Where ptxas serialised the kernel's wgmma (advisory C7520, TileWork.wgmma_serialized),
  no wgmma batch overlaps anything: the tensor term adds to the slowest other term instead of hiding
  under it.
- `kgen_ctas`: the tile iterations of each CTA of kgen's paged-prefill launch (FlashInfer's, restated
  from its source, are benchmarks/flashinfer_geometry.py's, outside the wheel).
- `causal_flop`: the FLOP the tables divide by (4 x head_dim x visible (query, key) pairs x q heads).
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field

from kgen.compile.advisories import WGMMA_SERIALIZED
from kgen.perf import model as pm


# ---- rates the decode model does not carry ------------------------------------------------------
@dataclass(frozen=True)
class PrefillPipes:
    """Per-SM rates of the pipes a prefill tile uses, beyond pm.Device's issue/smem/tensor figures.
    MUFU: 16 results per SM per clock for ex2 (a warp's MUFU.EX2 takes 2 clocks of an SM) and FP32:
    128 (sm_90) or 64 (sm_80) lanes per SM per clock: the CUDA C++ Programming Guide's arithmetic
    instruction throughput table (compute capability 8.0 and 9.0 columns). `mma_sync_fraction`:
    the share of the dense tensor peak (pm.Device.tensor_flop_per_sm_clock) an HMMA (mma.sync)
    stream reaches; 1.0 by default (the optimistic ceiling), see docs/performance.md.
    `tile_latency_s`: one round trip of a K/V tile request in the cp.async pipeline: an ASSUMPTION
    between an L2 hit (most prefill K/V reads: many CTAs read the same K/V rows) and the loaded DRAM
    trip pm.Device.latency_s."""

    mufu_per_sm_clock: int = 16
    fp32_per_sm_clock: int = 128
    mma_sync_fraction: float = 1.0
    tile_latency_s: float = 0.4e-6
    hgmma_fraction: float = 1.0   # share of the dense peak wgmma (HGMMA) reaches


PIPES = {"sm_90": PrefillPipes(), "sm_80": PrefillPipes(fp32_per_sm_clock=64)}

# H100/H200 SXM dense fp16/bf16 tensor peak, the datasheet figure the fractions are of.
DENSE_PEAK = {"sm_90": 989.4e12, "sm_80": 312e12}
# The clock that peak is quoted at: 989.4e12 / (132 SMs x 4096 FLOP/SM/clk) = 1.83 GHz on sm_90.
TENSOR_CLOCK = {"sm_90": 1.83e9, "sm_80": 1.41e9}

# The prefill benchmark shapes (benchmarks/static_prefill.py estimates them, benchmarks/gpu_prefill.py and
# `kgen selftest` measure them): (label, [(q_len, kv_len) per sequence]); kv_len counts the chunk's own tokens.
MIXED = [(256, 4096)] * 8 + [(1, 4096)] * 56
SHAPES = [
    ("prompt 512", [(512, 512)]),
    ("prompt 4K", [(4096, 4096)]),
    ("prompt 16K", [(16384, 16384)]),
    ("prompt 64K", [(64 * 1024, 64 * 1024)]),  # tokens (65,536 is also a register count: kgen/plan/arch.py)
    ("chunk 256 @ 32K", [(256, 32768 + 256)]),
    ("mixed 8x256 + 56x1 @ 4K", MIXED),
]


def mixed_shape() -> tuple[str, list[tuple[int, int]]]:
    """The tables' mixed batch: (label, sequences)."""
    return next((label, seqs) for label, seqs in SHAPES if seqs is MIXED)


def mixed_parts(seqs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """A mixed batch's parts as they would run alone: its prefill chunks as one launch, its decode rows
    (q_len 1) as another."""
    parts = [[s for s in seqs if s[0] > 1], [s for s in seqs if s[0] == 1]]
    return [p for p in parts if p]


# ---- SASS ---------------------------------------------------------------------------------------
FP32_OPS = ("FFMA", "FMUL", "FADD", "FMNMX")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")


def hgmma_flop(ins: pm.Instr) -> int:
    """FLOP one warp's HGMMA (wgmma) instruction stands for: a warpgroup's m x n x k product
    (2 x m x n x k) is issued by each of its 4 warps, so a quarter per warp instruction."""
    m = _HGMMA.match(ins.opcode)
    return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 4 if m else 0


def tensor_flop(ins: pm.Instr) -> int:
    return pm.mma_flop(ins) or hgmma_flop(ins)


def _mma_shape(ins: pm.Instr) -> str | None:
    if ins.base in ("HMMA", "IMMA", "HGMMA"):
        return ins.opcode.split(".")[0] + "." + ins.opcode.split(".")[1] if "." in ins.opcode else ins.opcode
    return None


def main_loop(fn: pm.SassFunction) -> pm.Loop | None:
    """Of the loops holding MMAs that no shorter MMA-holding loop lies in or overlaps (backward branches
    of a persistent kernel's control flow need not nest), the one with the most tensor-core FLOP, the
    shorter on a tie: the tile loop around unrolled fragment loops, and in a persistent,
    warp-specialized kernel (FlashInfer's sm90 path) the steady-state iteration rather than the
    regions around its peeled and masked iterations. None when no loop holds an MMA."""
    found = [(lp, sum(tensor_flop(i) for i in fn.instrs[lp.start:lp.end + 1])) for lp in pm.loops(fn)]
    found = [(lp, f) for lp, f in found if f]

    def span(lp: pm.Loop) -> int:
        return lp.end - lp.start

    inner = [(lp, f) for lp, f in found if not any(o != lp and o.overlaps(lp) and span(o) < span(lp) for o, _ in found)]
    if not inner:
        return None
    return max(inner, key=lambda x: (x[1], -(x[0].end - x[0].start)))[0]


@dataclass
class TileWork:
    """One warp's work in one iteration of the main loop, counted in the SASS (every instruction of
    the body once, nested loops included once, predicated-off instructions still issued)."""

    loop: pm.Loop | None
    instrs: int = 0
    mma: dict = field(default_factory=dict)   # {"HMMA.16816": count, ...}
    mma_flop: int = 0          # tensor-core FLOP per warp per iteration
    wavefronts: int = 0        # shared-memory wavefronts (LDSM, LDS, STS, LDGSTS, STSM)
    ldsm: int = 0              # of which LDSM wavefronts
    fp32: int = 0              # FFMA/FMUL/FADD/FMNMX warp-instructions
    mufu: int = 0              # MUFU.EX2 warp-instructions
    mufu_other: int = 0        # other MUFU (RCP, ...)
    global_bytes: int = 0      # global bytes per thread (LDG/LDGSTS)
    branches: int = 0          # BRA inside the body (both sides of each are counted as issued)
    fixed_instrs: int = 0      # warp-instructions outside the main loop (once per warp)
    latencies_per_iter: float = 0.0   # model.loop_mlp: round trips per iteration the loop waits for
    disjoint_mma_loops: int = 0       # other loops with MMAs outside the main loop (counted once)
    producer_instrs: int = 0  # warp-instructions per iteration of a producer that shares the SM's issue slots
    wgmma_serialized: bool = False  # ptxas advisory C7520: each wgmma waits for the one before (serialized_wgmma)


def serialized_wgmma(advisories) -> bool:
    """Whether ptxas's advisories for a kernel (Advisory objects or their dicts) say it serialised its
    wgmma (C7520): the model then charges every wgmma batch on its own (cta_seconds)."""
    return any((a["code"] if isinstance(a, dict) else a.code) == WGMMA_SERIALIZED for a in advisories)


def tile_work(fn: pm.SassFunction, dev: pm.Device = pm.H200) -> TileWork:
    lp = main_loop(fn)
    if lp is None:
        return TileWork(None, fixed_instrs=len(fn.instrs))
    body = fn.instrs[lp.start:lp.end + 1]
    w = TileWork(lp, instrs=len(body), fixed_instrs=len(fn.instrs) - len(body))
    for ins in body:
        shape = _mma_shape(ins)
        if shape:
            w.mma[shape] = w.mma.get(shape, 0) + 1
        w.mma_flop += tensor_flop(ins)
        wf = pm.smem_wavefronts(ins)
        w.wavefronts += wf
        w.ldsm += wf if ins.base == "LDSM" else 0
        w.fp32 += ins.base in FP32_OPS
        if ins.base == "MUFU":
            if "EX2" in ins.mods:
                w.mufu += 1
            else:
                w.mufu_other += 1
        w.global_bytes += pm.global_load_bytes(ins)
        w.branches += ins.base == "BRA"
    if w.global_bytes:
        w.latencies_per_iter = pm.loop_mlp(fn, lp, dev).latencies_per_iter
    w.disjoint_mma_loops = sum(1 for o in pm.loops(fn) if not o.overlaps(lp)
                               and any(tensor_flop(i) for i in fn.instrs[o.start:o.end + 1]))
    return w


def producer_instrs(fn: pm.SassFunction, main: pm.Loop, copies_per_thread: int, producer_warps: int = 4) -> int:
    """Warp-instructions a warp-specialized kernel's producer issues per K/V tile (all its warps), when it
    gathers the tile by cp.async (LDGSTS) in loops of its own outside the consumers' main loop: the
    innermost such loop runs copies_per_thread / (its LDGSTS) times a tile, the loop around it (the
    producer's tile loop: barrier waits, the wait_group, the arrive) once."""
    found = [lp for lp in pm.loops(fn) if not lp.overlaps(main)
             and any(i.base == "LDGSTS" for i in fn.instrs[lp.start:lp.end + 1])]
    if not found:
        return 0
    inner = min(found, key=lambda lp: lp.end - lp.start)
    outer = [lp for lp in found if lp != inner and lp.contains(inner)]
    body = inner.end - inner.start + 1
    copies = sum(1 for i in fn.instrs[inner.start:inner.end + 1] if i.base == "LDGSTS")
    around = (min(outer, key=lambda lp: lp.end - lp.start).end - min(outer, key=lambda lp: lp.end - lp.start).start
              + 1 - body) if outer else 0
    return producer_warps * (body * -(-copies_per_thread // copies) + around)


# ---- one CTA, one launch --------------------------------------------------------------------------
PREFILL_TERMS = ("tensor", "issue", "mufu", "fp32", "smem", "latency")


def cta_terms(work: TileWork, tiles: float, warps: int, k: int, dev: pm.Device, pipes: PrefillPipes,
              unroll: float = 1.0) -> dict[str, float]:
    """Seconds each pipe needs for one CTA of `warps` warps running `tiles` main-loop iterations while
    `k` CTAs share its SM equally (each gets 1/k of every per-SM rate; issue: min(4, warps x k) warps
    issue per clock). `unroll`: main-loop iterations of the SASS per tile (1 unless the compiler
    unrolled the tile loop)."""
    it = tiles / unroll
    clk = dev.clock_hz
    hgmma = any(s.startswith("HGMMA") for s in work.mma)
    eff = pipes.hgmma_fraction if hgmma else pipes.mma_sync_fraction
    tensor_rate = dev.tensor_flop_per_sm_clock * eff * clk / k
    issue_rate = min(dev.issue_per_sm_clock, warps * k) * clk / k
    return {
        "tensor": it * warps * work.mma_flop / tensor_rate,
        "issue": (it * (warps * work.instrs + work.producer_instrs) + warps * work.fixed_instrs) / issue_rate,
        "mufu": it * warps * (work.mufu + work.mufu_other) * 32 / (pipes.mufu_per_sm_clock * clk / k),
        "fp32": it * warps * work.fp32 * 32 / (pipes.fp32_per_sm_clock * clk / k),
        "smem": it * warps * work.wavefronts / (dev.smem_wavefronts_per_sm_clock * clk / k),
        "latency": it * work.latencies_per_iter * pipes.tile_latency_s,
    }


def cta_seconds(terms: dict[str, float], serialized: bool = False) -> tuple[float, str]:
    """One CTA's time from its terms and the term that binds: the slowest pipe, the others overlapping
    it; with serialised wgmma (ptxas C7520) the tensor pipe overlaps nothing, so its time adds to the
    slowest of the others."""
    if serialized and terms.get("tensor", 0.0) > 0.0:
        rest = {k: v for k, v in terms.items() if k != "tensor"}
        other = max(rest, key=rest.get)
        return terms["tensor"] + rest[other], "tensor" if terms["tensor"] >= rest[other] else other
    bound = max(terms, key=terms.get)
    return terms[bound], bound


@dataclass
class PrefillEstimate:
    seconds: float
    flop: float
    tflops: float
    fraction: float          # of the dense peak
    bound: str
    ctas: int
    resident: int            # CTAs the GPU holds at once (SMs x k)
    busy: dict = field(default_factory=dict)    # CTA-seconds charged to each term


def launch_estimate(ctas: list[float], work: TileWork, warps: int, k: int, flop: float, dram_bytes: float,
                    dev: pm.Device, pipes: PrefillPipes, peak: float, extra_launches: int = 0,
                    extra_bytes: float = 0.0, unroll: float = 1.0) -> PrefillEstimate:
    """`ctas`: main-loop tile iterations of each CTA, in launch order. Each CTA takes its slowest term
    (plus two tile latencies: its first tile's request and its store) on the first free of SMs x k
    slots; the launch ends with the last CTA, and takes at least `dram_bytes` over the copy bandwidth.
    Each extra launch (a split-KV merge) adds two latencies plus `extra_bytes` at the copy bandwidth."""
    k = max(1, k)
    slots = [0.0] * (dev.sms * k)
    heapq.heapify(slots)
    busy = dict.fromkeys(PREFILL_TERMS, 0.0)
    end = 0.0
    cache: dict[float, tuple[float, str]] = {}
    for tiles in ctas:
        if tiles not in cache:
            t, bound = cta_seconds(cta_terms(work, tiles, warps, k, dev, pipes, unroll), work.wgmma_serialized)
            cache[tiles] = (t + 2 * pipes.tile_latency_s, bound)
        t, bound = cache[tiles]
        busy[bound] += t
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + t)
        end = max(end, start + t)
    floor = dram_bytes / dev.copy_bw
    if floor > end:
        busy["bandwidth"] = floor - end
        end = floor
    end += extra_launches * 2 * dev.latency_s + extra_bytes / dev.copy_bw
    seconds = max(end, 1e-12)
    tflops = flop / seconds
    return PrefillEstimate(seconds, flop, tflops, tflops / peak, max(busy, key=busy.get), len(ctas),
                           dev.sms * k, busy)


# ---- FLOP ------------------------------------------------------------------------------------------
def visible_pairs(q_len: int, kv_len: int, causal: bool = True, window: int = 0) -> int:
    """(query, key) pairs a chunk of q_len tokens at the end of kv_len keys sees: row j (position
    p = kv_len - q_len + j) sees keys 0..p (causal), p-window+1..p (window), or all kv_len."""
    if not causal:
        return q_len * kv_len
    pos0 = kv_len - q_len
    if not window:
        return q_len * pos0 + q_len * (q_len + 1) // 2
    return sum(min(pos0 + j + 1, window) for j in range(q_len))


def causal_flop(seqs: list[tuple[int, int]], head_dim: int, num_q_heads: int, window: int = 0) -> float:
    """4 x head_dim x visible pairs x query heads: S = Q K^T and O = P V, 2 FLOP per multiply-add each."""
    return float(4 * head_dim * num_q_heads * sum(visible_pairs(q, kv, True, window) for q, kv in seqs))


# ---- CTAs of kgen's launch (templates/common/paged_prefill.cuh, kgen/families/attention/prefill.py) --
def kgen_ctas(seqs: list[tuple[int, int]], group: int, num_kv_heads: int, rows_per: int, kv_tile: int,
              partitions: int = 1, partition_tokens: int = 0, window: int = 0, causal: bool = True) -> list[int]:
    """Tile iterations of every block of kgen's paged-prefill launch, in launch order (x fastest:
    blockIdx.x counts each sequence's tiles of `rows_per` packed (token, group head) rows, the
    geometry's PrefillGeometry.rows and kv_tile (kgen/families/attention/prefill_geometry.py), the last
    (heaviest) tile first, plus one spare block per sequence that exits; y: KV head; z: partition).
    A block walks keys [lo, hi): lo = max(0, p_first - window + 1) with a window, hi = p_last + 1
    (causal) or kv_len; with partitions, clipped to [z x P, (z + 1) x P) (the last: to the end),
    and a partition past ceil(kv_len / P) exits. Iterations: ceil((hi - lo) / kv_tile)."""
    xs: list[list[int]] = [[] for _ in range(max(1, partitions))]
    for z in range(max(1, partitions)):
        for q_len, kv_len in seqs:
            n = -(-q_len * group // rows_per)
            pos0 = kv_len - q_len
            for i in range(n):
                tile = n - 1 - i
                r0 = tile * rows_per
                rows = min(rows_per, q_len * group - r0)
                lo = max(0, pos0 + r0 // group - window + 1) if window else 0
                hi = pos0 + (r0 + rows - 1) // group + 1 if causal else kv_len
                if partitions > 1:
                    if z >= min(-(-kv_len // partition_tokens), partitions):
                        xs[z].append(0)
                        continue
                    lo = max(lo, z * partition_tokens)
                    if z < partitions - 1:
                        hi = min(hi, (z + 1) * partition_tokens)
                xs[z].append(max(0, -(-(hi - lo) // kv_tile)))
        xs[z] += [0] * len(seqs)  # the spare blocks of grid x
    return [t for z in range(max(1, partitions)) for _ in range(num_kv_heads) for t in xs[z]]


def finite(e: PrefillEstimate) -> bool:
    return all(math.isfinite(x) for x in (e.seconds, e.tflops, e.fraction))
