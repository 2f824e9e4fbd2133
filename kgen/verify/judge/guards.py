"""Tripwires around one kernel call (docs/verification.md).

Guards: every output and scratch buffer a case hands a kernel is a view inside a larger
buffer; the bytes around it (one row of the buffer, at least GUARD_BYTES, before and after
it, and the gaps of a strided view) hold random bytes a kernel cannot produce by accident.
After the call they must be unchanged: a kernel that writes past `out` (or between its rows)
fails, naming the buffer and where.

Seals: every input is fingerprinted (sha256 of the bytes of the buffer it lives in, padding
included) before the call and checked after it: a kernel that writes any input fails, naming
the input. A sparse array (a pool of billions of elements of which a case writes a few blocks)
is fingerprinted over the byte ranges the case wrote.

Both work on host (numpy) arrays and on the device copies kgen.arrays.to_backend makes of
them (which keep the buffer around a view).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kgen.arrays import host_owner
from kgen.runtime.cuda import cupy_module
from kgen.verify.judge.report import CaseResult

GUARD_BYTES = 256  # the least guard before and after a buffer (a multiple of 16: the view stays aligned)

Ranges = list[tuple[int, int]]  # byte ranges [lo, hi) of an array's owner buffer


def owner_bytes(x, nbytes: int, ranges: Ranges | None = None) -> np.ndarray:
    """The bytes of the buffer `x` lives in (host copy for a device array): all `nbytes`, or the
    concatenated `ranges`."""
    if isinstance(x, np.ndarray):
        flat = host_owner(x).reshape(-1).view(np.uint8)[:nbytes]
        return flat if ranges is None else np.concatenate([flat[lo:hi] for lo, hi in ranges])
    cp = cupy_module()  # a CuPy array from kgen.arrays.to_backend: its allocation starts at the owner's first byte
    whole = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(x.data.mem, 0))
    if ranges is None:
        return whole.get()
    return np.concatenate([whole[lo:hi].get() for lo, hi in ranges])


# ---- seals: inputs unchanged -----------------------------------------------------------------
@dataclass
class Seal:
    name: str
    digest: str
    nbytes: int
    ranges: Ranges | None


def _digest(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).data).hexdigest()


def seal(name: str, host: np.ndarray, ranges: Ranges | None = None) -> Seal:
    """Fingerprint an input (a host array) before the call."""
    nbytes = host_owner(host).nbytes
    return Seal(name, _digest(owner_bytes(host, nbytes, ranges)), nbytes, ranges)


def broken_seals(seals: list[Seal], args: dict) -> list[str]:
    """The names of the inputs whose bytes changed (args: the arrays the kernel was given)."""
    return [s.name for s in seals if _digest(owner_bytes(args[s.name], s.nbytes, s.ranges)) != s.digest]


# ---- guards: nothing written outside the outputs ---------------------------------------------
@dataclass
class Guarded:
    name: str
    view: np.ndarray  # the host array to hand the kernel (moved with to_backend)
    initial: np.ndarray  # the owner's bytes before the call
    outside: np.ndarray  # per owner byte: True where the kernel must not write
    start: int  # byte offset of the view's first element in the owner
    end: int  # byte offset just past its last element


def guarded(name: str, shape: tuple, np_dtype, rng: np.random.Generator, fill=np.nan,
            pad: tuple[int, ...] | None = None, content: np.ndarray | None = None) -> Guarded:
    """A `shape` array of `np_dtype` pre-filled with `fill` (poison) or a copy of `content`,
    inside a buffer of random bytes: GUARD_BYTES before and after it and, with `pad` (extra
    elements per axis), gaps between its rows (a strided view)."""
    dt = np.dtype(np_dtype)
    pad = pad or (0,) * len(shape)
    outer = tuple(n + p for n, p in zip(shape, pad, strict=True))
    # at least one step of the first axis (a row, a block): an off-by-one row lands in the guard
    row = int(np.prod(outer[1:], dtype=np.int64)) * dt.itemsize
    g = -(-max(GUARD_BYTES, row) // 64) * 64 // dt.itemsize
    count = int(np.prod(outer, dtype=np.int64))
    owner = rng.integers(0, 256, size=(2 * g + count) * dt.itemsize, dtype=np.uint8).view(dt)
    inner = tuple(slice(0, n) for n in shape)
    view = owner[g:g + count].reshape(outer)[inner]
    view[...] = np.asarray(fill).astype(dt) if content is None else content
    inside = np.zeros(owner.size, dtype=bool)
    inside[g:g + count].reshape(outer)[inner] = True
    start = g * dt.itemsize
    end = start + (int(np.max(np.nonzero(inside)[0])) - g + 1) * dt.itemsize if view.size else start
    return Guarded(name, view, owner.view(np.uint8).copy(), np.repeat(~inside, dt.itemsize), start, end)


def check_guard(g: Guarded, given) -> str | None:
    """None if every guard byte around `g` is unchanged after the call (given: the array the
    kernel got, host or device), else what was written where."""
    after = owner_bytes(given, g.initial.size)
    changed = np.nonzero((after != g.initial) & g.outside)[0]
    if not changed.size:
        return None
    first, n = int(changed[0]), int(changed.size)
    if first < g.start:
        where = f"{g.start - first} byte(s) before the start of '{g.name}'"
    elif first >= g.end:
        where = f"{first - g.end} byte(s) past the end of '{g.name}'"
    else:
        where = f"in the gap between rows of '{g.name}' (a strided view: {first - g.start} bytes from its start)"
    return f"the kernel wrote outside '{g.name}': {n} guard byte(s) changed, the first {where}"


def tripwires(result: CaseResult, buffers: dict[str, Guarded], seals: list[Seal], given: dict) -> CaseResult:
    """Fail `result` for a write outside a guarded buffer or into a sealed input (given: the
    arrays the kernel got, by the names of `buffers` and `seals`)."""
    for name, g in buffers.items():
        problem = check_guard(g, given[name])
        if problem:
            result.fail(problem, {"buffer": g.name})
    for name in broken_seals(seals, given):
        result.fail(f"the kernel wrote into its input '{name}' (its bytes changed during the call)", {"input": name})
    return result
