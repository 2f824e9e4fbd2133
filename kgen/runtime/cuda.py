"""CUDA backend: load a cubin with CuPy and launch its kernels (in this process, or, for untrusted
kernels, in a child process: IsolatedCudaModule)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kgen.cache import ArtifactCache
from kgen.compile import cuda_line
from kgen.errors import (
    ArgumentError,
    KernelRuntimeError,
    KgenUserError,
    ToolchainError,
    UnsupportedError,
)
from kgen.optional import module_of
from kgen.plan.arch import limits_for
from kgen.runtime.base import DeviceAddress, Launch, check_kernel
from kgen.runtime.cpu import _dims
from kgen.runtime.isolated import Child, ChildModule, Limits
from kgen.settings import child_environment


def cupy_module():
    """CuPy, or a ToolchainError that says how to install it."""
    try:
        import cupy
    except Exception as e:  # ImportError, or CuPy failing to load its CUDA libraries
        raise ToolchainError(f"CuPy is not usable ({e}); install a CUDA line: {cuda_line.install_hint()}") from e
    return cupy


@lru_cache(maxsize=1)
def _gpu_problem() -> str | None:
    """Why CuPy cannot use a GPU here (its own words), or None when it sees at least one."""
    try:
        count = cupy_module().cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError (no driver, driver too old, no device), ToolchainError
        return str(e) or type(e).__name__
    return None if count > 0 else "no CUDA device is visible"


def gpu_available() -> bool:
    """True when CuPy sees at least one CUDA device (never raises; probed once per process)."""
    return _gpu_problem() is None


def gpu_diagnosis() -> str:
    """Why no GPU is usable here, with the versions that decide it: CuPy's words, CuPy's version,
    the CUDA runtime it carries and the driver's CUDA version (0: no driver)."""
    problem = _gpu_problem() or "a GPU is visible"
    try:
        cupy = cupy_module()
    except ToolchainError as e:
        return f"CuPy cannot be imported ({e})"
    facts = [f"CuPy reports: {problem}", f"CuPy {cupy.__version__}"]
    driver = None
    for what, call in (("its CUDA runtime", "runtimeGetVersion"), ("the driver supports CUDA", "driverGetVersion")):
        try:
            version = int(getattr(cupy.cuda.runtime, call)())
            facts.append(f"{what} {version // 1000}.{version % 1000 // 10}" if version else f"{what}: none (no driver)")
            driver = cuda_line.parse_driver_version(version) if call == "driverGetVersion" else driver
        except Exception as e:  # a runtime that cannot load at all
            facts.append(f"{what}: unknown ({e})")
    line = cuda_line.current()
    if line.line is not None:
        facts.append(f"kgen's CUDA line: {line.line.name} (NVRTC {cuda_line.show(line.nvrtc)})")
    facts += [*line.problems, *filter(None, [line.nvrtc and cuda_line.mismatch(line.nvrtc, driver)])]
    return "; ".join(facts)


def require_gpu() -> None:
    """Refuse the CUDA backend, with CuPy's reason and the way out, where no GPU is usable."""
    problem = _gpu_problem()
    if problem is not None:
        raise KgenUserError(f"--backend cuda: no usable CUDA GPU (CuPy reports: {problem}); "
                            "use --backend cpu or auto")


def is_device_error(error: BaseException) -> bool:
    """True for an error CUDA reported through CuPy (a runtime or driver call failing, e.g. the
    illegal address a faulting kernel leaves for the next call)."""
    try:
        cuda = cupy_module().cuda
    except ToolchainError:
        return False
    kinds = tuple(k for k in (getattr(cuda.runtime, "CUDARuntimeError", None),
                              getattr(getattr(cuda, "driver", None), "CUDADriverError", None)) if isinstance(k, type))
    return bool(kinds) and isinstance(error, kinds)


def release_device_memory() -> None:
    """Return the memory CuPy's pool holds but no array uses to the GPU (after verification, whose
    case pools would otherwise stay cached for the life of the process)."""
    try:
        cupy_module().get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001 (a lost context refuses this too; nothing more to free then)
        pass


