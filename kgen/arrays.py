"""Uniform view of the arrays a kernel call receives: numpy, torch (CPU or CUDA), CuPy.

Each argument becomes an `ArrayArg` with its shape, element strides, dtype (spelled as
kgen.formats.dtypes.dtype_label spells it), device and data pointer, so the argument checks are
written once for every backend and every array library. Arrays move between libraries
and devices through DLPack and CuPy: kgen needs torch only to hand results back as torch
tensors to a caller who passed torch tensors (the `torch` extra).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kgen.errors import ArgumentError, ToolchainError
from kgen.formats.dtypes import BY_NAME, BY_TORCH, dtype_label
from kgen.optional import module_of
from kgen.runtime.cuda import cupy_module
from kgen.settings import KGEN_DEBUG


@dataclass
class ArrayArg:
    name: str
    obj: Any  # what the user passed
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # dtype_label: kgen's name, else numpy's
    device: str  # "cpu" | "cuda"
    ptr: int
    native: Any  # numpy array (CPU) or the original object (CUDA) to keep alive / pass on

    @property
    def itemsize(self) -> int:
        if self.dtype in BY_NAME:
            return BY_NAME[self.dtype].storage_bytes  # a packed type's array holds bytes
        return int(getattr(getattr(self.obj, "dtype", None), "itemsize", 0))

    def is_c_contiguous(self) -> bool:
        expected = 1
        for dim, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True


def _torch():
    """torch, for the calls that hand torch tensors back; a clear error when it is missing or broken."""
    try:
        import torch
    except Exception as e:  # ImportError, or a torch install that fails to load its libraries
        raise ToolchainError(f"torch is not usable ({e}); install it with: pip install 'kgen[torch]'") from e
    return torch


# Same-width integer types, to move dtypes that one library lacks (bf16 and fp8 in DLPack and CuPy)
# as raw bits; the bits are then viewed as the real dtype on the other side.
_NP_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _from_numpy(name: str, arr: np.ndarray, obj: Any) -> ArrayArg:
    item = arr.dtype.itemsize
    if any(s % item for s in arr.strides):
        raise ArgumentError(f"{name}: strides {arr.strides} are not multiples of the element size {item}")
    return ArrayArg(name, obj, tuple(arr.shape), tuple(s // item for s in arr.strides),
                    dtype_label(arr.dtype), "cpu", int(arr.ctypes.data), arr)


def _torch_as_numpy(t: Any) -> np.ndarray | None:
    """Zero-copy numpy view of a CPU tensor through DLPack, bf16/fp8 included (as raw bits, then viewed
    through ml_dtypes); None for a dtype numpy cannot hold."""
    d = BY_TORCH.get(str(t.dtype).removeprefix("torch."))
    try:
        if d is None:
            return np.from_dlpack(t)
        return np.from_dlpack(t.view(getattr(_torch(), _TORCH_BITS[d.itemsize]))).view(d.numpy)
    except (TypeError, BufferError, RuntimeError):
        return None


def as_array_arg(name: str, obj: Any) -> ArrayArg:
    """Describe one array argument; refuse anything that is not an array."""
    if isinstance(obj, np.ndarray):
        return _from_numpy(name, obj, obj)
    library = module_of(obj)
    if library == "torch":
        t = obj.detach()
        if t.device.type == "cpu":
            view = _torch_as_numpy(t)
            if view is not None:
                return _from_numpy(name, view, obj)
        return ArrayArg(name, obj, tuple(t.shape), tuple(t.stride()), dtype_label(t.dtype), t.device.type,
                        int(t.data_ptr()), obj)
    if library == "cupy":
        item = obj.dtype.itemsize
        return ArrayArg(name, obj, tuple(obj.shape), tuple(s // item for s in obj.strides),
                        dtype_label(obj.dtype), "cuda", int(obj.data.ptr), obj)
    raise ArgumentError(
        f"{name}: expected a numpy array, a torch tensor or a CuPy array, got {type(obj).__name__}"
    )


def _byte_span(arg: ArrayArg) -> tuple[int, int]:
    """[first, last + 1) of the bytes the array's elements occupy."""
    item = arg.itemsize
    lo = hi = arg.ptr
    for dim, stride in zip(arg.shape, arg.strides, strict=True):
        reach = (dim - 1) * stride * item
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + item


class _Addresses:
    """numpy's array interface over an argument's addresses: lets np.shares_memory solve the overlap
    of any two strided layouts (CPU or device pointers alike; nothing is ever read through it)."""

    def __init__(self, arg: ArrayArg):
        item = arg.itemsize
        self.__array_interface__ = {"shape": arg.shape, "typestr": f"|V{item}", "data": (arg.ptr, True),
                                    "strides": tuple(s * item for s in arg.strides), "version": 3}


# Effort bound for numpy's exact overlap solver; past it the arrays count as overlapping.
_OVERLAP_WORK = 1 << 16


