"""A stand-in for the parts of CuPy that kgen calls, over the strict driver model (driver.py).

Arrays live in the model's device memory; array operations run on the current stream and are
checked like launches (they read and write device memory); kernels are loaded from cubins (the
static shared memory from the ELF) and their bodies run on kgen's CPU backend from the source
the cubin was built from. What CuPy does that a caller can trip on is kept: its argument packing
(cupy.ndarray, MemoryPointer, None, numpy and Python scalars; anything else is
`TypeError: Unsupported type`, and a Python int or float is packed as 8 bytes), a grid of 0
launched as one block, no implicit conversion of a device array to numpy, blocking copies to the host by
default (`get`) and asynchronous ones from it through pinned staging (`asarray`), modules cached by
path.

Where it may differ from CuPy 14 / a real GPU: dtypes are numpy's (CuPy may refuse some, e.g.
ml_dtypes' bfloat16, that this accepts); a kernel that dereferences memory outside its
arguments' allocations (a pointer table) is not checked; a zero grid is reported as the fault
it causes whether or not the kernel would dereference the empty arrays; a CUDA IPC mapping is a
copy at another address, made at ipcOpenMemHandle and copied back at ipcCloseMemHandle (exact only
while the exporter waits, as kgen's parent does for its isolated child); timing (`get_elapsed_time`) is the host time between the events.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from strict_cuda.cubin import source_for, static_smem
from strict_cuda.driver import CAPTURE_MODES, CUDARuntimeError, Driver, LaunchRecord

D: Driver  # set by install()


class Memory:
    """One device allocation (CuPy's cupy.cuda.memory.Memory / PooledMemory); freed when unreferenced."""

    def __init__(self, size: int, stream: int):
        self.alloc = D.malloc(size, stream)
        self.ptr = self.alloc.base
        self.size = size
        self.device_id = self.alloc.device
        weakref.finalize(self, D.free, self.alloc)


class MemoryPointer:
    def __init__(self, mem: Memory | None, offset: int):
        self.mem, self.offset = mem, offset
        self.ptr = 0 if mem is None else mem.ptr + offset
        self.device_id = D.current_device if mem is None else mem.device_id

    def __add__(self, n: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.offset + int(n))


def _check_dtype(dtype) -> np.dtype:
    return np.dtype(dtype)


class ndarray:  # noqa: N801 (CuPy's name)
    """cupy.ndarray over model memory."""

    def __init__(self, shape, dtype=float, memptr: MemoryPointer | None = None, strides=None):
        D.check_alive()
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, tuple | list) else (shape,)))
        self.dtype = _check_dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        if strides is None:
            strides, step = [], self.dtype.itemsize
            for dim in reversed(self.shape):
                strides.append(step)
                step *= dim
            strides = tuple(reversed(strides))
        self.strides = tuple(int(s) for s in strides)
        if memptr is None:
            memptr = MemoryPointer(Memory(self.nbytes, current_stream_handle()), 0) if self.nbytes else MemoryPointer(None, 0)
        self.data = memptr

    # -- what kgen reads --------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def device(self):
        return Device(self.data.device_id)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "strides": self.strides, "version": 3}

    @property
    def flags(self):
        return types.SimpleNamespace(c_contiguous=self._contiguous())

    def _contiguous(self) -> bool:
        step = self.dtype.itemsize
        for dim, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if dim != 1 and stride != step:
                return False
            step *= dim
        return True

    def _host(self) -> np.ndarray:
        """The numpy view of this array's device bytes (the model's memory is host memory)."""
        if self.size == 0:
            return np.empty(self.shape, self.dtype)
        alloc = self.data.mem.alloc
        if not alloc.live:
            D.violate(f"use of freed memory 0x{alloc.base:x} through an array")
        return np.ndarray(self.shape, self.dtype, buffer=alloc.buffer, offset=self.data.offset, strides=self.strides)

    def _use(self, stream: int, write: bool, what: str) -> None:
        if self.size and self.data.mem is not None:
            D.access(self.data.mem.alloc, stream, write, what)

    # -- copies -------------------------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        handle = _handle(stream)
        D.check_alive()
        D.tick(handle)
        self._use(handle, False, "ndarray.get")
        D.log.append(("copy_d2h", handle, self.nbytes))
        if out is not None:
            out[...] = self._host()
            result = out
        else:
            result = self._host().copy()
        if blocking:
            D.synchronize_stream(handle, "ndarray.get (blocking device-to-host copy)")
        return result

    def set(self, arr, stream=None):
        handle = _handle(stream)
        D.tick(handle)
        self._use(handle, True, "ndarray.set")
        self._host()[...] = arr

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def _scalar(self):
        return self.get().item()

    def __int__(self):
        return int(self._scalar())

    def __float__(self):
        return float(self._scalar())

    def __bool__(self):
        return bool(self._scalar())

    def __index__(self):
        return int(self._scalar())

    def __len__(self):
        return self.shape[0]

    # -- views ----------------------------------------------------------------------------------------
    def _view_of(self, host: np.ndarray, base: np.ndarray) -> ndarray:
        offset = host.__array_interface__["data"][0] - base.__array_interface__["data"][0] if self.size else 0
        mp = MemoryPointer(self.data.mem, self.data.offset + offset) if host.size else MemoryPointer(None, 0)
        return ndarray(host.shape, host.dtype, mp, host.strides)

    def view(self, dtype=None):
        h = self._host()
        return self._view_of(h.view(dtype), h)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        h = self._host()
        if self._contiguous():
            return self._view_of(h.reshape(shape), h)
        return ascontiguousarray(self).reshape(shape)

    def __getitem__(self, key):
        h = self._host()
        v = h[_host_key(key)]
        if isinstance(v, np.ndarray) and (v.size == 0 or np.shares_memory(v, h)):
            return self._view_of(v, h)
        return _new_from_host(np.asarray(v), "ndarray.__getitem__ (a gather)", [self])

    def __setitem__(self, key, value):
        handle = current_stream_handle()
        D.tick(handle)
        if isinstance(value, ndarray):
            value._use(handle, False, "ndarray.__setitem__")
            value = value._host()
        self._use(handle, True, "ndarray.__setitem__")
        self._host()[_host_key(key)] = value

    @property
    def T(self):  # noqa: N802
        h = self._host()
        return self._view_of(h.T, h)

    # -- arithmetic: on the current stream, into a new array ---------------------------------------
    def astype(self, dtype, copy=True):
        return _elementwise(lambda x: x.astype(dtype), self)

    def copy(self):
        return _elementwise(lambda x: x.copy(), self)

    def fill(self, value):
        self[...] = value

    def max(self, axis=None):
        return _elementwise(lambda x: np.asarray(x.max(axis=axis)), self)

    def min(self, axis=None):
        return _elementwise(lambda x: np.asarray(x.min(axis=axis)), self)

    def sum(self, axis=None, dtype=None):
        return _elementwise(lambda x: np.asarray(x.sum(axis=axis, dtype=dtype)), self)

    def any(self):
        return _elementwise(lambda x: np.asarray(x.any()), self)

    def all(self):
        return _elementwise(lambda x: np.asarray(x.all()), self)

    def __repr__(self):
        return f"<model cupy.ndarray shape={self.shape} dtype={self.dtype} ptr=0x{self.data.ptr:x}>"


