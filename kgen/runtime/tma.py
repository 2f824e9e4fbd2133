"""kgen's tensor map for the CPU backend: the descriptor `kgen::TensorMap` holds on the CPU
(templates/simt/kgen_simt_mbar.h), built on the host like CUDA's cuTensorMapEncodeTiled builds a
CUtensorMap for the GPU. Passed by value (128 bytes) as a kernel's `const __grid_constant__
kgen::TensorMap` parameter."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kgen.errors import ArgumentError

MAX_RANK = 5
SWIZZLES = (0, 32, 64, 128)
_MAGIC = 0x4B544D41  # "KTMA"
_DTYPE = np.dtype([("base", "<u8"), ("dims", "<u8", (5,)), ("strides", "<u8", (4,)), ("box", "<u4", (5,)),
                   ("rank", "<u4"), ("elem_bytes", "<u4"), ("swizzle", "<u4"), ("magic", "<u4")], align=True)


def cpu_tensor_map(array: np.ndarray, box: Sequence[int], swizzle: int = 0) -> np.ndarray:
    """The 128-byte descriptor of `array` (numpy, C or strided view; its axes outermost first, as
    numpy orders them) read in boxes of `box` elements (outermost first too). The array must
    outlive every launch that uses the descriptor."""
    if not isinstance(array, np.ndarray) or not 1 <= array.ndim <= MAX_RANK:
        raise ArgumentError(f"a tensor map needs a numpy array of rank 1..{MAX_RANK}")
    if len(box) != array.ndim or not all(1 <= b <= 256 for b in box):
        raise ArgumentError(f"box {tuple(box)}: one size in 1..256 per axis of the {array.ndim}-d array")
    if swizzle not in SWIZZLES:
        raise ArgumentError(f"swizzle {swizzle}: one of {SWIZZLES}")
    elem = array.itemsize
    if swizzle and box[-1] * elem != swizzle:
        raise ArgumentError(f"swizzle {swizzle}: the inner box must be exactly {swizzle} bytes, got {box[-1] * elem}")
    if array.strides[-1] != elem or any(s % 16 or s <= 0 for s in array.strides[:-1]):
        raise ArgumentError("the innermost axis must be contiguous and the other strides positive multiples of 16 bytes")
    d = np.zeros((), _DTYPE)
    rank = array.ndim
    d["base"] = array.ctypes.data
    d["dims"][:rank] = array.shape[::-1]
    d["strides"][: rank - 1] = array.strides[::-1][1:]
    d["box"][:rank] = tuple(box)[::-1]
    d["rank"], d["elem_bytes"], d["swizzle"], d["magic"] = rank, elem, swizzle, _MAGIC
    out = np.frombuffer(d.tobytes().ljust(128, b"\0"), dtype=np.uint8).copy()
    assert out.size == 128
    return out
