"""CUDA backend: load a cubin with CuPy and launch its kernels."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kgen.errors import KernelRuntimeError, ToolchainError
from kgen.runtime.base import Launch

STATIC_SMEM_LIMIT = 48 * 1024


@lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def device_arch() -> str:
    import cupy

    return "sm_" + cupy.cuda.Device().compute_capability  # e.g. "90"


class CudaModule:
    backend = "cuda"

    def __init__(self, cubin_path: Path, kernel_names: list[str]):
        try:
            import cupy
        except Exception as e:
            raise ToolchainError(f"CuPy is not usable: {e}") from e
        self._module = cupy.RawModule(path=str(cubin_path))
        self._functions = {name: self._module.get_function(name) for name in kernel_names}

    def launch(self, launch: Launch) -> None:
        fn = self._functions[launch.kernel]
        if launch.smem > STATIC_SMEM_LIMIT and fn.max_dynamic_shared_size_bytes < launch.smem:
            fn.max_dynamic_shared_size_bytes = launch.smem  # opt in to > 48 KiB of dynamic smem
        try:
            fn(launch.grid, launch.block, tuple(launch.args), shared_mem=launch.smem)
        except Exception as e:
            raise KernelRuntimeError(f"launch of {launch.kernel} failed: {e}") from e