def overlaps(a: ArrayArg, b: ArrayArg) -> bool:
    """True when the two arrays share at least one byte (or the layouts are too tangled to tell)."""
    if a.device != b.device or 0 in a.shape or 0 in b.shape:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _byte_span(a), _byte_span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    # Spans that meet may still interleave without a common byte (two column halves of one buffer).
    try:
        return bool(np.shares_memory(np.asarray(_Addresses(a)), np.asarray(_Addresses(b)),
                                     max_work=_OVERLAP_WORK))
    except np.exceptions.TooHardError:
        return True


def refuse_aliasing(written: Iterable[ArrayArg | None], read: Iterable[ArrayArg | None]) -> None:
    """ArgumentError naming both arguments when an array the kernel writes overlaps one it reads:
    the threads would read values other threads already overwrote."""
    inputs = [r for r in read if r is not None]
    for w in written:
        if w is None:
            continue
        for r in inputs:
            if r is not w and overlaps(w, r):
                raise ArgumentError(
                    f"{w.name} overlaps {r.name} in memory: the kernel writes {w.name} while it reads "
                    f"{r.name}, so the result would be wrong; pass {w.name} a buffer of its own"
                )


def empty_like_library(ref: ArrayArg, shape: tuple[int, ...], dtype_name: str):
    """A new C-contiguous array in the same library and on the same device as `ref` (numpy, torch or CuPy)."""
    d = BY_NAME[dtype_name]
    library = module_of(ref.obj)
    if library == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, d.torch_name), device=ref.obj.device)
    if library == "cupy":
        with ref.obj.device:
            return cupy_module().empty(shape, dtype=d.numpy)
    return np.empty(shape, dtype=d.numpy)


def host_owner(a: np.ndarray) -> np.ndarray:
    """The ndarray that owns `a`'s memory (`a` itself unless it is a view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _device_copy(host: np.ndarray):
    """A CuPy copy of a C-contiguous host array, bit-exact for any kgen dtype, complete on return:
    CuPy copies asynchronously on the current stream by default, and the array may next be used on
    another (torch's, a caller's non-blocking one) with nothing ordering the two."""
    bits = _NP_BITS.get(host.dtype.itemsize)
    if bits is None:
        return cupy_module().asarray(host, blocking=True)
    return cupy_module().asarray(host.view(bits), blocking=True).view(host.dtype)


def to_backend(arr: np.ndarray, backend: str):
    """A host numpy array for `backend`: itself on the CPU, a CuPy array (bit-exact, any kgen dtype)
    on the current GPU for CUDA. A view keeps its strides: the whole buffer it lives in is copied
    (padding, guard bytes around it) and the device array is the same view of that copy, whose
    allocation starts at the buffer's first byte."""
    if backend == "cpu":
        return arr
    owner = host_owner(arr)
    if owner is arr or not owner.flags.c_contiguous or arr.size == 0:
        return _device_copy(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))  # keeps 0-d scales 0-d
    cp = cupy_module()
    whole = _device_copy(owner.reshape(-1).view(np.uint8))
    bits = _NP_BITS.get(arr.dtype.itemsize, arr.dtype)
    view = cp.ndarray(arr.shape, bits, whole.data + (arr.ctypes.data - owner.ctypes.data), strides=arr.strides)
    return view if bits is arr.dtype else view.view(arr.dtype)


def to_numpy(x) -> np.ndarray:
    """The host numpy copy/view of a kernel result (numpy, torch or CuPy), bf16/fp8 included."""
    if isinstance(x, np.ndarray):
        return x
    if module_of(x) == "torch":
        t = x.detach()
        d = BY_TORCH.get(str(t.dtype).removeprefix("torch."))
        raw = t.view(getattr(_torch(), _TORCH_BITS[d.itemsize])) if d is not None else t
        host = np.from_dlpack(raw) if t.device.type == "cpu" else cupy_module().from_dlpack(raw).get()
        return host.view(d.numpy) if d is not None else host
    bits = _NP_BITS.get(x.dtype.itemsize)  # CuPy: copy raw bits (its kernels know no fp8)
    return x.get() if bits is None else x.view(bits).get().view(x.dtype)


def full_like_library(ref: ArrayArg, shape: tuple[int, ...], value: float, dtype_name: str):
    """Like empty_like_library, every element `value` (on a GPU a fill kernel: no host-to-device copy)."""
    d = BY_NAME[dtype_name]
    library = module_of(ref.obj)
    if library == "torch" and ref.device != "cpu":
        torch = _torch()
        return torch.full(shape, value, dtype=getattr(torch, d.torch_name), device=ref.obj.device)
    if library == "cupy":
        with ref.obj.device:
            return cupy_module().full(shape, value, dtype=d.numpy)
    return np.full(shape, value, dtype=d.numpy)  # host memory: the kernel reads it in place