def _binary(fn):
    def op(self, other):
        return _elementwise(fn, self, other)

    return op


for _name, _fn in {"__add__": np.add, "__radd__": lambda a, b: b + a, "__sub__": np.subtract,
                   "__rsub__": lambda a, b: b - a, "__mul__": np.multiply, "__rmul__": lambda a, b: b * a,
                   "__truediv__": np.true_divide, "__lshift__": np.left_shift, "__rshift__": np.right_shift,
                   "__and__": np.bitwise_and, "__or__": np.bitwise_or, "__lt__": np.less, "__le__": np.less_equal,
                   "__gt__": np.greater, "__ge__": np.greater_equal, "__eq__": np.equal, "__ne__": np.not_equal}.items():
    setattr(ndarray, _name, _binary(_fn))
ndarray.__neg__ = lambda self: _elementwise(np.negative, self)
ndarray.__abs__ = lambda self: _elementwise(np.abs, self)
ndarray.__hash__ = object.__hash__
ndarray.__module__ = "cupy"  # kgen tells libraries apart by their types' module


def _host_key(key):
    if isinstance(key, ndarray):
        return key.get()
    if isinstance(key, tuple):
        return tuple(k.get() if isinstance(k, ndarray) else k for k in key)
    return key


def _new_from_host(host: np.ndarray, what: str, inputs=()) -> ndarray:
    """A new device array holding `host`, written on the current stream."""
    handle = current_stream_handle()
    D.check_alive()
    D.tick(handle)
    for a in inputs:
        a._use(handle, False, what)
    out = ndarray(host.shape, host.dtype)
    out._use(handle, True, what)
    if out.size:
        out._host()[...] = host
    D.log.append(("kernel_op", handle, what))
    return out


