"""kgen.runtime.placement: the one seam every call's launches go through (direct calls, the torch
ops, the vLLM plugin). With the strict CUDA model standing in for CuPy and a stand-in for a torch
CUDA tensor (torch's CUDA runtime cannot exist on this machine): the device made current and the
stream CuPy launches on."""

from __future__ import annotations

import types

import pytest

from kgen.errors import ArgumentError
from kgen.runtime.placement import call_device, on_callers_stream

torch = pytest.importorskip("torch")


class CudaTensor:
    """What placement reads of a torch CUDA tensor: its type's module, .device, .data_ptr()."""

    __module__ = "torch"

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)

    def data_ptr(self) -> int:
        return 0x1000


def _torch_streams(monkeypatch, driver) -> dict[int, int]:
    """torch.cuda.current_stream(device) answering one non-blocking model stream per device."""
    handles = {}

    def current_stream(device):
        index = device.index if hasattr(device, "index") else int(device)
        if index not in handles:
            with_device = driver.current_device
            driver.current_device = index
            handles[index] = driver.new_stream(non_blocking=True)
            driver.current_device = with_device
        return types.SimpleNamespace(cuda_stream=handles[index])

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return handles


def test_torch_tensors_launch_on_torchs_current_stream_of_their_device(monkeypatch):
    from strict_cuda import install, uninstall

    driver = install(monkeypatch, device_count=2)
    try:
        import cupy

        handles = _torch_streams(monkeypatch, driver)
        call = {"q": CudaTensor(1), "seq_lens": [CudaTensor(1)], "scale": 0.5}
        assert call_device(call) == (1, True)
        with on_callers_stream(call, module_device=1):
            assert cupy.cuda.get_current_stream().ptr == handles[1]
            assert cupy.cuda.runtime.getDevice() == 1
        assert cupy.cuda.get_current_stream().ptr == driver.legacy_stream() and cupy.cuda.runtime.getDevice() == 0
    finally:
        uninstall()


def test_cupy_arrays_keep_cupys_current_stream(strict_cuda):
    import cupy

    x = cupy.zeros(4, "float32")
    side = cupy.cuda.Stream(non_blocking=True)
    with side, on_callers_stream({"x": x}, module_device=0):
        assert cupy.cuda.get_current_stream().ptr == side.ptr


def test_arrays_on_two_devices_or_another_device_than_the_kernels_are_refused(monkeypatch):
    from strict_cuda import install, uninstall

    install(monkeypatch, device_count=2)
    try:
        with pytest.raises(ArgumentError, match=r"k\[1\] is on cuda:1 but q is on cuda:0"):
            call_device({"q": CudaTensor(0), "k": [CudaTensor(0), CudaTensor(1)]})
        with pytest.raises(ArgumentError, match="on cuda:1, but this kernel was loaded on cuda:0"):
            with on_callers_stream({"q": CudaTensor(1)}, module_device=0):
                pass
    finally:
        uninstall()


def test_host_arrays_and_cpu_modules_need_no_cuda():
    import numpy as np

    with on_callers_stream({"q": np.zeros(3)}, module_device=None):
        pass
    assert call_device({"q": np.zeros(3), "n": 3}) is None
