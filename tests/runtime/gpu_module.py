"""Running the CPU backend's test launches on a GPU as well (tests/runtime/test_simt_wgmma.py and
test_simt_hopper.py): the same kernels and arrays, on the hardware they emulate."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.runtime.base import Launch


class GpuModule:
    """Runs the CPU tests' launches on the GPU: numpy arrays go to the device and come back after the
    launch, Python ints become the kernels' 32-bit ints."""

    def __init__(self, source: str, names: list[str], tmp_path):
        from kgen.cache import ArtifactCache
        from kgen.compile.nvrtc import compile_cubin
        from kgen.runtime.cuda import CudaModule, device_arch

        if device_arch() != "sm_90":
            pytest.skip("needs an sm_90 GPU (H100/H200) for sm_90a code")
        art = compile_cubin(source, "sm_90a", cache=ArtifactCache(tmp_path / "cache"))
        path = tmp_path / "hopper.cubin"
        path.write_bytes(art.cubin)
        self.mod = CudaModule(path, names)

    def launch(self, launch: Launch) -> None:
        import cupy as cp

        pairs, args = [], []
        for a in launch.args:
            if isinstance(a, np.ndarray):
                d = cp.asarray(a)
                pairs.append((a, d))
                args.append(d)
            else:
                args.append(np.int32(a) if isinstance(a, int) else a)
        self.mod.launch(Launch(launch.kernel, launch.grid, launch.block, launch.smem, args))
        cp.cuda.runtime.deviceSynchronize()
        for host, dev in pairs:
            np.copyto(host, cp.asnumpy(dev))
