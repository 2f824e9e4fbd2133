"""Bit-exact comparison, for kernels whose result is defined to the bit (the cache kinds;
docs/verification.md). The families build their cases on these primitives: pools of random
bytes (a poison pattern a kernel cannot produce by accident), and a comparison in which every
element of every array must match bitwise. CaseResult.max_error counts wrong elements (bound
0); the note names the first one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kgen.verify.judge.report import CaseResult

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# describe(index) -> (note, first_failure dict or None) for the first wrong element of an array
Describe = Callable[[tuple[int, ...]], tuple[str, dict | None]]


def bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of the same width."""
    return np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])


def random_bytes(rng: np.random.Generator, shape: tuple, np_dtype: np.dtype) -> np.ndarray:
    """An array of `shape` whose bytes are uniformly random (NaNs and infinities included)."""
    n = int(np.prod(shape)) * np_dtype.itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(np_dtype).reshape(shape)


def compare(name: str, count: list[int], arrays: list[tuple[str, np.ndarray, np.ndarray, Describe]]) -> CaseResult:
    """arrays: (label, got, expected, describe); the case passes when all match bitwise."""
    wrong, first = 0, None
    for label, got, exp, describe in arrays:
        bad = bits(got) != bits(exp)
        n = int(bad.sum())
        if n and first is None:
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            note, where = describe(idx)
            first = (f"{label}{list(idx)}: got {got[idx]!r} (bits {int(bits(got)[idx]):#x}), expected {exp[idx]!r} "
                     f"(bits {int(bits(exp)[idx]):#x}); {note}", where)
        wrong += n
    result = CaseResult(name, count, float(wrong), 0.0, wrong == 0)
    if first is not None:
        result.note = f"{wrong} element(s) wrong; first: {first[0]}"
        result.first_failure = first[1]
    return result
