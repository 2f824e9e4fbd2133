"""Argument access and checks shared by every family's call binding (one place for the
messages users see: missing/unknown arguments, shape, dtype, device, contiguity)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, as_array_arg, refuse_aliasing
from kgen.errors import ArgumentError
from kgen.families.layout import cache_names
from kgen.optional import is_torch_tensor


def host_values(arg: ArrayArg) -> np.ndarray:
    """The argument's values on the host (a copy only for device arrays)."""
    if arg.device == "cpu":
        return np.asarray(arg.native)
    if is_torch_tensor(arg.obj):
        return arg.obj.detach().cpu().numpy()
    return arg.obj.get()


class CallBinder:
    """One call's arguments: take them by name, check them against the ABI, turn them into launch args."""

    def __init__(self, spec, call: dict[str, Any]):
        self.spec = spec
        self.call = dict(call)
        self.device = "cpu"

    def take(self, name: str, required: bool) -> ArrayArg | None:
        obj = self.call.pop(name, None)
        if obj is None:
            if required:
                raise ArgumentError(f"missing argument '{name}' (required by spec {self.spec.name})")
            return None
        return as_array_arg(name, obj)

    def check(self, arg: ArrayArg, shape: tuple, dtype_name: str, contiguous: bool = False) -> None:
        if arg.shape != tuple(shape):
            raise ArgumentError(f"{arg.name}: expected shape {list(shape)}, got {list(arg.shape)}")
        if arg.dtype != dtype_name:
            raise ArgumentError(f"{arg.name}: expected dtype {dtype_name}, got {arg.dtype}")
        if arg.device != self.device:
            raise ArgumentError(f"{arg.name}: on {arg.device}, but the other arguments are on {self.device}")
        if 0 in arg.shape:  # an empty array has no elements to lay out (numpy gives it zero strides)
            return
        if contiguous and not arg.is_c_contiguous():
            raise ArgumentError(f"{arg.name}: must be C-contiguous (strides {list(arg.strides)})")
        if arg.shape and arg.shape[-1] > 1 and arg.strides[-1] != 1:
            raise ArgumentError(f"{arg.name}: the last dimension must be contiguous (stride {arg.strides[-1]})")

    def refuse_other_layouts(self) -> None:
        names = cache_names(self.spec)
        for other in {"kv_cache", "k_cache", "v_cache"} - set(names):
            if self.call.get(other) is not None:
                raise ArgumentError(
                    f"{other}: not an argument of layout '{self.spec.kv_cache.layout}' (pass {' and '.join(names)})")

    def refuse_aliasing(self, written: list[ArrayArg | None], read: list[ArrayArg | None]) -> None:
        """Where outputs are bound: no array the kernel writes may overlap one it reads."""
        refuse_aliasing(written, read)

    def refuse_unknown(self) -> None:
        if self.call:
            raise ArgumentError(f"unknown argument(s): {', '.join(sorted(self.call))}")

    def pointer(self, arg: ArrayArg | None):
        if arg is None:
            return None if self.device == "cpu" else np.uint64(0)
        return self.raw(arg.native if self.device == "cpu" else arg.ptr)

    def raw(self, native):
        """CPU: the numpy array, strided views included (an isolated child maps its whole base
        buffer, so the strides hold there too); CUDA: the device address."""
        if self.device == "cpu":
            return native if isinstance(native, np.ndarray) else int(native)
        return np.uint64(native)
