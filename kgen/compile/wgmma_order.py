"""The wgmma ordering rules, checked where the CPU backend cannot see them: in the PTX and the SASS.

The CPU backend runs wgmma synchronously and its fences are no-ops, so a kernel that touches wgmma's
registers inside the asynchronous window verifies there and is undefined on a GPU. The PTX ISA
(wgmma.fence, "async proxy"): wgmma.fence must separate any access to a register from a
wgmma.mma_async that accesses the same register as accumulator or A fragment (accesses by wgmmas of
the same shape chaining one accumulator excepted), and a wgmma's registers may be accessed again only
once a wgmma.wait_group has completed its group.

- `check_ptx(ptx)`: for every wgmma.mma_async, in the PTX's text order within its function: no
  instruction between the nearest wgmma.fence before it and it accesses its accumulator or A
  registers, and none after it does before the commit_group / wait_group that completes it.
- `check_sass(sass)`: for every HGMMA batch: one WARPGROUP.ARRIVE before it and none inside it, no
  write to an HGMMA's A or accumulator registers between the arrive and it, a WARPGROUP.DEPBAR before
  anything else touches the batch's accumulators, and at a `WARPGROUP.DEPBAR.LE gsb0, N` no more than
  N + 1 batches (arrives) since the last one. An arrive ptxas injected (advisories C7519/C7520: a
  register access it had to fence inside the source's batch) splits a batch and breaks the last rule
  where the source waits for each batch before the next (every wgmma body of kgen's); a kernel that
  keeps batches in flight and whose split ptxas hides in a larger N is beyond it.

Both read straight-line text order (the kernels keep each batch in one block); each problem names the
function, the line or address, and the instruction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kgen.perf.model import Instr, parse_sass


@dataclass(frozen=True)
class OrderProblem:
    function: str
    where: str    # "PTX line N" or "SASS /*addr*/"
    message: str

    def __str__(self) -> str:
        return f"{self.function}: {self.where}: {self.message}"


# ---- PTX ------------------------------------------------------------------------------------------------
_PTX_FUNC = re.compile(r"^\s*(?:\.(?:visible|weak|extern)\s+)*\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)")
_REG = re.compile(r"%[a-z]+\d+\b")
_WGMMA = re.compile(r"^\s*(wgmma\.mma_async\S*)\s+\{([^}]*)\}\s*,\s*(\{[^}]*\}|%\w+)")
_WAIT = re.compile(r"^\s*wgmma\.wait_group\S*\s+(\d+)")


@dataclass
class _Ptx:
    line: int     # 1-based line in the PTX text
    text: str     # the instruction, comments stripped


@dataclass
class _Wgmma:
    index: int
    shape: str
    acc: tuple[str, ...]
    a: tuple[str, ...]   # A's registers (empty: A from shared memory, a descriptor)

    @property
    def registers(self) -> set[str]:
        return set(self.acc) | set(self.a)


def _ptx_functions(ptx: str) -> dict[str, list[_Ptx]]:
    out: dict[str, list[_Ptx]] = {}
    current: list[_Ptx] | None = None
    for n, raw in enumerate(ptx.splitlines(), 1):
        if m := _PTX_FUNC.match(raw):
            current = out.setdefault(m.group(1), [])
            continue
        text = raw.split("//", 1)[0].strip()
        if current is not None and text and text not in ("{", "}") and not text.startswith(".reg"):
            current.append(_Ptx(n, text))
    return out


def _wgmma(index: int, ins: _Ptx) -> _Wgmma | None:
    m = _WGMMA.match(ins.text)
    if not m:
        return None
    acc = tuple(_REG.findall(m.group(2)))
    a = tuple(_REG.findall(m.group(3))) if m.group(3).startswith("{") else ()
    return _Wgmma(index, m.group(1), acc, a)


def _chains(other: _Wgmma | None, w: _Wgmma) -> bool:
    """Another wgmma of the same shape on the same accumulators: ordered with w by the ISA itself."""
    return other is not None and other.shape == w.shape and other.acc == w.acc


def _touches(ins: _Ptx, regs: set[str]) -> list[str]:
    return sorted(regs & set(_REG.findall(ins.text)))


def check_ptx(ptx: str) -> list[OrderProblem]:
    """Register accesses inside the asynchronous window of each wgmma.mma_async (see the module doc)."""
    problems = []
    for name, body in _ptx_functions(ptx).items():
        parsed = [_wgmma(i, ins) for i, ins in enumerate(body)]
        for w in (p for p in parsed if p is not None):
            problems += _before(name, body, parsed, w) + _after(name, body, parsed, w)
    return problems


def _before(name: str, body: list[_Ptx], parsed: list, w: _Wgmma) -> list[OrderProblem]:
    regs, at = w.registers, body[w.index].line
    for j in range(w.index - 1, -1, -1):
        ins = body[j]
        if ins.text.startswith("wgmma.fence"):
            return []
        if _chains(parsed[j], w):
            continue
        hit = _touches(ins, regs)
        if hit:
            return [OrderProblem(name, f"PTX line {ins.line}", f"`{ins.text}` accesses {', '.join(hit)} of the "
                                 f"wgmma at line {at} after the wgmma.fence before that wgmma (PTX ISA: its "
                                 "registers are accessed before the fence or by the wgmma alone)")]
    return [OrderProblem(name, f"PTX line {at}", "wgmma.mma_async with no wgmma.fence before it")]


def _after(name: str, body: list[_Ptx], parsed: list, w: _Wgmma) -> list[OrderProblem]:
    regs, at = w.registers, body[w.index].line
    commits = 0
    for j in range(w.index + 1, len(body)):
        ins = body[j]
        if ins.text.startswith("wgmma.commit_group"):
            commits += 1
            continue
        if (m := _WAIT.match(ins.text)) and commits and commits - 1 >= int(m.group(1)):
            return []  # the groups committed after w's are at most N: w's group has completed
        if _chains(parsed[j], w):
            continue
        hit = _touches(ins, regs)
        if hit:
            return [OrderProblem(name, f"PTX line {ins.line}", f"`{ins.text}` accesses {', '.join(hit)} of the "
                                 f"wgmma at line {at} before a wgmma.wait_group completed it")]
    return [OrderProblem(name, f"PTX line {at}", "wgmma.mma_async never completed by a wgmma.wait_group")]


# ---- SASS -----------------------------------------------------------------------------------------------
_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")
_SASS_REG = re.compile(r"\bR(\d+)\b")
_DEPBAR_LE = re.compile(r"gsb0\s*,\s*(0x[0-9a-f]+|\d+)")


def _hgmma_registers(ins: Instr) -> tuple[set[int], set[int]]:
    """(accumulator registers, A registers) of an HGMMA: D is N/2 registers from its first operand;
    A, when in registers (the second operand an R, not a descriptor), four."""
    n = int(_HGMMA_SHAPE.match(ins.opcode).group(2))
    ops = [o.strip() for o in ins.operands.split(",")]
    first = _SASS_REG.fullmatch(ops[0])
    acc = set(range(int(first.group(1)), int(first.group(1)) + n // 2)) if first else set()
    second = _SASS_REG.fullmatch(ops[1]) if len(ops) > 1 else None
    a = set(range(int(second.group(1)), int(second.group(1)) + 4)) if second else set()
    return acc, a


def _written(ins: Instr) -> set[int]:
    """The registers an instruction writes, as far as its first operand says (R<n>: one register, two
    or four for .64 / .128 forms); none for stores and other instructions whose first operand is an
    address or a predicate."""
    ops = ins.operands.split(",")
    m = _SASS_REG.fullmatch(ops[0].strip()) if ops and ins.base not in ("STG", "STS", "STL", "ST", "RED", "ATOM") else None
    if not m:
        return set()
    width = 4 if "128" in ins.mods else 2 if "64" in ins.mods or "WIDE" in ins.mods else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _read_or_written(ins: Instr) -> set[int]:
    return {int(r) for r in _SASS_REG.findall(ins.operands)}


def _where(ins: Instr) -> str:
    return f"SASS /*{ins.addr:04x}*/"


def check_sass(sass: str) -> list[OrderProblem]:
    """WARPGROUP.ARRIVE / HGMMA / WARPGROUP.DEPBAR placement in every function (see the module doc)."""
    problems = []
    for name, fn in parse_sass(sass).items():
        armed = False        # a WARPGROUP.ARRIVE since the last DEPBAR, no HGMMA yet
        in_batch = False     # HGMMAs issued, the batch's last (gsb0) not yet
        pending: set[int] = set()   # accumulators of issued batches no DEPBAR has waited for
        written: set[int] = set()   # registers written since the arrive
        batches = 0                 # WARPGROUP.ARRIVEs since the last DEPBAR
        for ins in fn.instrs:
            text = f"`{ins.opcode} {ins.operands}`".replace(" `", "`")
            if ins.opcode.startswith("WARPGROUP.ARRIVE"):
                if in_batch:
                    problems.append(OrderProblem(name, _where(ins), "WARPGROUP.ARRIVE inside an HGMMA batch: ptxas "
                                                 "fenced a register access between the batch's wgmmas"))
                armed, written, batches = True, set(), batches + 1
            elif ins.opcode.startswith("WARPGROUP.DEPBAR"):
                m = _DEPBAR_LE.search(ins.operands)
                if m and batches > int(m.group(1), 0) + 1:
                    problems.append(OrderProblem(name, _where(ins), f"{text} after {batches} WARPGROUP.ARRIVEs: more "
                                                 "batches than the wait leaves pending plus one, so ptxas split a batch "
                                                 "(an arrive it injected to fence a register access)"))
                pending, armed, in_batch, batches = set(), False, False, 0
            elif ins.base == "HGMMA":
                acc, a = _hgmma_registers(ins)
                if not armed and not in_batch:
                    problems.append(OrderProblem(name, _where(ins), f"{text} with no WARPGROUP.ARRIVE before it"))
                hit = sorted(written & (acc | a))
                if hit:
                    problems.append(OrderProblem(name, _where(ins), f"{text} reads R{', R'.join(map(str, hit))}, "
                                                 "written after the WARPGROUP.ARRIVE before it"))
                pending |= acc
                in_batch = "gsb0" not in ins.operands
                armed = False
            else:
                hit = sorted(pending & _read_or_written(ins))
                if hit:
                    problems.append(OrderProblem(name, _where(ins), f"{text} accesses R{', R'.join(map(str, hit))}, "
                                                 "accumulators of an HGMMA no WARPGROUP.DEPBAR has waited for"))
                    pending -= set(hit)
                written |= _written(ins)
    return problems
