"""The isolated CUDA runtime (kgen.runtime.cuda.IsolatedCudaModule and the child's request handling,
kgen/runtime/_isolated_cuda_child.py) against the strict driver model: a hand-written source verified
on CUDA through `kernel_from_source`, each launch's arrays reaching the child through CUDA IPC at
addresses of its own.

The model's memory is this process's, so the child's half runs here: its `run_launch` (IPC open,
the shared-memory opt-in, the launch, the device sync, the close) takes each request the parent
sends, in place of the process, whose start, environment, limits and faults tests/runtime/
test_isolated.py checks with real processes (on a GPU)."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from conftest import reference_check, tiny_decode

import kgen
from kgen.arrays import args_to_backend, to_numpy
from kgen.errors import ArgumentError
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.registry import family_for
from kgen.render import render
from kgen.runtime import cuda as kgen_cuda
from kgen.runtime.base import DeviceAddress, Launch
from kgen.runtime.cuda import IsolatedCudaModule
from kgen.verify.untrusted.handwritten import kernel_from_source

CHILD = kgen_cuda.CUDA_CHILD


class InProcessChild:
    """kgen.runtime.isolated.Child's interface over the child script's own request handling."""

    def __init__(self, script, args, **_):
        assert script == CHILD
        self.cubin, self.kernels, self.bus_id = args[0], args[1].split(","), args[2]
        self.requests: list[dict] = []
        self._functions = None

    def start(self, what: str) -> dict:
        if self._functions is None:
            import cupy

            spec = importlib.util.spec_from_file_location("_kgen_cuda_child_under_test", CHILD)
            self._script = importlib.util.module_from_spec(spec)
            argv, sys.argv = sys.argv, [str(CHILD)]  # the script reads an import path from argv[5]
            try:
                spec.loader.exec_module(self._script)
            finally:
                sys.argv = argv
            self._script.set_soft = lambda which, value: None  # rlimits would be this test process's
            cupy.cuda.Device(cupy.cuda.runtime.deviceGetByPCIBusId(self.bus_id)).use()
            module = cupy.RawModule(path=self.cubin)
            self._functions = {name: module.get_function(name) for name in self.kernels}
        return {"ok": True}

    def request(self, message, fds, timeout_s, what, limits_note=""):
        import cupy

        self.requests.append(message)
        return self._script.run_launch(cupy, self._functions, message)

    def stop(self) -> None:
        self._functions = None


@pytest.fixture
def children(strict_cuda, monkeypatch):
    made: list[InProcessChild] = []

    def child(*args, **kwargs):
        made.append(InProcessChild(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(kgen_cuda, "Child", child)
    return made


def test_a_hand_written_source_verifies_on_cuda_through_ipc(strict_cuda, children):
    spec = tiny_decode(name="tiny_hand_cuda")
    kern = kernel_from_source(spec, render(spec, {"partition_size": 0}).source, backend="cuda", archs=["sm_90"])
    assert isinstance(kern.module, IsolatedCudaModule)
    family = family_for(spec)
    small = [c.name for c in family.cases(spec, kern.config, np.random.default_rng(0))
             if family.case_device_bytes(spec, c) < 64 << 20]  # the model's memory is this machine's
    report = kgen.verify(kern, seed=3, cases=small)
    assert report.passed, report.summary()
    assert len(report.cases) >= len(small) > 10  # a case may give several verdicts (steps)
    (child,) = children
    assert child.requests and all(r["handles"] for r in child.requests)
    # every array reached the child at an address of its own (the model maps an IPC handle elsewhere)
    assert any(kind == "ipc_get" for kind, *_ in strict_cuda.log)
    assert {ln.kernel for ln in strict_cuda.launches} == {"tiny_hand_cuda"}

    host = make_decode_case(spec, [5, 70, 1], np.random.default_rng(9))
    dev = args_to_backend(host, "cuda")
    kern(**dev)
    assert reference_check(spec, host, to_numpy(dev["out"])).passed


def test_a_freed_address_is_refused_before_the_child(strict_cuda, children):
    """kgen's own pointer argument into memory freed since (the driver's address range knows no such
    allocation): an ArgumentError here, not an illegal address in the child."""
    import cupy

    spec = tiny_decode(name="tiny_hand_cuda_bad")
    kern = kernel_from_source(spec, render(spec, {"partition_size": 0}).source, backend="cuda", archs=["sm_90"])
    host = make_decode_case(spec, [5, 9], np.random.default_rng(1))
    (launch,) = kern.bind(**args_to_backend(host, "cuda")).launches
    freed = cupy.empty(256, np.float32)
    address = freed.data.ptr
    del freed
    stray = [DeviceAddress(address, None) if i == 0 else a for i, a in enumerate(launch.args)]
    with pytest.raises(ArgumentError, match=f"argument 0: device address 0x{address:x} lies in no allocation"):
        kern.module.launch(Launch(launch.kernel, launch.grid, launch.block, launch.smem, stray))
    assert not children or not children[0].requests
