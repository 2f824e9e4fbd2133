"""Uniform view of the arrays a kernel call receives: numpy, torch (CPU or CUDA), CuPy.

Each argument becomes an `ArrayArg` with its shape, element strides, kgen dtype
name, device and data pointer, so the argument checks are written once for
every backend and every array library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kgen.dtypes import BY_NAME, BY_NUMPY, BY_TORCH
from kgen.errors import ArgumentError
from kgen.optional import module_of


@dataclass
class ArrayArg:
    name: str
    obj: Any  # what the user passed
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # kgen dtype name, or the library's own name when kgen has none
    device: str  # "cpu" | "cuda"
    ptr: int
    native: Any  # numpy array (CPU) or the original object (CUDA) to keep alive / pass on

    @property
    def itemsize(self) -> int:
        return BY_NAME[self.dtype].itemsize if self.dtype in BY_NAME else 0

    def is_c_contiguous(self) -> bool:
        expected = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


def _from_numpy(name: str, arr: np.ndarray, obj: Any) -> ArrayArg:
    d = BY_NUMPY.get(arr.dtype)
    item = arr.dtype.itemsize
    if any(s % item for s in arr.strides):
        raise ArgumentError(f"{name}: strides {arr.strides} are not multiples of the element size {item}")
    return ArrayArg(name, obj, tuple(arr.shape), tuple(s // item for s in arr.strides),
                    d.name if d else str(arr.dtype), "cpu", int(arr.ctypes.data), arr)


def _torch_cpu_as_numpy(t: Any) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor, including bf16/fp8 (viewed through ml_dtypes)."""
    import torch

    tname = str(t.dtype).removeprefix("torch.")
    d = BY_TORCH.get(tname)
    if d is not None and tname in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        raw = t.view(torch.int16 if d.itemsize == 2 else torch.uint8).numpy()
        return raw.view(d.numpy)
    return t.numpy()


def as_array_arg(name: str, obj: Any) -> ArrayArg:
    """Describe one array argument; refuse anything that is not an array."""
    if isinstance(obj, np.ndarray):
        return _from_numpy(name, obj, obj)
    module = module_of(obj)
    if module == "torch":
        if obj.device.type == "cpu":
            return _from_numpy(name, _torch_cpu_as_numpy(obj.detach()), obj)
        tname = str(obj.dtype).removeprefix("torch.")
        d = BY_TORCH.get(tname)
        return ArrayArg(name, obj, tuple(obj.shape), tuple(obj.stride()), d.name if d else tname,
                        obj.device.type, int(obj.data_ptr()), obj)
    if module == "cupy":
        d = BY_NUMPY.get(obj.dtype)
        item = obj.dtype.itemsize
        return ArrayArg(name, obj, tuple(obj.shape), tuple(s // item for s in obj.strides),
                        d.name if d else str(obj.dtype), "cuda", int(obj.data.ptr), obj)
    raise ArgumentError(
        f"{name}: expected a numpy array, a torch tensor or a CuPy array, got {type(obj).__name__}"
    )


def empty_like_library(ref: ArrayArg, shape: tuple[int, ...], dtype_name: str, fill: float | None = None):
    """A new C-contiguous array in the same library and device as `ref` (numpy, torch or CuPy)."""
    d = BY_NAME[dtype_name]
    module = module_of(ref.obj)
    if module == "torch":
        import torch

        t = torch.empty(shape, dtype=getattr(torch, d.torch_name), device=ref.obj.device)
        if fill is not None:
            t.fill_(fill)
        return t
    if module == "cupy":
        import cupy

        a = cupy.empty(shape, dtype=d.numpy)
        if fill is not None:
            a.fill(fill)
        return a
    a = np.empty(shape, dtype=d.numpy)
    if fill is not None:
        a.fill(fill)
    return a


# Same-width integer types, to move dtypes that one library lacks (numpy: bf16/fp8 only via
# ml_dtypes) as raw bits; the bits are then viewed as the real dtype on the other side.
_NP_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def to_backend(arr: np.ndarray, backend: str):
    """A host numpy array for `backend`: itself on the CPU, a torch CUDA tensor (bit-exact, any kgen dtype) on CUDA."""
    if backend == "cpu":
        return arr
    import torch

    d = BY_NUMPY[arr.dtype]
    raw = torch.from_numpy(np.ascontiguousarray(arr).view(_NP_BITS[d.itemsize]))
    return raw.cuda().view(getattr(torch, d.torch_name))


def to_numpy(x) -> np.ndarray:
    """The host numpy copy/view of a kernel result (numpy, torch or CuPy), bf16/fp8 included."""
    if isinstance(x, np.ndarray):
        return x
    module = module_of(x)
    if module == "torch":
        import torch

        d = BY_TORCH[str(x.dtype).removeprefix("torch.")]
        raw = x.detach().cpu().contiguous().view(getattr(torch, _TORCH_BITS[d.itemsize]))
        return raw.numpy().view(d.numpy)
    return x.get()  # CuPy


def args_to_backend(args: dict, backend: str) -> dict:
    """Every array of a call's keyword arguments moved with to_backend."""
    return {key: to_backend(value, backend) for key, value in args.items()}
