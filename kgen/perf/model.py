"""A static performance model of memory-bound decode kernels on one GPU (no GPU needed).

It reads SASS text (`cuobjdump -sass`), ptxas figures and launch
geometry, and returns ESTIMATES. Used by benchmarks/static_perf.py and benchmarks/gpu_decode.py
(`from kgen.perf import model as pm`); docs/performance.md states
the assumptions. The pieces:

- `parse_sass`: the instructions of each function with their scheduling controls (the
  scoreboard a variable-latency instruction sets, the scoreboards an instruction waits on),
  decoded from the second 64-bit word cuobjdump prints for every sm_70+ instruction.
- `streaming_loops` / `loop_mlp`: the loops that stream global memory, and how many bytes
  each thread keeps in flight in them (a scoreboard walk of the loop body, repeated until
  the pipeline is in steady state).
- `occupancy`: resident blocks per SM from threads, registers and shared memory (kgen.plan.occupancy,
  the rules kgen's call-time planner uses too).
- `loop_work` / `kernel_work`: what the SMs do per streamed byte, counted in the SASS: warp-instructions
  issued, shared-memory wavefronts, tensor-core FLOP (the loop body per iteration, the rest per warp).
- `estimate_seconds`: per wave of thread blocks, the slowest of five terms: bytes in flight by Little's
  law ("latency"), instruction issue ("issue"), shared-memory wavefronts ("smem"), tensor-core FLOP
  ("tensor"), copy bandwidth ("bandwidth"); the Estimate names the term that binds.

FlashInfer's and vLLM's launch geometry, restated from their sources, and the table helpers live with
the benchmark scripts that compare against them (benchmarks/flashinfer_geometry.py,
benchmarks/vllm_geometry.py, benchmarks/tables.py), outside the wheel.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field

from kgen.plan.arch import ArchLimits, limits_for
from kgen.plan.occupancy import Occupancy
from kgen.plan.occupancy import occupancy as kgen_occupancy


@dataclass(frozen=True)
class Device:
    """sm_90 limits (the arch table, kgen/plan/arch.py) and the H200 memory figures the model uses."""

    name: str = "H200 SXM (sm_90)"
    sms: int = limits_for("sm_90").sm_count
    limits: ArchLimits = limits_for("sm_90")
    copy_bw: float = 4.3e12            # measured device-to-device copy on this workplace's H200s (read + write)
    peak_bw: float = 4.8e12            # datasheet HBM3e bandwidth
    latency_s: float = 0.8e-6          # DRAM round trip under load
    hit_weight: float = 0.25           # a stall on a small (< 8 B/thread) load: an L1/L2 hit, 1/4 of a DRAM trip
    clock_hz: float = 1.98e9           # H200 SXM maximum boost clock (the SM clock decode runs at, unthrottled)
    issue_per_sm_clock: int = 4        # warp-instructions per SM per clock: one per sub-partition, own warps only
    smem_wavefronts_per_sm_clock: int = 1   # shared memory / L1 data path: one 128-byte wavefront per clock
    # Dense fp16 tensor throughput, FLOP per SM per clock: 989.4 TFLOP/s (H100/H200 SXM datasheet) over
    # 132 SMs at the 1.83 GHz the datasheet's tensor figure is quoted at = 4096: one HMMA.16816 (4096 FLOP)
    # per SM per clock, i.e. one per sub-partition every 4 clocks. mma.sync reaching that rate is assumed
    # (optimistic: Hopper reaches its tensor peak through wgmma, Luo et al., arXiv 2501.12084).
    tensor_flop_per_sm_clock: float = 4096.0


H200 = Device()
# A100 SXM 80GB (sm_80) from its datasheet: 108 SMs, 1.41 GHz maximum boost clock, HBM2e at 2.0 TB/s (2,039 GB/s),
# 312 TFLOP/s dense fp16 on the tensor cores = 2048 FLOP per SM per clock (one HMMA.16816 per SM every 2 clocks).
# ASSUMPTIONS, not measurements: the copy bandwidth is the datasheet peak times the H200's measured copy / peak
# ratio (4.3 / 4.8), i.e. 1.8 TB/s; the DRAM latency under load is taken as the H200's 0.8 us.
A100 = Device(name="A100 SXM 80GB (sm_80)", sms=limits_for("sm_80").sm_count, limits=limits_for("sm_80"),
              copy_bw=2.0e12 * 4.3 / 4.8, peak_bw=2.0e12, latency_s=0.8e-6, clock_hz=1.41e9,
              tensor_flop_per_sm_clock=2048.0)
DEVICES = {"sm_80": A100, "sm_90": H200}  # the presets `kgen perf --arch` offers

# The shapes both decode benchmarks use (static_perf.py estimates them, gpu_decode.py measures them).
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
SHAPES = [(b, c) for b in BATCHES for c in CONTEXTS]

# ---- SASS ----------------------------------------------------------------------------------------
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/")
_CTRL = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")
_DEPBAR = re.compile(r"SB0\s*,\s*(0x[0-9a-f]+|\d+)")
NO_BARRIER = 7


@dataclass
class Instr:
    addr: int
    pred: str
    opcode: str        # with modifiers, e.g. LDG.E.128.CONSTANT
    operands: str
    wbar: int = NO_BARRIER   # scoreboard this instruction sets when its result is written (7: none)
    wait: int = 0            # mask of scoreboards it waits on before issuing

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def mods(self) -> list[str]:
        return self.opcode.split(".")[1:]


@dataclass
class SassFunction:
    name: str
    instrs: list[Instr] = field(default_factory=list)


def _decode_ctrl(ins: Instr, hi: int) -> None:
    """Volta+ control bits (instruction bits 105..125, i.e. bits 41.. of the high word)."""
    ctrl = hi >> 41
    ins.wbar = (ctrl >> 5) & 7
    ins.wait = (ctrl >> 11) & 0x3F


def parse_sass(text: str) -> dict[str, SassFunction]:
    """{function name: its instructions} from `cuobjdump -sass` output."""
    funcs: dict[str, SassFunction] = {}
    cur: SassFunction | None = None
    pending: Instr | None = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), SassFunction(m.group(1)))
            pending = None
            continue
        if cur is None:
            continue
        m = _INSTR.search(line)
        if m:
            body = m.group(2).strip()
            pred = ""
            if body.startswith("@"):
                pred, _, body = body.partition(" ")
            opcode, _, operands = body.strip().partition(" ")
            pending = Instr(int(m.group(1), 16), pred, opcode, operands.strip())
            cur.instrs.append(pending)
            continue
        m = _CTRL.match(line)
        if m and pending is not None:
            _decode_ctrl(pending, int(m.group(1), 16))
            pending = None
    return funcs


def _width(ins: Instr) -> int:
    mods = set(ins.mods)
    for tag, size in (("256", 32), ("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if tag in mods:
            return size
    return 4


def global_load_bytes(ins: Instr) -> int:
    """Bytes one thread reads from global memory with this instruction (0: not a global read).
    Generic LD counts: the compiler emits it when it cannot prove the address global."""
    return _width(ins) if ins.base in ("LDG", "LD", "LDGSTS") else 0


def bulk_copies(fn: SassFunction) -> int:
    """Bulk/tensor copies (TMA): the in-flight model below does not cover them."""
    return sum(ins.base in ("UBLKCP", "UTMALDG") for ins in fn.instrs)


def local_memory_instructions(fn: SassFunction) -> tuple[int, int]:
    """(LDL, STL) counts: local-memory loads and stores anywhere in the function."""
    return sum(i.base == "LDL" for i in fn.instrs), sum(i.base == "STL" for i in fn.instrs)


@dataclass(frozen=True)
class Loop:
    start: int  # index of the first instruction of the body (the backward branch's target)
    end: int    # index of the backward branch

    def contains(self, other: Loop) -> bool:
        return self.start <= other.start and other.end <= self.end

    def overlaps(self, other: Loop) -> bool:
        return not (self.end < other.start or other.end < self.start)


def loops(fn: SassFunction) -> list[Loop]:
    """Every backward branch is a loop: [its target, the branch]."""
    index = {ins.addr: i for i, ins in enumerate(fn.instrs)}
    found = set()
    for i, ins in enumerate(fn.instrs):
        if ins.base != "BRA":
            continue
        m = _TARGET.search(ins.operands)
        if m and int(m.group(1), 16) <= ins.addr and int(m.group(1), 16) in index:
            found.add(Loop(index[int(m.group(1), 16)], i))
    return sorted(found, key=lambda lp: (lp.start, lp.end))


def loop_load_bytes(fn: SassFunction, loop: Loop) -> int:
    return sum(global_load_bytes(ins) for ins in fn.instrs[loop.start:loop.end + 1])


def streaming_loops(fn: SassFunction, share: float = 0.25) -> list[tuple[Loop, int]]:
    """The loops that stream global memory, with their load bytes per thread per iteration:
    the loop reading the most (innermost on ties), then every loop disjoint from those picked
    that reads at least `share` of that (vLLM's K loop and V loop, say)."""
    scored = [(lp, loop_load_bytes(fn, lp)) for lp in loops(fn)]
    scored = [s for s in scored if s[1] > 0]
    scored.sort(key=lambda s: (-s[1], s[0].end - s[0].start))
    picked: list[tuple[Loop, int]] = []
    for lp, nbytes in scored:
        if picked and nbytes < share * picked[0][1]:
            break
        if all(not lp.overlaps(p) for p, _ in picked):
            picked.append((lp, nbytes))
    return picked


@dataclass
class LoopMLP:
    """Memory-level parallelism of one loop, per thread (an ESTIMATE from the SASS)."""

    bytes_per_iter: int
    latencies_per_iter: float   # modeled time of one iteration, in DRAM latencies
    stalls_per_iter: float      # instructions per iteration that wait on global reads
    in_flight: float            # Little's law: bytes per iteration / iteration time x latency


def loop_mlp(fn: SassFunction, loop: Loop, dev: Device = H200, passes: int = 48, measured: int = 24,
             body: list[Instr] | None = None) -> LoopMLP:
    """Walk the loop body `passes` times in order (branches inside it taken as falling through) on a
    clock that only stalls advance, compute taking no time. A global read is issued at the current
    time; an instruction that waits on a scoreboard holding global reads, or a `DEPBAR.LE SB0, N` that
    retires cp.async groups (LDGSTS ... LDGDEPBAR), moves the clock to the latest issue time among
    what it waits for plus one DRAM latency (`hit_weight` of one when it waits for < 8 bytes per
    thread: a block-table or scale read, mostly a cache hit). The last `measured` passes are the
    steady state: bytes in flight per thread = bytes per pass x latency / time per pass. `body`: one
    steady iteration as `steady_loops` unrolls it (default: the loop's instructions once)."""
    body = body if body is not None else fn.instrs[loop.start:loop.end + 1]
    board = [[0, 0.0] for _ in range(6)]  # per scoreboard: global bytes outstanding, latest issue time
    groups: deque[tuple[int, float]] = deque()
    open_group = [0, 0.0]
    clock, stalls, marks = 0.0, 0, []

    def wait(nbytes: int, issued: float) -> None:
        nonlocal clock, stalls
        clock = max(clock, issued + (1.0 if nbytes >= 8 else dev.hit_weight))
        stalls += 1

    for _ in range(passes):
        marks.append((clock, stalls))
        for ins in body:
            waited = [k for k in range(6) if ins.wait >> k & 1 and board[k][0]]
            if waited:
                wait(sum(board[k][0] for k in waited), max(board[k][1] for k in waited))
                for k in waited:
                    board[k] = [0, 0.0]
            m = _DEPBAR.search(ins.operands) if ins.base == "DEPBAR" else None
            if m and len(groups) > int(m.group(1), 0):
                retired = [groups.popleft() for _ in range(len(groups) - int(m.group(1), 0))]
                if sum(b for b, _ in retired):
                    wait(sum(b for b, _ in retired), max(t for _, t in retired))
            nbytes = global_load_bytes(ins)
            if ins.base == "LDGSTS":
                open_group = [open_group[0] + nbytes, clock]
            elif ins.base == "LDGDEPBAR":
                groups.append((open_group[0], open_group[1]))
                open_group = [0, 0.0]
            elif nbytes and ins.wbar != NO_BARRIER:
                board[ins.wbar] = [board[ins.wbar][0] + nbytes, clock]
    marks.append((clock, stalls))
    per_iter = sum(map(global_load_bytes, body))
    span = (marks[-1][0] - marks[-1 - measured][0]) / measured
    waits = (marks[-1][1] - marks[-1 - measured][1]) / measured
    if span <= 0:  # nothing inside the loop waits for its reads: count one iteration's reads in flight
        return LoopMLP(per_iter, 0.0, waits, float(per_iter))
    return LoopMLP(per_iter, span, waits, per_iter / span)


@dataclass(frozen=True)
class TileHint:
    """What the SASS cannot say about a kernel's nested loops, from its geometry: the stream bytes each
    thread reads per tile (a nested copy loop runs until it has read them) and how often a nested loop
    that reads nothing runs per tile (the CUDA-core decode body's batch loop)."""

    tile_bytes: float = 0.0
    inner_trips: int = 1


def _waits_for_reads(body: list[Instr]) -> bool:
    """Does `body` wait for the stream it reads: a DEPBAR (cp.async groups) or a scoreboard wait on a plain
    global read of 8 bytes or more (also one carried over from the previous iteration)? A wait on a
    block-table entry or a scale (`stream_bytes` 0) does not count."""
    boards = 0
    for ins in body + body:
        if ins.base == "DEPBAR" or ins.wait & boards:
            return True
        if stream_bytes(ins) and ins.wbar != NO_BARRIER:
            boards |= 1 << ins.wbar
    return False


def _nested(fn: SassFunction, unit: Loop) -> list[Loop]:
    """The outermost loops strictly inside `unit`."""
    inner = [lp for lp in loops(fn) if lp != unit and unit.contains(lp)]
    return [lp for lp in inner if not any(o != lp and o.contains(lp) for o in inner)]


def steady_body(fn: SassFunction, loop: Loop, hint: TileHint | None = None) -> tuple[Loop, list[Instr]]:
    """One steady-state iteration of a streaming loop, as the instructions it issues. A loop that
    issues reads but never waits for them (a tile's copy loop, `#pragma unroll 2` say) is a part of
    the loop around it, which is the unit then. Loops nested in the unit repeat per iteration: a copy
    loop until it has read the hint's tile bytes, a loop without reads `inner_trips` times (without a
    hint: once each)."""
    unit = loop
    if not _waits_for_reads(fn.instrs[loop.start:loop.end + 1]):
        outer = [lp for lp in loops(fn) if lp != loop and lp.contains(loop)]
        if outer:
            unit = min(outer, key=lambda lp: lp.end - lp.start)
    body: list[Instr] = []
    at = unit.start
    for lp in sorted(_nested(fn, unit), key=lambda lp: lp.start) if hint else []:
        body += fn.instrs[at:lp.start]
        seg = fn.instrs[lp.start:lp.end + 1]
        nbytes = sum(map(global_load_bytes, seg))
        if nbytes:
            other = loop_load_bytes(fn, unit) - nbytes
            trips = max(1, round((hint.tile_bytes - other) / nbytes)) if hint.tile_bytes else 1
        else:
            trips = max(1, hint.inner_trips)
        body += seg * trips
        at = lp.end + 1
    return unit, body + fn.instrs[at:unit.end + 1]


def steady_loops(fn: SassFunction, hint: TileHint | None = None) -> list[tuple[Loop, list[Instr]]]:
    """The streaming loops' steady iterations (`steady_body`), each unit once; a unit that never waits
    for its reads (a prologue issuing the first tiles) is left out when another one waits."""
    units: dict[Loop, list[Instr]] = {}
    for lp, _ in streaming_loops(fn):
        unit, body = steady_body(fn, lp, hint)
        units.setdefault(unit, body)
    waiting = {u: b for u, b in units.items() if _waits_for_reads(b)}
    return list((waiting or units).items())


def thread_in_flight(fn: SassFunction, dev: Device = H200, hint: TileHint | None = None) -> tuple[float, list[LoopMLP]]:
    """Bytes in flight per thread over the streaming loops of a kernel: with several (K loop, V loop)
    each moves its share of the bytes (by bytes per iteration) at its own rate (harmonic mean)."""
    mlps = [loop_mlp(fn, unit, dev, body=body) for unit, body in steady_loops(fn, hint)]
    if not mlps:
        return 0.0, []
    return sum(m.bytes_per_iter for m in mlps) / sum(m.bytes_per_iter / m.in_flight for m in mlps), mlps


# ---- work per byte: issue, shared memory, tensor cores ------------------------------------------
SMEM_OPS = ("LDS", "STS", "LDSM", "LDGSTS", "ATOMS", "STSM")
_MMA_SHAPE = re.compile(r"^(HMMA|IMMA)\.(\d+)")
MMA_FLOP = {"16816": 4096, "1688": 2048, "884": 512, "16832": 8192, "8816": 2048, "8832": 4096}


def stream_bytes(ins: Instr) -> int:
    """Global bytes of the stream one thread reads with this instruction: a global read, except a plain
    (not cp.async) read under 8 bytes: a block-table entry or a scale, served by the caches."""
    nbytes = global_load_bytes(ins)
    return nbytes if ins.base == "LDGSTS" or nbytes >= 8 else 0


def smem_wavefronts(ins: Instr) -> int:
    """Shared-memory wavefronts one warp's instruction takes (one 128-byte wavefront per clock per SM):
    32 threads x width / 128 B for LDS/STS/LDGSTS (128-bit: 4, 64-bit: 2, 32-bit or narrower: 1);
    LDSM/STSM (ldmatrix/stmatrix) .x4: 4, .x2: 2, .x1: 1. Bank conflicts are not modeled (conflict-free
    assumed)."""
    if ins.base not in SMEM_OPS:
        return 0
    if ins.base in ("LDSM", "STSM"):  # LDSM.16.M88.4 (.x4), LDSM.16.MT88.2 (.x2, transposed), LDSM.16.M88 (.x1)
        return int(ins.mods[-1]) if ins.mods and ins.mods[-1] in ("2", "4") else 1
    return max(1, 32 * _width(ins) // 128)


def mma_flop(ins: Instr) -> int:
    """FLOP of one warp's tensor-core MMA (HMMA.16816: m16n8k16, 2 x 16 x 8 x 16 = 4096); 0 otherwise."""
    m = _MMA_SHAPE.match(ins.opcode)
    return MMA_FLOP.get(m.group(2), 0) if m else 0


@dataclass
class LoopWork:
    """One warp's work in one iteration of a loop (counted from the SASS, every instruction of the body
    once: branches inside the body are taken as falling through, predicated-off instructions still issue)."""

    instrs: int              # warp-instructions issued
    stream_bytes: int        # stream bytes per thread (x 32 per warp)
    wavefronts: int          # shared-memory wavefronts
    mma_flop: int            # tensor-core FLOP


def loop_work(fn: SassFunction, loop: Loop, body: list[Instr] | None = None) -> LoopWork:
    body = body if body is not None else fn.instrs[loop.start:loop.end + 1]
    return LoopWork(len(body), sum(map(stream_bytes, body)), sum(map(smem_wavefronts, body)),
                    sum(map(mma_flop, body)))


@dataclass
class Work:
    """What a kernel's warps do per byte of the stream (warp-instructions, smem wavefronts, tensor FLOP
    per byte read), plus what each warp does once outside the streaming loops (the prologue, the
    epilogue, other loops counted once)."""

    instrs_per_byte: float = 0.0
    wavefronts_per_byte: float = 0.0
    flop_per_byte: float = 0.0
    fixed_instrs: int = 0          # per warp, per launch
    fixed_wavefronts: int = 0
    loop_instrs: int = 0           # warp-instructions per iteration, summed over the streaming loops
    loop_bytes: int = 0            # stream bytes per thread per iteration, summed likewise


def kernel_work(fn: SassFunction, hint: TileHint | None = None) -> Work:
    """Work per stream byte over the streaming loops (each loop moves its share of the bytes: per byte
    it is the loops' summed work over their summed bytes), plus the rest of the function once per warp."""
    works = [(unit, loop_work(fn, unit, body)) for unit, body in steady_loops(fn, hint)]
    nbytes = 32 * sum(w.stream_bytes for _, w in works)
    if not nbytes:
        return Work(fixed_instrs=len(fn.instrs), fixed_wavefronts=sum(map(smem_wavefronts, fn.instrs)))
    inside = {i for lp, _ in works for i in range(lp.start, lp.end + 1)}
    rest = [ins for i, ins in enumerate(fn.instrs) if i not in inside]
    return Work(sum(w.instrs for _, w in works) / nbytes, sum(w.wavefronts for _, w in works) / nbytes,
                sum(w.mma_flop for _, w in works) / nbytes, len(rest), sum(map(smem_wavefronts, rest)),
                sum(w.instrs for _, w in works), sum(w.stream_bytes for _, w in works))


def issue_bound_fraction(work: Work, dev: Device = H200) -> float:
    """The fraction of the copy bandwidth instruction issue allows with every SM issuing at full rate
    (the loop only): issue rate / (copy bandwidth x warp-instructions per byte)."""
    if work.instrs_per_byte <= 0:
        return math.inf
    return dev.sms * dev.issue_per_sm_clock * dev.clock_hz / (dev.copy_bw * work.instrs_per_byte)


# ---- occupancy ----------------------------------------------------------------------------------
def occupancy(threads: int, registers: int, smem_bytes: int, dev: Device = H200) -> Occupancy:
    """Resident blocks per SM (kgen.plan.occupancy: the CUDA occupancy calculator's rules) on `dev`.
    `smem_bytes`: static + dynamic shared memory of one block."""
    return kgen_occupancy(threads, registers, smem_bytes, dev.limits)


# ---- time ----------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One launch as the model sees it."""

    kernel: str
    blocks: int
    threads: int
    smem: int = 0         # dynamic shared memory per block, bytes


TERMS = ("latency", "issue", "smem", "tensor", "bandwidth")


@dataclass
class Estimate:
    seconds: float
    fraction: float       # of the copy bandwidth: (KV bytes / seconds) / copy_bw
    blocks: int           # thread blocks of the streaming launch
    resident: int         # blocks the GPU holds at once (SMs x blocks/SM)
    waves: int
    bound: str = "latency"   # the term that binds: most of the time is spent in waves it limits
    terms: dict = field(default_factory=dict)   # seconds of each term, summed over the waves


def wave_terms(nbytes: float, blocks: int, threads: int, in_flight: float, work: Work | None,
               dedupe: int = 1, dev: Device = H200) -> dict[str, float]:
    """Seconds each resource needs for one wave of `blocks` resident blocks streaming `nbytes` DRAM bytes:
    - latency: Little's law, nbytes / (blocks x threads x in_flight / dedupe / latency);
    - bandwidth: nbytes / copy bandwidth;
    - issue: the wave's warp-instructions (loop work per byte x bytes read, x dedupe when blocks read the
      same bytes; plus each warp's fixed instructions) over the busy SMs x min(issue_per_sm_clock, warps
      resident per SM) x clock: a sub-partition issues only from its own warps;
    - smem: shared-memory wavefronts over busy SMs x wavefronts per SM per clock x clock;
    - tensor: tensor-core FLOP over busy SMs x FLOP per SM per clock x clock."""
    t = {"latency": nbytes * dedupe * dev.latency_s / (blocks * threads * in_flight),
         "bandwidth": nbytes / dev.copy_bw}
    if work is not None:
        warps = blocks * -(-threads // 32)
        sms = min(dev.sms, blocks)  # the block scheduler spreads a wave over the SMs first
        per_sm = sms * dev.clock_hz
        read = nbytes * dedupe  # bytes the blocks read (L2 serves the repeats), each costing its instructions
        t["issue"] = ((read * work.instrs_per_byte + warps * work.fixed_instrs)
                      / (per_sm * min(dev.issue_per_sm_clock, -(-warps // sms))))
        t["smem"] = ((read * work.wavefronts_per_byte + warps * work.fixed_wavefronts)
                     / (per_sm * dev.smem_wavefronts_per_sm_clock))
        t["tensor"] = read * work.flop_per_byte / (per_sm * dev.tensor_flop_per_sm_clock)
    return t


def estimate_seconds(kv_bytes: float, blocks: int, threads: int, in_flight: float, blocks_per_sm: int,
                     extra_launches: int = 0, partial_bytes: float = 0.0, dedupe: int = 1,
                     dev: Device = H200, work: Work | None = None) -> Estimate:
    """Per wave of equal blocks, the slowest of the terms of `wave_terms` (without `work`: bytes in flight
    and copy bandwidth only), plus two dependent round trips (seq_lens and block table before the first
    KV read, the store at the end), charged to "latency". Each extra launch (a split-KV merge) costs two
    round trips plus its partial results (written and read back) at the copy bandwidth. `dedupe`: blocks
    that read the same KV (vLLM's one block per query head) keep that many times the requests in flight
    per DRAM byte (L2 serves the rest). The Estimate's `bound` is the term with the most time charged."""
    resident = max(1, blocks_per_sm * dev.sms)
    full, rest = divmod(blocks, resident)
    per_block = kv_bytes / blocks
    charged = dict.fromkeys(TERMS, 0.0)
    summed = dict.fromkeys(TERMS, 0.0)

    def wave(b: int, count: int) -> float:
        terms = wave_terms(b * per_block, b, threads, in_flight, work, dedupe, dev)
        bound = max(terms, key=terms.get)
        charged[bound] += count * terms[bound]
        charged["latency"] += count * 2 * dev.latency_s
        for k, v in terms.items():
            summed[k] += count * v
        return count * (terms[bound] + 2 * dev.latency_s)

    t = (wave(resident, full) if full else 0.0) + (wave(rest, 1) if rest else 0.0)
    t += extra_launches * 2 * dev.latency_s + partial_bytes / dev.copy_bw
    charged["latency"] += extra_launches * 2 * dev.latency_s
    charged["bandwidth"] += partial_bytes / dev.copy_bw
    return Estimate(t, kv_bytes / t / dev.copy_bw, blocks, resident, full + (1 if rest else 0),
                    max(charged, key=charged.get), summed)
