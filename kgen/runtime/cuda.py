"""CUDA backend: load a cubin with CuPy and launch its kernels."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kgen.errors import KernelRuntimeError, KgenUserError, ToolchainError
from kgen.runtime.base import Launch

STATIC_SMEM_LIMIT = 48 * 1024


def cupy_module():
    """CuPy, or a ToolchainError that says how to install it."""
    try:
        import cupy
    except Exception as e:  # ImportError, or CuPy failing to load its CUDA libraries
        raise ToolchainError(f"CuPy is not usable ({e}); install kgen's dependencies (cupy-cuda13x)") from e
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


def require_gpu() -> None:
    """Refuse the CUDA backend, with CuPy's reason and the way out, where no GPU is usable."""
    problem = _gpu_problem()
    if problem is not None:
        raise KgenUserError(f"--backend cuda: no usable CUDA GPU (CuPy reports: {problem}); "
                            "use --backend cpu or auto")


def device_arch() -> str:
    """The current GPU's arch, e.g. "sm_90" (KgenUserError where there is none)."""
    require_gpu()
    return "sm_" + cupy_module().cuda.Device().compute_capability


class CudaModule:
    backend = "cuda"

    def __init__(self, cubin_path: Path, kernel_names: list[str]):
        require_gpu()
        self._module = cupy_module().RawModule(path=str(cubin_path))
        self._functions = {name: self._module.get_function(name) for name in kernel_names}

    def launch(self, launch: Launch) -> None:
        fn = self._functions[launch.kernel]
        if launch.smem > STATIC_SMEM_LIMIT and fn.max_dynamic_shared_size_bytes < launch.smem:
            fn.max_dynamic_shared_size_bytes = launch.smem  # opt in to > 48 KiB of dynamic smem
        try:
            fn(launch.grid, launch.block, tuple(launch.args), shared_mem=launch.smem)
        except Exception as e:
            raise KernelRuntimeError(f"launch of {launch.kernel} failed: {e}") from e