def _elementwise(fn, *args) -> ndarray:
    arrays = [a for a in args if isinstance(a, ndarray)]
    host = [a._host() if isinstance(a, ndarray) else a for a in args]
    return _new_from_host(np.asarray(fn(*host)), getattr(fn, "__name__", "elementwise"), arrays)


# ---- module-level array functions -----------------------------------------------------------------
def empty(shape, dtype=float):
    return ndarray(shape if isinstance(shape, tuple | list) else (shape,), dtype)


def zeros(shape, dtype=float):
    return full(shape, 0, dtype)


def full(shape, value, dtype=float):
    a = empty(shape, dtype)
    a.fill(value)
    return a


def asarray(obj, dtype=None, order=None, *, copy=None, blocking=False):
    """CuPy 14's host-to-device path (cupy/_core/core.pyx, _array_default): the host values are
    staged in pinned memory and copied asynchronously on the current stream; `blocking=True` then
    waits for that stream."""
    if isinstance(obj, ndarray):
        return obj if dtype is None or np.dtype(dtype) == obj.dtype else obj.astype(dtype)
    if hasattr(obj, "__cuda_array_interface__"):
        raise TypeError("the model does not take foreign device arrays (torch CUDA tensors) in asarray")
    host = np.ascontiguousarray(np.asarray(obj, dtype=dtype))
    handle = current_stream_handle()
    if host.nbytes:
        alloc_pinned_memory(host.nbytes)  # the staging buffer, kept until the copy's event has passed
    D.log.append(("copy_h2d", handle, host.nbytes))
    out = _new_from_host(host, "asarray (host-to-device copy)")
    if blocking:
        D.synchronize_stream(handle, "asarray(blocking=True)")
    return out


array = asarray


def ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray) and a._contiguous() and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _elementwise(lambda x: np.ascontiguousarray(x, dtype=dtype), a)


def from_dlpack(obj):
    if isinstance(obj, ndarray):
        return obj
    raise TypeError(f"the model's from_dlpack takes model arrays only, got {type(obj).__name__}")


def get_array_module(*args):
    return sys.modules[__name__]


abs = lambda a: _elementwise(np.abs, a)  # noqa: E731, A001
where = lambda c, a, b: _elementwise(np.where, c, a, b)  # noqa: E731
isneginf = lambda a: _elementwise(np.isneginf, a)  # noqa: E731
isnan = lambda a: _elementwise(np.isnan, a)  # noqa: E731
clip = lambda a, lo, hi: _elementwise(np.clip, a, lo, hi)  # noqa: E731
maximum = lambda a, b: _elementwise(np.maximum, a, b)  # noqa: E731
minimum = lambda a, b: _elementwise(np.minimum, a, b)  # noqa: E731

for _t in ("bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
           "float64"):
    globals()[_t] = getattr(np, _t)
dtype = np.dtype


class _Pool:
    """cupy.get_default_memory_pool(): freed blocks stay cached until free_all_blocks()."""

    def used_bytes(self) -> int:
        return D.allocated_bytes

    def total_bytes(self) -> int:
        return D.allocated_bytes + D.pool_cached_bytes

    def free_all_blocks(self, stream=None) -> None:
        D.release_pool()


def get_default_memory_pool():
    return _Pool()


class _PinnedPool:
    def free_all_blocks(self) -> None:
        pass


def get_default_pinned_memory_pool():
    return _PinnedPool()