def checks_values(device: str, debug: bool | None = None) -> bool:
    """Whether a call checks the values the kernel trusts (seq_lens, block-table entries, slots):
    `debug` when given, else KGEN_DEBUG when set, else on host arrays only (device arrays would
    have to be copied to the host: a synchronisation on every call)."""
    if debug is not None:
        return debug
    setting = KGEN_DEBUG.value()
    return device == "cpu" if setting is None else setting


# ---- engines' arrays read as the ABI's (docs/interop.md) ---------------------------------------
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
_FP8 = ("fp8_e4m3", "fp8_e5m2")
_FLOATS = ("fp16", "bf16", "fp32", "float64")


def adapt(arg: ArrayArg, expected: str) -> None:
    """Make `arg` read as the ABI's dtype `expected` where an engine stores it differently, in place:
    int64 indices become an int32 copy (host arrays: a value outside int32 is refused; device arrays:
    saturated on the device, so no value silently wraps onto a valid one, and the debug checks
    report the caller's int64 values), uint8 bytes of an fp8 cache (vLLM) are viewed as the
    fp8 type (no copy), and uint8 bytes are an nvfp4 cache's packed pairs or fp8_ds_mla rows.
    Anything else is left for the dtype check to refuse."""
    if expected == "int32" and arg.dtype == "int64":
        _narrow_int64(arg)
    elif expected in ("nvfp4", "fp8_ds_mla") and arg.dtype == "uint8":  # packed pairs, or 656-byte rows: bytes
        arg.dtype = expected
    elif expected in _FP8 and arg.dtype == "uint8":
        arg.dtype = expected
        if arg.device == "cpu":
            arg.native = np.asarray(arg.native).view(BY_NAME[expected].numpy)


def _narrow_int64(arg: ArrayArg) -> None:
    if arg.device == "cpu":
        values = np.asarray(arg.native)
        outside = (values < INT32_MIN) | (values > INT32_MAX)
        if outside.any():
            where = tuple(int(i) for i in np.argwhere(outside)[0])
            at = "[" + ", ".join(str(i) for i in where) + "]" if where else ""
            raise ArgumentError(f"{arg.name}{at} = {int(values[where])} does not fit in int32, the ABI's index "
                                f"type (int64 {arg.name} is accepted and narrowed to int32)")
        narrow = np.ascontiguousarray(values, dtype=np.int32)
        _rebind(arg, narrow, int(narrow.ctypes.data))
        return
    if module_of(arg.obj) == "torch":
        torch = _torch()
        narrow = arg.obj.detach().clamp(INT32_MIN, INT32_MAX).to(torch.int32).contiguous()
        _rebind(arg, narrow, int(narrow.data_ptr()))
        return
    cupy = cupy_module()
    with arg.obj.device:
        narrow = cupy.ascontiguousarray(cupy.clip(arg.obj, INT32_MIN, INT32_MAX).astype(np.int32))
    _rebind(arg, narrow, int(narrow.data.ptr))


def _rebind(arg: ArrayArg, native: Any, ptr: int) -> None:
    """Point `arg` at a C-contiguous int32 copy; `arg.obj` stays the caller's array."""
    arg.native, arg.ptr, arg.dtype = native, ptr, "int32"
    strides, step = [], 1
    for dim in reversed(arg.shape):
        strides.append(step)
        step *= dim
    arg.strides = tuple(reversed(strides))


def scale_value(name: str, value: Any, ref: ArrayArg | None, shape: tuple[int, ...]) -> ArrayArg:
    """A per-tensor scale as the kernel reads it (fp32, shape `shape`) from a Python or numpy number
    or a one-element array of any float dtype; placed like `ref` (same library and device; None: numpy)."""
    if isinstance(value, bool):
        raise ArgumentError(f"{name}: expected a number or an fp32 array, got a bool")
    if isinstance(value, int | float | np.integer | np.floating):
        made = np.full(shape, value, np.float32) if ref is None else full_like_library(ref, shape, float(value), "fp32")
        return as_array_arg(name, made)
    arg = as_array_arg(name, value)
    if arg.dtype == "fp32" or arg.dtype not in _FLOATS or int(np.prod(arg.shape)) != 1:
        return arg  # the caller's checks name what is wrong with it
    if arg.device == "cpu":
        return as_array_arg(name, np.asarray(arg.native, dtype=np.float32).reshape(shape))
    if module_of(arg.obj) == "torch":
        return as_array_arg(name, arg.obj.detach().to(_torch().float32).reshape(shape))
    with arg.obj.device:
        return as_array_arg(name, arg.obj.astype(np.float32).reshape(shape))


def args_to_backend(args: dict, backend: str) -> dict:
    """Every array of a call's keyword arguments moved with to_backend."""
    return {key: to_backend(value, backend) for key, value in args.items()}