def device_sm_count() -> int:
    """Streaming multiprocessors of the current GPU."""
    return int(cupy_module().cuda.Device().attributes["MultiProcessorCount"])


def device_arch() -> str:
    """The current GPU's arch, e.g. "sm_90" (KgenUserError where there is none)."""
    require_gpu()
    return "sm_" + cupy_module().cuda.Device().compute_capability


def loaded_cubin(cache: ArtifactCache, cubin: bytes, source: str) -> Path:
    """A file holding the cubin for CuPy to load, named by its hash: CuPy keeps one module per path,
    so a changed cubin must have a new path. Its source lies beside it (`<hash>.cu`), for tools that
    map a fault back to it."""
    digest = hashlib.sha256(cubin).hexdigest()
    cache.put_file("loaded", f"{digest}.cu", source.encode())
    return cache.put_file("loaded", f"{digest}.cubin", cubin)


class CudaModule:
    backend = "cuda"

    def __init__(self, cubin_path: Path, kernel_names: list[str]):
        require_gpu()
        # A cubin from a newer CUDA major than the driver's is refused here, naming both versions and
        # the line to install, rather than by the load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
        cuda_line.require_loadable()
        cupy = cupy_module()
        self.device = int(cupy.cuda.runtime.getDevice())  # the module's functions run on this device
        self._module = cupy.RawModule(path=str(cubin_path))
        self._functions = {name: self._module.get_function(name) for name in kernel_names}
        self.arch = device_arch()
        self._limits = limits_for(self.arch)

    def launch(self, launch: Launch) -> None:
        """On the current device's current CuPy stream (kgen.runtime.placement chose both)."""
        fn = self._functions[launch.kernel]
        grid, block = _dims(launch.grid, "grid"), _dims(launch.block, "block")
        check_grid(launch.kernel, grid)
        if int(fn.shared_size_bytes) + launch.smem > self._limits.dynamic_smem_default \
                and fn.max_dynamic_shared_size_bytes < launch.smem:
            opt_in_dynamic_smem(fn, launch, self.arch)
        args = tuple(packable(launch.kernel, i, a) for i, a in enumerate(launch.args))
        try:
            fn(grid, block, args, shared_mem=launch.smem)
        except Exception as e:
            raise KernelRuntimeError(f"launch of {launch.kernel} failed: {e}") from e


MAX_GRID = (2**31 - 1, 65535, 65535)  # every arch kgen targets (CUDA Programming Guide, Table 21)


def check_grid(kernel: str, grid: tuple[int, int, int]) -> None:
    """A grid the driver would refuse, as an error naming the kernel and the axis (cuLaunchKernel
    says only "invalid argument")."""
    for axis, (g, most) in enumerate(zip(grid, MAX_GRID, strict=True)):
        if g > most:
            raise KernelRuntimeError(f"launch of {kernel}: grid {grid} has {g} blocks on axis {'xyz'[axis]}; "
                                     f"a GPU takes at most {most} there (a batch this large must be split)")


def packable(kernel: str, index: int, value: Any) -> Any:
    """`value` as CuPy's argument packing takes it: a device array that is not CuPy's (a torch CUDA
    tensor) becomes its address as np.uint64 (CuPy refuses such objects); the caller keeps the
    array alive for the launch."""
    if isinstance(value, np.uint64):
        return np.uint64(value)  # a DeviceAddress as the plain numpy type CuPy packs
    if value is None or isinstance(value, np.generic | bool | int | float) or module_of(value) == "cupy":
        return value
    if hasattr(value, "__cuda_array_interface__"):
        return np.uint64(value.__cuda_array_interface__["data"][0])
    raise ArgumentError(f"kernel '{kernel}' argument {index}: a {type(value).__name__}; kgen's CUDA launcher "
                        "passes device arrays, device addresses (np.uint64) and numpy scalars")


POINTER_BYTES = 8  # a device address (sm_80 and newer are 64-bit only)