# ---- kernels --------------------------------------------------------------------------------------
_PARAMS = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S)
_BY_VALUE_BYTES = {"p": 8, "i1": 1, "u1": 1, "i2": 2, "u2": 2, "i4": 4, "u4": 4, "i8": 8, "u8": 8, "f4": 4, "f8": 8}


def _const_pointers(source: str, kernel: str) -> list[bool] | None:
    """For each parameter of `kernel` in `source`: True for a pointer to const (read only)."""
    for m in _PARAMS.finditer(source):
        if m.group(1) == kernel:
            params = [p.strip() for p in m.group(2).split(",") if p.strip()]
            return [p.startswith("const") and "*" in p and "* const" not in p.split("*", 1)[1][:7] for p in params]
    return None


class Module:
    """cupy.RawModule(path=...): the cubin's kernels; bodies built for the CPU backend from its source."""

    _cache: dict[str, Module] = {}

    def __new__(cls, code=None, *, path=None, options=(), **kwargs):
        if path is None:
            raise NotImplementedError("the model loads modules from cubin paths only")
        key = str(path)
        if key in cls._cache:  # CuPy keeps a module per path: a rewritten file is not reloaded
            return cls._cache[key]
        self = super().__new__(cls)
        D.check_alive()
        self.path = Path(path)
        self.cubin = self.path.read_bytes()
        self.source = source_for(self.path)
        self._cpu = None
        cls._cache[key] = self
        return self

    def get_function(self, name: str) -> Function:
        if f".text.{name}" not in _section_names(self.cubin):
            raise CUDARuntimeError("CUDA_ERROR_NOT_FOUND", f"named symbol not found: {name}")
        return Function(self, name)

    def cpu(self):
        if self._cpu is None:
            from kgen.runtime.cpu import CpuModule

            names = [m.group(1) for m in _PARAMS.finditer(self.source)]
            self._cpu = CpuModule.from_source(self.source, names)
        return self._cpu


def _section_names(cubin: bytes) -> set[str]:
    from strict_cuda.cubin import section_sizes

    return set(section_sizes(cubin))


