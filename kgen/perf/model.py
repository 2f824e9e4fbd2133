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
- `estimate_seconds`: Little's law per wave of thread blocks, capped by the copy bandwidth.
- `flashinfer_geometry` / `flashinfer_split`, `vllm_*`: the launch geometry those libraries
  choose, re-stated from their source (the file each rule comes from is named).
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


H200 = Device()

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


def loop_mlp(fn: SassFunction, loop: Loop, dev: Device = H200, passes: int = 48, measured: int = 24) -> LoopMLP:
    """Walk the loop body `passes` times in order (branches inside it taken as falling through) on a
    clock that only stalls advance, compute taking no time. A global read is issued at the current
    time; an instruction that waits on a scoreboard holding global reads, or a `DEPBAR.LE SB0, N` that
    retires cp.async groups (LDGSTS ... LDGDEPBAR), moves the clock to the latest issue time among
    what it waits for plus one DRAM latency (`hit_weight` of one when it waits for < 8 bytes per
    thread: a block-table or scale read, mostly a cache hit). The last `measured` passes are the
    steady state: bytes in flight per thread = bytes per pass x latency / time per pass."""
    body = fn.instrs[loop.start:loop.end + 1]
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
    per_iter = loop_load_bytes(fn, loop)
    span = (marks[-1][0] - marks[-1 - measured][0]) / measured
    waits = (marks[-1][1] - marks[-1 - measured][1]) / measured
    if span <= 0:  # nothing inside the loop waits for its reads: count one iteration's reads in flight
        return LoopMLP(per_iter, 0.0, waits, float(per_iter))
    return LoopMLP(per_iter, span, waits, per_iter / span)


def thread_in_flight(fn: SassFunction, dev: Device = H200) -> tuple[float, list[LoopMLP]]:
    """Bytes in flight per thread over the streaming loops of a kernel: with several (K loop, V loop)
    each moves its share of the bytes (by bytes per iteration) at its own rate (harmonic mean)."""
    picked = streaming_loops(fn)
    mlps = [loop_mlp(fn, lp, dev) for lp, _ in picked]
    if not mlps:
        return 0.0, []
    return sum(m.bytes_per_iter for m in mlps) / sum(m.bytes_per_iter / m.in_flight for m in mlps), mlps


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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


@dataclass
class Estimate:
    seconds: float
    fraction: float       # of the copy bandwidth: (KV bytes / seconds) / copy_bw
    blocks: int           # thread blocks of the streaming launch
    resident: int         # blocks the GPU holds at once (SMs x blocks/SM)
    waves: int


def estimate_seconds(kv_bytes: float, blocks: int, threads: int, in_flight: float, blocks_per_sm: int,
                     extra_launches: int = 0, partial_bytes: float = 0.0, dedupe: int = 1,
                     dev: Device = H200) -> Estimate:
    """Little's law per wave of equal blocks: a wave of b blocks keeps b x threads x in_flight bytes
    in flight, so it moves bytes at min(copy_bw, in_flight_total / latency); each wave also pays two
    dependent round trips (seq_lens and block table before the first KV read, the store at the end).
    Each extra launch (a split-KV merge) costs two round trips plus its partial results (written
    and read back) at the copy bandwidth. `dedupe`: blocks that read the same KV (vLLM's one block
    per query head) keep that many times the requests in flight per DRAM byte (L2 serves the rest)."""
    resident = max(1, blocks_per_sm * dev.sms)
    full, rest = divmod(blocks, resident)
    per_block = kv_bytes / blocks

    def wave(b: int) -> float:
        rate = min(dev.copy_bw, b * threads * in_flight / dedupe / dev.latency_s)
        return b * per_block / rate + 2 * dev.latency_s

    t = full * wave(resident) + (wave(rest) if rest else 0.0)
    t += extra_launches * 2 * dev.latency_s + partial_bytes / dev.copy_bw
    return Estimate(t, kv_bytes / t / dev.copy_bw, blocks, resident, full + (1 if rest else 0))


# ---- FlashInfer's batch decode (flashinfer/data/include/flashinfer/attention/decode.cuh, scheduler.cuh)
def flashinfer_geometry(head_dim: int, group: int, kv_itemsize: int, sm_major: int = 9) -> dict:
    """BatchDecodeWithPagedKVCacheDispatched's template parameters and dynamic shared memory."""
    vec = max(16 // kv_itemsize, head_dim // 32)
    bdx = head_dim // vec
    bdy = group
    threads = max(128, bdx * bdy)
    bdz = threads // (bdx * bdy)
    tile = (2 if kv_itemsize == 1 else 4) if group == 1 else 1
    stages = 2 if sm_major >= 8 else 1
    smem = (max(2 * stages * tile * bdy * bdz * head_dim * kv_itemsize, bdz * bdy * head_dim * 4)
            + max(tile * threads * 8, 2 * bdy * bdz * 4))
    return {"vec": vec, "bdx": bdx, "bdy": bdy, "bdz": bdz, "tile": tile, "stages": stages,
            "threads": threads, "smem": smem}


def flashinfer_split(pages: list[int], num_kv_heads: int, page_size: int, blocks_per_sm: int,
                     dev: Device = H200) -> tuple[bool, int, int]:
    """BatchDecodeWithPagedKVCacheWorkEstimationDispatched without CUDA graphs: (split, pages per
    chunk, grid x). No split when batch x kv_heads already fills max_grid = blocks/SM x SMs; else the
    smallest chunk (>= 128 / page_size pages) whose chunk count x kv_heads fits max_grid."""
    max_grid = blocks_per_sm * dev.sms
    if len(pages) * num_kv_heads >= max_grid:
        return False, max(pages), len(pages)
    low, high = max(128 // page_size, 1), max(pages)
    while low < high:
        mid = (low + high) // 2
        if sum(-(-p // mid) for p in pages) * num_kv_heads > max_grid:
            low = mid + 1
        else:
            high = mid
    new_batch = sum(-(-max(p, 1) // low) for p in pages)
    return new_batch != len(pages), low, new_batch


# ---- vLLM's paged attention v1/v2 (vllm 0.10.x csrc/attention/paged_attention_v{1,2}.cu) ----------
VLLM_THREADS = 128
VLLM_PARTITION = 512


def vllm_v1_smem(context: int, head_dim: int, block_size: int) -> int:
    """Dynamic smem of v1: fp32 logits of the whole padded context, or the output reduction buffer."""
    return max(_round_up(context, block_size) * 4, (VLLM_THREADS // 32 // 2) * head_dim * 4)


def vllm_v2_smem(head_dim: int) -> int:
    return max(VLLM_PARTITION * 4, (VLLM_THREADS // 32 // 2) * head_dim * 4)


def vllm_uses_v1(batch: int, context: int, num_heads: int) -> bool:
    """vLLM's own choice (vllm/attention/ops/paged_attn.py): v1 when the context is at most 8192 and
    either one partition suffices or the grid is already large."""
    parts = -(-context // VLLM_PARTITION)
    return context <= 8192 and (parts == 1 or batch * num_heads > 512)


def fmt_pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"