def argument_layout(value: Any) -> tuple[int, int]:
    """(bytes, alignment) of one launch argument as CudaModule hands it to CuPy, which passes the
    driver a pointer to a value of that size: a device array (CuPy's, or another library's, which
    `packable` turns into its address) or None as a device address; a numpy scalar (kgen's
    by-value parameters, and np.uint64 device addresses) as its dtype; a Python int, float or bool
    as CuPy converts it (int64, float64, bool)."""
    if value is None or hasattr(value, "__cuda_array_interface__"):
        return POINTER_BYTES, POINTER_BYTES
    if isinstance(value, np.generic):
        return value.dtype.itemsize, value.dtype.alignment
    if isinstance(value, bool | int | float):
        dt = np.dtype({bool: np.bool_, int: np.int64, float: np.float64}[type(value)])
        return dt.itemsize, dt.alignment
    raise ArgumentError(f"a launch argument of type {type(value).__name__}: kgen's CUDA launcher passes device "
                        "arrays, device addresses (np.uint64) and numpy scalars")


def opt_in_dynamic_smem(fn, launch: Launch, arch: str) -> None:
    """Let `fn` take the launch's dynamic shared memory where static + dynamic pass the default
    (48 KiB): the opt-in attribute, up to the arch's limit of static + dynamic (kgen/plan/arch.py);
    past it a clear error instead of CUDA's "invalid argument"."""
    limit = limits_for(arch).smem_per_block
    static = int(fn.shared_size_bytes)  # the driver counts static + dynamic against the default
    if static + launch.smem > limit:
        raise KernelRuntimeError(f"launch of {launch.kernel}: {static} + {launch.smem} bytes of shared memory "
                                 f"(static + dynamic) > {limit}, the opt-in limit of {arch}")
    fn.max_dynamic_shared_size_bytes = launch.smem


# ---- untrusted kernels: every launch in a child process (kgen/runtime/_isolated_cuda_child.py) ----

CUDA_CHILD = Path(__file__).with_name("_isolated_cuda_child.py")
# A GPU runs a launch in milliseconds: a generous floor, little per thread and per byte.
CUDA_LIMITS = Limits(floor_s=10.0, thread_s=1e-6, byte_s=1e-9, startup_s=120.0)


@lru_cache(maxsize=1)
def _address_range() -> Callable[..., int]:
    """cuMemGetAddressRange from the driver CuPy already loaded (CuPy does not wrap it)."""
    fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    return fn