class Function:
    def __init__(self, module: Module, name: str):
        self.module, self.name = module, name
        self.shared_size_bytes = static_smem(module.cubin, name)
        self._max_dynamic = D.limits.smem_default - self.shared_size_bytes
        self.num_regs = 0

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        D.check_alive()
        if value < 0 or self.shared_size_bytes + value > D.limits.smem_optin:
            raise CUDARuntimeError("CUDA_ERROR_INVALID_VALUE", f"{self.name}: {value} bytes of dynamic shared memory "
                                   f"with {self.shared_size_bytes} static exceeds the opt-in limit {D.limits.smem_optin}")
        self._max_dynamic = int(value)

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False):
        D.check_alive()
        grid, block = _dim3(grid), _dim3(block)
        handle = _handle(stream)
        what = f"launch of {self.name}"
        packed = [_pack(a) for a in args]  # TypeError as CuPy's packing raises it
        if D.streams[handle].device != D.current_device:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle", f"{what}: stream {handle:#x} belongs to device "
                                   f"{D.streams[handle].device}, the current device is {D.current_device}")
        lim = D.limits
        if any(b < 1 for b in block) or any(b > m for b, m in zip(block, lim.max_block, strict=True)) \
                or block[0] * block[1] * block[2] > lim.max_threads_per_block:
            raise CUDARuntimeError("CUDA_ERROR_INVALID_VALUE", f"{what}: block {block}")
        if any(g > m for g, m in zip(grid, lim.max_grid, strict=True)):
            raise CUDARuntimeError("CUDA_ERROR_INVALID_VALUE", f"{what}: grid {grid} exceeds {lim.max_grid}")
        if shared_mem > self._max_dynamic:
            raise CUDARuntimeError("CUDA_ERROR_INVALID_VALUE", f"{what}: {shared_mem} bytes of dynamic shared memory "
                                   f"(+ {self.shared_size_bytes} static) without the opt-in "
                                   f"(max_dynamic_shared_size_bytes = {self._max_dynamic})")
        if handle in D.captures:  # recorded with the values it was given: pointers are not looked at until a replay
            values = [np.uint64(v) if kind == "pointer" else v for kind, v, _ in packed]
            D.captures[handle].nodes.append((self, grid, block, values, int(shared_mem)))
            D.log.append(("captured_launch", handle, self.name))
            return
        sig = self.module.cpu().signature(self.name)
        if len(packed) != len(sig):
            D.fault(f"{what}: {len(packed)} arguments for {len(sig)} parameters")
            return
        for i, ((kind, value, nbytes), code) in enumerate(zip(packed, sig, strict=True)):
            want = _BY_VALUE_BYTES.get(code, int(code[1:]) if code[1:].isdigit() else 0)
            if kind != "pointer" and nbytes != want:
                D.violate(f"{what}: argument {i} is packed as {nbytes} bytes ({type(value).__name__}) for a "
                          f"{want}-byte parameter ({code})")
        if 0 in grid:  # CuPy launches a grid of 0 as one block: the kernel reads the empty batch's arrays
            D.fault(f"{what}: grid {grid} has a 0 (CuPy launches it as one block)")
            return
        const = _const_pointers(self.module.source, self.name) or [False] * len(sig)
        D.tick(handle)
        cpu_args = []
        for i, ((_, value, _), code) in enumerate(zip(packed, sig, strict=True)):
            if code == "p":
                ptr = int(value) if value is not None else 0
                if ptr:
                    alloc = D.find(ptr)
                    if alloc is None or alloc.device != D.current_device:
                        where = "in no live allocation" if alloc is None else f"on device {alloc.device}"
                        D.fault(f"{what}: argument {i} = 0x{ptr:x} is {where} (launch on device "
                                f"{D.current_device})")
                        return  # the launch returns; the fault surfaces at the next CUDA call
                    D.access(alloc, handle, not const[i], f"{what} argument {i}")
                cpu_args.append(ptr)
            else:
                cpu_args.append(value)
        D.launches.append(LaunchRecord(self.name, grid, block, int(shared_mem), handle, D.current_device))
        D.log.append(("launch", handle, self.name))
        from kgen.errors import KgenError
        from kgen.runtime.base import Launch

        try:
            self.module.cpu().launch(Launch(self.name, grid, block, int(shared_mem), cpu_args))
        except KgenError as e:  # a trap or fault in the body: sticky, seen at the next call
            D.fault(f"{what}: {e}")


def _dim3(v) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int | np.integer) else tuple(v)
    return tuple(int(x) for x in (*t, 1, 1)[:3])  # type: ignore[return-value]


def _pack(a) -> tuple[str, Any, int]:
    """(kind, value, packed bytes) as CuPy's kernel-argument packing takes `a`."""
    if a is None:
        return "pointer", 0, 8
    if isinstance(a, ndarray):
        return "pointer", a.data.ptr, 8
    if isinstance(a, MemoryPointer):
        return "pointer", a.ptr, 8
    if isinstance(a, np.generic) and a.dtype.kind in "biuf":
        return ("pointer" if a.dtype == np.uint64 else "value"), a, a.dtype.itemsize
    if isinstance(a, bool):
        return "value", np.bool_(a), 1
    if isinstance(a, int):
        return "value", np.int64(a), 8
    if isinstance(a, float):
        return "value", np.float64(a), 8
    raise TypeError(f"Unsupported type {type(a)}")


# ---- streams, events, devices ----------------------------------------------------------------------
_current = threading.local()


def current_stream_handle() -> int:
    stack = getattr(_current, "streams", None)
    return stack[-1].ptr if stack else D.legacy_stream()


def _handle(stream) -> int:
    return current_stream_handle() if stream is None else stream.ptr


class Stream:
    def __init__(self, null=False, non_blocking=False, ptr=None):
        D.check_alive()
        self.ptr = D.legacy_stream() if null else D.new_stream(non_blocking, ptr)
        self.device_id = D.streams[self.ptr].device

    def __enter__(self):
        _current.streams = [*getattr(_current, "streams", []), self]
        return self

    def __exit__(self, *exc):
        _current.streams = _current.streams[:-1]

    def use(self):
        _current.streams = [*getattr(_current, "streams", [])[:-1], self] if getattr(_current, "streams", None) \
            else [self]
        return self

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        D.wait_event(self.ptr, event.clock)

    def synchronize(self):
        D.synchronize_stream(self.ptr, "Stream.synchronize")

    def begin_capture(self, mode=None):
        """CuPy's default mode is relaxed; torch.cuda.graph captures in global mode."""
        D.begin_capture(self.ptr, CAPTURE_MODES[2 if mode is None else int(mode)])

    def end_capture(self) -> Graph:
        return Graph(D.end_capture(self.ptr))

    def is_capturing(self) -> bool:
        return self.ptr in D.captures

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self):
        return hash(self.ptr)


