"""kgen's dtype names and their C++, numpy and torch counterparts (one table, used everywhere)."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # kgen name, as in specs
    ctype: str  # C++ type in generated source
    numpy: np.dtype
    torch_name: str  # attribute of the torch module
    itemsize: int


_TABLE = [
    DType("fp16", "__half", np.dtype(np.float16), "float16", 2),
    DType("bf16", "__nv_bfloat16", np.dtype(ml_dtypes.bfloat16), "bfloat16", 2),
    DType("fp32", "float", np.dtype(np.float32), "float32", 4),
    DType("fp8_e4m3", "__nv_fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn", 1),
    DType("fp8_e5m2", "__nv_fp8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2", 1),
    DType("int8", "kgen::i8", np.dtype(np.int8), "int8", 1),
    DType("int32", "int", np.dtype(np.int32), "int32", 4),
]

BY_NAME = {d.name: d for d in _TABLE}
BY_NUMPY = {d.numpy: d for d in _TABLE}
BY_TORCH = {d.torch_name: d for d in _TABLE}
QUANTIZED = {"fp8_e4m3", "fp8_e5m2", "int8"}


def dtype(name: str) -> DType:
    return BY_NAME[name]


def dtype_label(dt) -> str:
    """How every kgen message spells an array's dtype: kgen's name where kgen has one (fp16, bf16,
    fp32, fp8_e4m3, fp8_e5m2, int8, int32), else numpy's name (float64, int64, uint8, bool).

    `dt` is a numpy dtype (numpy and CuPy arrays) or a torch dtype; torch's names equal numpy's for
    every type both have, so a torch float64 tensor reads "float64" like a numpy one, and a type only
    torch has keeps torch's name.
    """
    if isinstance(dt, np.dtype):
        known = BY_NUMPY.get(dt)
        return known.name if known else str(dt)
    name = str(dt).removeprefix("torch.")
    known = BY_TORCH.get(name)
    return known.name if known else name