def device_allocation(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation holding `ptr` in the current context, None if none does."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if _address_range()(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return base.value, size.value


def encode_cuda_args(kernel: str, args: Sequence[Any],
                     allocation: Callable[[int], tuple[int, int] | None]) -> tuple[list, list[tuple[int, int]]]:
    """The launch's arguments for the child, and the allocations (base, size) they point into.

    A device pointer (a CuPy array, or an np.uint64 that lies in a device allocation, as kgen's
    bindings pass them) becomes (allocation index, offset): the child opens the allocation's IPC
    handle and adds the offset, so views and strides survive. Other numpy scalars travel as their
    bytes and dtype, Python scalars as themselves (the child hands them to CuPy as the caller did).
    """
    encoded: list = []
    allocations: list[tuple[int, int]] = []
    for i, a in enumerate(args):
        ptr = None
        if hasattr(a, "__cuda_array_interface__") and hasattr(a, "data") and hasattr(a.data, "ptr"):
            ptr = int(a.data.ptr)
        elif isinstance(a, np.uint64):
            ptr = int(a)
        if ptr == 0:
            encoded.append(["null"])
            continue
        found = allocation(ptr) if ptr is not None else None
        if found is not None:
            if found not in allocations:
                allocations.append(found)
            encoded.append(["p", allocations.index(found), ptr - found[0]])
        elif ptr is not None and not isinstance(a, np.uint64):
            raise ArgumentError(f"kernel '{kernel}' argument {i}: a CuPy array whose memory CUDA does not know")
        elif isinstance(a, DeviceAddress):  # kgen's own pointer argument: it must name device memory
            raise ArgumentError(f"kernel '{kernel}' argument {i}: device address 0x{ptr:x} lies in no allocation "
                                "of the current CUDA device (an array on another device, or freed memory)")
        elif isinstance(a, np.generic):
            encoded.append(["np", a.dtype.str, a.tobytes().hex()])
        elif isinstance(a, bool | int | float):
            encoded.append(["py", a])
        else:
            raise ArgumentError(f"kernel '{kernel}' argument {i}: expected a CuPy array, a device address "
                                f"(np.uint64) or a scalar, got {type(a).__name__}")
    return encoded, allocations


def _device_pointer(a: Any) -> int:
    """The device address of a CuPy array or a torch CUDA tensor."""
    return int(a.data_ptr()) if hasattr(a, "data_ptr") else int(a.data.ptr)


class IsolatedCudaModule(ChildModule):
    """CudaModule's twin for untrusted kernels: each launch runs in a child process that owns its CUDA
    context (a fault poisons that context only) and reaches the caller's arrays through CUDA IPC."""

    backend = "cuda"

    def __init__(self, cubin_path: Path, kernel_names: list[str], limits: Limits | None = None):
        require_gpu()
        cupy = cupy_module()
        self.kernel_names = list(kernel_names)
        self.limits = limits or CUDA_LIMITS
        self._device = cupy.cuda.runtime.getDevice()
        bus_id = cupy.cuda.runtime.deviceGetPCIBusId(self._device)
        # The child starts in a scratch directory, with -I and an empty environment: it gets the cubin's
        # absolute path, this process's import path (CuPy installed with --user or on PYTHONPATH) and
        # LD_LIBRARY_PATH (where libcuda may be found).
        paths = [p for p in sys.path if p and os.path.isabs(p)]
        env = {k: v for k, v in child_environment().items() if k == "LD_LIBRARY_PATH"}
        super().__init__(Child(CUDA_CHILD, [str(Path(cubin_path).resolve()), ",".join(self.kernel_names), bus_id,
                                            os.pathsep.join(paths)],
                               python_flags=("-I", "-B"), startup_s=self.limits.startup_s, env=env,
                               start_failure=ToolchainError))

    def launch(self, launch: Launch) -> None:
        check_kernel(launch.kernel, self.kernel_names)
        runtime = cupy_module().cuda.runtime
        with self._lock:
            runtime.setDevice(self._device)  # the context whose allocations the pointers name
            args, allocations = encode_cuda_args(launch.kernel, launch.args, device_allocation)
            # IPC opens an allocation wherever the driver likes: an address into an argument's allocation
            # is translated, but one stored in a table (copy_blocks) would name nothing in the child.
            _, reached = encode_cuda_args(launch.kernel, [np.uint64(_device_pointer(a)) for a in launch.reached],
                                          device_allocation)
            if not set(reached) <= set(allocations):
                raise UnsupportedError(f"kernel '{launch.kernel}': an isolated CUDA launch cannot follow a pointer "
                                       "table (copy_blocks); verify this kernel with --backend cpu")
            self._child.start(f"kernel '{launch.kernel}'")
            try:
                handles = [bytes(runtime.ipcGetMemHandle(base)).hex() for base, _ in allocations]
            except runtime.CUDARuntimeError as e:  # e.g. memory of a stream-ordered (async) allocator
                raise ToolchainError(f"kernel '{launch.kernel}': its arrays cannot be shared with the isolated "
                                     f"process through CUDA IPC ({e}); allocate them with cudaMalloc "
                                     "(CuPy's default memory pool)") from e
            grid, block = _dims(launch.grid, "grid"), _dims(launch.block, "block")
            timeout = self.limits.wall_seconds(grid, block, sum(size for _, size in allocations))
            runtime.deviceSynchronize()  # what this process queued for the inputs has landed
            request = {"op": "launch", "kernel": launch.kernel, "grid": grid, "block": block,
                       "smem": int(launch.smem), "args": args, "handles": handles,
                       "cpu_seconds": int(timeout) + 1}
            reply = self._child.request(request, (), timeout, f"kernel '{launch.kernel}'",
                                        f" (limit: {timeout:.1f} s)")
            if "ok" not in reply:
                if reply.get("fatal"):
                    self._child.stop()
                raise KernelRuntimeError(f"launch of {launch.kernel} failed: {str(reply.get('error', reply))[:4000]}")