class ExternalStream(Stream):
    """A stream made elsewhere (torch's): the model takes it as non-blocking, as torch's are."""

    def __init__(self, ptr, device_id=-1):
        D.check_alive()
        self.ptr = int(ptr) if int(ptr) != 0 else D.legacy_stream()
        if self.ptr not in D.streams:
            D.new_stream(True, self.ptr)
        self.device_id = D.streams[self.ptr].device


class Graph:
    """cupy.cuda.Graph: the launches captured on a stream, replayed with the argument values they
    had at capture (pointers included)."""

    def __init__(self, capture):
        self._nodes = list(capture.nodes)

    def launch(self, stream=None):
        D.log.append(("graph_launch", _handle(stream), len(self._nodes)))
        for function, grid, block, args, shared_mem in self._nodes:
            function(grid, block, args, shared_mem=shared_mem, stream=stream)

    def upload(self, stream=None):
        pass


def get_current_stream(device_id=None):
    stack = getattr(_current, "streams", None)
    return stack[-1] if stack else Stream(null=True)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.clock: dict[int, int] = {}
        self.stream = None
        self.when = None

    def record(self, stream=None):
        stream = stream or get_current_stream()
        self.clock = D.record_event(stream.ptr)
        self.stream = stream.ptr
        self.captured = stream.ptr in D.captures  # a node of the graph being captured
        self.when = time.perf_counter()
        D.log.append(("event", stream.ptr, id(self)))

    def synchronize(self):
        D.host_wait(self.clock, "Event.synchronize", waits_on=self.stream if self.captured else None)

    @property
    def done(self) -> bool:
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    return (end.when - start.when) * 1e3


def alloc_pinned_memory(size: int):
    D.log.append(("pinned_alloc", None, size))
    return bytearray(size)


class Device:
    def __init__(self, device=None):
        self.id = D.current_device if device is None else int(device)
        if not 0 <= self.id < D.device_count:
            raise CUDARuntimeError("cudaErrorInvalidDevice", f"invalid device ordinal {self.id}")
        self._saved: list[int] = []

    @property
    def compute_capability(self) -> str:
        return D.limits.compute_capability

    @property
    def attributes(self) -> dict:
        lim = D.limits
        return {"MultiProcessorCount": lim.sm_count, "L2CacheSize": lim.l2_bytes,
                "MaxSharedMemoryPerBlockOptin": lim.smem_optin, "MaxThreadsPerBlock": lim.max_threads_per_block}

    def use(self):
        D.current_device = self.id

    def synchronize(self):
        D.synchronize_device("Device.synchronize")

    def __enter__(self):
        self._saved.append(D.current_device)
        D.current_device = self.id
        return self

    def __exit__(self, *exc):
        D.current_device = self._saved.pop()

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)


_ipc_mappings: dict[int, tuple] = {}  # the importing side's address -> (its allocation, the exporter's)


def cu_mem_get_address_range(p_base, p_size, ptr) -> int:
    """libcuda's cuMemGetAddressRange_v2 as kgen calls it through ctypes (by reference)."""
    alloc = D.find(int(ptr.value))
    if alloc is None or alloc.device != D.current_device:
        return 1  # CUDA_ERROR_INVALID_VALUE
    p_base._obj.value, p_size._obj.value = alloc.base, alloc.size
    return 0


