"""A strict model of the CUDA driver and of the parts of CuPy that kgen calls, for testing kgen's
CUDA host paths without a GPU (docs/testing.md says what it enforces and where it may differ from a
real driver). `install(monkeypatch)` makes `import cupy` return the model for the rest of the test and
returns its Driver, whose records (launches, syncs, log, violations, peak_bytes) the test reads."""

from __future__ import annotations

import sys

from strict_cuda.driver import CUDARuntimeError, Driver, Limits, ModelViolation

__all__ = ["CUDARuntimeError", "Driver", "Limits", "ModelViolation", "install", "uninstall"]


def install(monkeypatch, device_count: int = 1, limits: Limits | None = None) -> Driver:
    from kgen.runtime import cuda as kgen_cuda
    from strict_cuda import fake_cupy

    driver = Driver(device_count, limits)
    cupy = fake_cupy.build_module(driver)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", cupy.cuda.runtime)
    # libcuda's cuMemGetAddressRange, which kgen reaches through ctypes rather than CuPy
    monkeypatch.setattr(kgen_cuda, "_address_range", lambda: fake_cupy.cu_mem_get_address_range)
    kgen_cuda._gpu_problem.cache_clear()  # kgen probes the GPU once per process: now the model's
    return driver


def uninstall() -> None:
    """After the test (monkeypatch puts CuPy back): kgen probes the real GPU again."""
    from kgen.runtime import cuda as kgen_cuda

    kgen_cuda._gpu_problem.cache_clear()
