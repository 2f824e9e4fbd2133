"""kgen's element types as rows of one table: width in bits (sub-byte included), whether a cache of
it is quantized (real = stored * scale) and the largest magnitude it stores, the oldest arch with
native support, the C++ type of generated source and the header that declares it, and the numpy
and torch counterparts. Everything that asks "what is this dtype" reads this table.

The numpy types of bf16 and fp8 come from ml_dtypes, imported when one is first asked for, not with
kgen: its extension module alone took longer to import than the rest of `import kgen`
(docs/pipeline.md)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # kgen name, as in specs
    ctype: str  # C++ type in generated source
    host: np.dtype | str  # the host element (a packed sub-byte type: its storage byte); a str names an ml_dtypes type
    torch_name: str  # attribute of the torch module
    bits: int  # width of one element; 4 for a packed type (two per byte)
    quantized: bool = False  # a cache of it stores real / scale
    qmax: float | None = None  # quantized: the largest magnitude stored (a per-token scale maps max|x| onto it)
    min_sm: int = 0  # oldest arch with native support (0: every target)
    header: str = ""  # the CUDA header that declares ctype ("" for C++ and kgen's own types)
    row_format: bool = False  # a byte of a self-describing row (values and scales together): not an array dtype

    @property
    def numpy(self) -> np.dtype:
        """The host element as a numpy dtype (an ml_dtypes type is imported here, on first use)."""
        return self.host if isinstance(self.host, np.dtype) else ml_dtype(self.host)

    @property
    def packed(self) -> bool:
        return self.bits < 8

    @property
    def itemsize(self) -> int:
        """Bytes of one element; a packed sub-byte type has none (use bytes_for)."""
        if self.packed:
            raise ValueError(f"{self.name} is {self.bits}-bit: elements are packed, {8 // self.bits} per byte "
                             "(use bytes_for(n))")
        return self.bits // 8

    @property
    def storage_bytes(self) -> int:
        """Bytes of one array element as the host holds it: the element, or a packed type's byte."""
        return self.numpy.itemsize

    def bytes_for(self, n: int) -> int:
        """Bytes of n consecutive elements (packed types: rounded up to whole bytes)."""
        return -(-n * self.bits // 8)


_TABLE = [
    DType("fp16", "__half", np.dtype(np.float16), "float16", 16, header="cuda_fp16.h"),
    DType("bf16", "__nv_bfloat16", "bfloat16", "bfloat16", 16, min_sm=80, header="cuda_bf16.h"),
    DType("fp32", "float", np.dtype(np.float32), "float32", 32),
    DType("fp8_e4m3", "__nv_fp8_e4m3", "float8_e4m3fn", "float8_e4m3fn", 8, quantized=True,
          qmax=448.0, min_sm=89, header="cuda_fp8.h"),
    DType("fp8_e5m2", "__nv_fp8_e5m2", "float8_e5m2", "float8_e5m2", 8, quantized=True,
          qmax=57344.0, min_sm=89, header="cuda_fp8.h"),
    DType("int8", "kgen::i8", np.dtype(np.int8), "int8", 8, quantized=True, qmax=127.0),
    # NVFP4 (docs/abi.md): e2m1 values two a byte (element 2i in the low nibble) with e4m3 scales per 16
    DType("nvfp4", "kgen::fp4x2", np.dtype(np.uint8), "uint8", 4, quantized=True, qmax=6.0),
    # DeepSeek-V3.2's FP8 MLA cache (kgen/formats/ds_mla.py): 656-byte rows of e4m3 latent, fp32 tile scales, bf16 rope
    DType("fp8_ds_mla", "unsigned char", np.dtype(np.uint8), "uint8", 8, min_sm=80, row_format=True),
    DType("int32", "int", np.dtype(np.int32), "int32", 32),
]

BY_NAME = {d.name: d for d in _TABLE}
BY_TORCH = {d.torch_name: d for d in _TABLE if not d.packed and not d.row_format}
QUANTIZED = {d.name for d in _TABLE if d.quantized}
QMAX = {d.name: d.qmax for d in _TABLE if d.quantized}
MIN_SM = {d.name: d.min_sm for d in _TABLE if d.min_sm}


def ml_dtypes():
    """The ml_dtypes module (bfloat16, the fp8 types, their finfo), imported on first use (above)."""
    import ml_dtypes  # heavy: see the module's docstring

    return ml_dtypes


@cache
def ml_dtype(name: str) -> np.dtype:
    """ml_dtypes' type `name` ("bfloat16", "float8_e4m3fn") as a numpy dtype."""
    return np.dtype(getattr(ml_dtypes(), name))


@lru_cache(maxsize=1)
def _by_numpy() -> dict[np.dtype, DType]:
    return {d.numpy: d for d in _TABLE if not d.packed and not d.row_format}


def __getattr__(name: str):
    """BY_NUMPY ({numpy dtype: row}) is built on first use: its keys need ml_dtypes (PEP 562)."""
    if name == "BY_NUMPY":
        return _by_numpy()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        known = _by_numpy().get(dt)
        return known.name if known else str(dt)
    name = str(dt).removeprefix("torch.")
    known = BY_TORCH.get(name)
    return known.name if known else name
