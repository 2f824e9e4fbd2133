"""Argument access and checks shared by every family's call binding (one place for the
messages users see: missing/unknown arguments, shape, dtype, device, contiguity), and the
call's arguments as a table (what `kern(...)` and its torch op take, docs/interop.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, adapt, as_array_arg, refuse_aliasing
from kgen.errors import ArgumentError
from kgen.formats.cache import CacheFormat, cache_names, cache_shapes
from kgen.optional import is_torch_tensor
from kgen.runtime.base import DeviceAddress


def host_values(arg: ArrayArg) -> np.ndarray:
    """The argument's values on the host (a copy only for device arrays)."""
    if arg.device == "cpu":
        return np.asarray(arg.native)
    if is_torch_tensor(arg.obj):
        return arg.obj.detach().cpu().numpy()
    return arg.obj.get()


def refuse_plan(spec, plan) -> None:
    """Kinds whose launches do not depend on the lengths take no plan."""
    if plan is not None:
        raise ArgumentError(f"plan: kind {spec.kind} ({spec.name}) has no call-time plan; call it without one")


class CallBinder:
    """One call's arguments: take them by name, check them against the ABI, turn them into launch args."""

    def __init__(self, spec, call: dict[str, Any]):
        self.spec = spec
        self.call = dict(call)
        self.device = "cpu"
        self.first: ArrayArg | None = None  # the first array taken: where values made by kgen go

    def take(self, name: str, required: bool) -> ArrayArg | None:
        obj = self.call.pop(name, None)
        if obj is None:
            if required:
                raise ArgumentError(f"missing argument '{name}' (required by spec {self.spec.name})")
            return None
        arg = as_array_arg(name, obj)
        self.first = self.first or arg
        return arg

    def check(self, arg: ArrayArg, shape: tuple, dtype_name: str, contiguous: bool = False) -> None:
        """Shape, dtype, device and strides; an engine's int64 indices or uint8 fp8 bytes are first
        read as the ABI's dtype (kgen.arrays.adapt)."""
        if arg.shape != tuple(shape):
            raise ArgumentError(f"{arg.name}: expected shape {list(shape)}, got {list(arg.shape)}")
        adapt(arg, dtype_name)
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
        if self.device == "cpu":
            return self.raw(arg.native)
        return DeviceAddress(arg.ptr, arg.native)  # holds the array (maybe a temporary) for the launch

    def raw(self, native):
        """CPU: the numpy array, strided views included (an isolated child maps its whole base
        buffer, so the strides hold there too); CUDA: the device address (holding the array)."""
        if self.device == "cpu":
            return native if isinstance(native, np.ndarray) else int(native)
        if isinstance(native, (int, np.integer)):
            return np.uint64(native)
        return DeviceAddress(as_array_arg("cache", native).ptr, native)  # a device array (CuPy, torch) given whole


# ---- the call's arguments as a table ---------------------------------------------------------
SCALE_NAMES = ("k_scale", "v_scale")
TENSOR_SCALE_NAMES = ("k_tensor_scale", "v_tensor_scale")  # nvfp4 (kgen/families/pool.py binds them)
_POOL_HALVES = ("k_cache", "v_cache")


@dataclass(frozen=True)
class CallArg:
    """One argument of a kernel call, `kern(name=...)`: what its torch op declares."""

    name: str
    dtype: str  # kgen dtype of the elements
    shape: tuple  # symbolic, as in the argument table
    use: str  # "read"; "written" (in place); "returned" (allocated by the call and returned)
    optional: bool = False  # may be omitted (for a returned one: returned only when asked for)
    number: bool = False  # a Python float may stand for it (a per-tensor scale)
    layers: bool = False  # one array, or a list of arrays (one per layer)


def call_arguments(family, spec, config) -> list[CallArg]:
    """The call's arguments in ABI order (the family's call_arguments)."""
    return family.call_arguments(spec, config)


def table_call_arguments(family, spec, config) -> list[CallArg]:
    """The call's arguments where they are the kernel's: the argument table's arrays with a fused
    pool's halves as one `kv_cache` and kgen's scratch left out (a family whose call differs from
    its kernel's parameters, copy_blocks, lists its own)."""
    rows: list[CallArg] = []
    for a in family.arguments(spec, config):
        if a.role not in ("input", "output"):
            continue
        use = "written" if a.role == "output" else "read"
        if a.name in _POOL_HALVES:
            if CacheFormat.of(spec).fused:
                if a.name == _POOL_HALVES[0]:
                    rows.append(CallArg("kv_cache", a.dtype, cache_shapes(spec)["kv_cache"], use))
                continue
            rows.append(CallArg(a.name, a.dtype, a.shape, use))
        elif a.name in SCALE_NAMES:
            rows.append(CallArg(a.name, a.dtype, a.shape, use, a.optional,
                                number=a.role == "input" and spec.kv_cache.scale == "per_tensor"))
        elif a.name in TENSOR_SCALE_NAMES:  # nvfp4's: a Python float may stand for one
            rows.append(CallArg(a.name, a.dtype, a.shape, use, number=True))
        else:  # other outputs (out, lse) are the call's results
            rows.append(CallArg(a.name, a.dtype, a.shape, "returned" if a.role == "output" else "read", a.optional))
    return rows