def _runtime_module() -> types.ModuleType:
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.CUDARuntimeError = CUDARuntimeError

    def get_device_count():
        D.check_alive()
        return D.device_count

    def get_device():
        return D.current_device

    def set_device(i):
        Device(i).use()

    def device_synchronize():
        D.synchronize_device()

    def ipc_get_mem_handle(ptr):
        D.check_alive()
        alloc = D.find(int(ptr))
        if alloc is None or alloc.base != int(ptr):
            raise CUDARuntimeError("cudaErrorInvalidValue", f"ipcGetMemHandle: 0x{int(ptr):x} is not the base of a "
                                   "device allocation")
        D.log.append(("ipc_get", None, alloc.base))
        return alloc.base.to_bytes(8, "little") + bytes(56)  # cudaIpcMemHandle_t is 64 opaque bytes

    def ipc_open_mem_handle(handle, flags=1):
        """The other process's mapping: an address of its own (never the exporter's), holding the same
        bytes. The model copies them in here and back at the close; the exporter waits meanwhile."""
        D.check_alive()
        source = D.allocations.get(int.from_bytes(bytes(handle)[:8], "little"))
        if source is None or not source.live:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle", "ipcOpenMemHandle: no such allocation")
        mapping = D.malloc(source.size, D.legacy_stream())
        mapping.buffer[...] = source.buffer
        _ipc_mappings[mapping.base] = (mapping, source)
        return mapping.base

    def ipc_close_mem_handle(ptr):
        mapping, source = _ipc_mappings.pop(int(ptr))
        if source.live:
            source.buffer[...] = mapping.buffer
        D.free(mapping)
        D.pool_cached_bytes -= mapping.size  # a mapping is not the pool's

    def device_get_by_pci_bus_id(bus_id):
        for i in range(D.device_count):
            if rt.deviceGetPCIBusId(i) == bus_id:
                return i
        raise CUDARuntimeError("cudaErrorInvalidDevice", f"no device with PCI bus id {bus_id}")

    rt.getDeviceCount, rt.getDevice, rt.setDevice = get_device_count, get_device, set_device
    rt.deviceSynchronize, rt.ipcGetMemHandle = device_synchronize, ipc_get_mem_handle
    rt.ipcOpenMemHandle, rt.ipcCloseMemHandle = ipc_open_mem_handle, ipc_close_mem_handle
    rt.deviceGetByPCIBusId = device_get_by_pci_bus_id
    rt.streamCaptureModeGlobal, rt.streamCaptureModeThreadLocal, rt.streamCaptureModeRelaxed = 0, 1, 2
    rt.deviceGetPCIBusId = lambda i: f"0000:{0x10 + i:02x}:00.0"
    rt.driverGetVersion = lambda: 13000
    rt.runtimeGetVersion = lambda: 13000
    rt.getDeviceProperties = lambda i: {"name": b"strict model of an sm_90 GPU", "multiProcessorCount": D.limits.sm_count,
                                        "totalGlobalMem": 141 << 30, "major": 9, "minor": 0,
                                        "l2CacheSize": D.limits.l2_bytes}
    return rt


def build_module(driver: Driver) -> types.ModuleType:
    """The `cupy` module object: this file's names, with `cupy.cuda` and `cupy.cuda.runtime`."""
    global D
    D = driver
    Module._cache.clear()
    me = sys.modules[__name__]
    cupy = types.ModuleType("cupy")
    for name in ("ndarray", "empty", "zeros", "full", "asarray", "array", "ascontiguousarray", "from_dlpack", "abs",
                 "where", "isneginf", "isnan", "clip", "maximum", "minimum", "dtype", "get_default_memory_pool",
                 "get_default_pinned_memory_pool", "get_array_module", "bool_", "int8", "uint8", "int16", "uint16",
                 "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"):
        setattr(cupy, name, getattr(me, name))
    cupy.RawModule = Module
    cupy.__version__ = "14.2.0 (strict model)"
    cuda = types.ModuleType("cupy.cuda")
    for name in ("Stream", "ExternalStream", "Event", "Graph", "Device", "MemoryPointer", "get_current_stream",
                 "get_elapsed_time", "alloc_pinned_memory"):
        setattr(cuda, name, getattr(me, name))
    cuda.Stream.null = None  # filled lazily by get_current_stream(); kgen does not read it
    cuda.runtime = _runtime_module()
    cuda.memory = types.SimpleNamespace(MemoryPointer=MemoryPointer, Memory=Memory)
    cupy.cuda = cuda
    return cupy
