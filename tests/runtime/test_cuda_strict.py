"""kgen's CUDA host paths (kgen/runtime/cuda.py, placement.py; the kernel call, the tuner's timing,
verification's memory and faults, generated modules) against the strict model of the driver and
CuPy (tests/strict_cuda/, the `strict_cuda` fixture): the defects a GPU would show, each refused or
fixed here, with the kernels' bodies run on the CPU backend so their outputs are checked too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import reference_check, tiny_decode

import kgen
from kgen.arrays import args_to_backend, to_numpy
from kgen.build import build
from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import ArgumentError, KernelRuntimeError
from kgen.families.attention.decode_cases import make_decode_case
from kgen.runtime.base import Launch
from kgen.runtime.cuda import CudaModule, loaded_cubin
from kgen.verify.runner import verify as run_verify

ROOT = Path(__file__).resolve().parents[2]
AXPY = r"""
extern "C" __global__ void axpy(float* y, const float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
"""


def _decode_call(spec, lens, seed=0):
    host = make_decode_case(spec, list(lens), np.random.default_rng(seed))
    return host, args_to_backend(host, "cuda")


def _axpy_module() -> CudaModule:
    art = compile_cubin(AXPY, "sm_90")
    return CudaModule(loaded_cubin(ArtifactCache(), art.cubin, AXPY), ["axpy"])


def test_static_plus_dynamic_shared_memory_past_48k_opts_in(strict_cuda):
    """llama3_8b_decode with 256 threads and no split: 49,152 bytes of static shared memory plus
    dynamic: past 48 KiB only together, where the driver already needs the opt-in."""
    spec = kgen.load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")
    kern = build(spec, backend="cuda", verify=False, config={"threads": 256, "partition_size": 0})
    host, dev = _decode_call(spec, [17, 40])
    out = kern(**dev)
    (launch,) = strict_cuda.launches
    fn = kern.module._functions[launch.kernel]
    assert fn.shared_size_bytes <= 48 * 1024 < fn.shared_size_bytes + launch.smem, (fn.shared_size_bytes, launch.smem)
    assert fn.max_dynamic_shared_size_bytes >= launch.smem
    result = reference_check(spec, host, to_numpy(out))
    assert result.passed, result


def test_an_empty_batch_returns_at_once_without_a_launch(strict_cuda):
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    host, _ = _decode_call(spec, [5])
    empty = {k: (v[:0] if k in ("q", "block_tables", "seq_lens", "out") else v) for k, v in host.items()}
    out = kern(**args_to_backend(empty, "cuda"))
    assert out.shape[0] == 0
    assert strict_cuda.launches == []


def test_a_grid_past_the_driver_limit_is_refused_naming_the_axis(strict_cuda):
    mod = _axpy_module()
    y = kgen_cupy().zeros(4, np.float32)
    with pytest.raises(KernelRuntimeError, match="70000 blocks on axis y; a GPU takes at most 65535"):
        mod.launch(Launch("axpy", (1, 70000, 1), (4, 1, 1), 0, [y, y, np.float32(1), np.int32(4)]))
    assert strict_cuda.launches == []


def test_a_foreign_device_array_is_passed_as_its_address(strict_cuda):
    """CuPy's packing refuses objects it does not know (a torch CUDA tensor: `Unsupported type`);
    kgen passes any __cuda_array_interface__ array as its address."""
    cp = kgen_cupy()
    y, x = cp.zeros(64, np.float32), cp.asarray(np.arange(64, dtype=np.float32))

    class Foreign:  # what a torch CUDA tensor offers kgen's launcher
        __cuda_array_interface__ = y.__cuda_array_interface__

    _axpy_module().launch(Launch("axpy", (1, 1, 1), (64, 1, 1), 0, [Foreign(), x, np.float32(2), np.int32(64)]))
    np.testing.assert_array_equal(y.get(), 2 * np.arange(64, dtype=np.float32))


def test_a_direct_call_runs_on_the_callers_stream(strict_cuda):
    cp = kgen_cupy()
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    host, dev = _decode_call(spec, [3, 33])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = kern(**dev)
    assert strict_cuda.launches and {ln.stream for ln in strict_cuda.launches} == {stream.ptr}
    stream.synchronize()  # the output was written on `stream`: read it after it is done
    assert reference_check(spec, host, to_numpy(out)).passed


class _TorchCudaTensor:
    """A stand-in for a torch CUDA tensor (torch's CUDA runtime cannot exist on this machine) over a
    model array: what kgen reads of one (its type's module, device, dtype, shape, strides, address)."""

    __module__ = "torch"
    _DTYPES = {"float16": "float16", "float32": "float32", "int32": "int32"}

    def __init__(self, array):
        import torch

        self._array = array
        self.device = torch.device("cuda", array.device.id)
        self.dtype = getattr(torch, self._DTYPES[array.dtype.name])
        self.shape = torch.Size(array.shape)
        self.__cuda_array_interface__ = array.__cuda_array_interface__

    def stride(self):
        return tuple(s // self._array.itemsize for s in self._array.strides)

    def data_ptr(self) -> int:
        return self._array.data.ptr

    def __getitem__(self, key):
        return _TorchCudaTensor(self._array[key])

    def reshape(self, *shape):
        return _TorchCudaTensor(self._array.reshape(*shape))

    def detach(self):
        return self


def _torch_cuda_allocations(monkeypatch) -> None:
    """torch.empty on a CUDA device, stood in for by the model's memory (torch's caching allocator
    cannot exist on this machine); host allocations stay torch's."""
    import torch

    host_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kwargs):
        if device is None or torch.device(device).type != "cuda":
            return host_empty(*shape, dtype=dtype, device=device, **kwargs)
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        numpy_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.int32: np.int32}[dtype]
        return _TorchCudaTensor(kgen_cupy().empty(tuple(size), numpy_dtype))

    monkeypatch.setattr(torch, "empty", empty)


def test_a_call_with_torch_tensors_runs_on_torchs_current_stream(strict_cuda, monkeypatch):
    """One seam for direct calls, the torch ops and the vLLM plugin: torch's current stream of the
    tensors' device (CuPy's own current stream would race torch's work and escape graph capture)."""
    import types

    import torch

    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    host, dev = _decode_call(spec, [5, 40])
    torch_stream = strict_cuda.new_stream(non_blocking=True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=torch_stream))
    kern(**{name: _TorchCudaTensor(a) for name, a in dev.items()})
    assert [ln.stream for ln in strict_cuda.launches] == [torch_stream]
    strict_cuda.synchronize_stream(torch_stream, "the test waits for torch's stream")
    assert reference_check(spec, host, to_numpy(dev["out"])).passed


def test_a_torch_op_runs_on_torchs_current_stream(strict_cuda, monkeypatch):
    """torch.ops.kgen.<name>'s body (what torch's dispatcher calls with CUDA tensors) through the same
    seam: the launch on torch's current stream, the result right."""
    import types

    import torch

    from kgen import torch_ops
    from kgen.families.base import resolve_config
    from kgen.families.binding import call_arguments
    from kgen.families.registry import family_for

    spec = tiny_decode(name="tiny_decode_torch_op")
    kern = build(spec, backend="cuda", verify=False)
    torch_ops.register(kern)
    family = family_for(spec)
    (default, *_) = torch_ops.overloads(call_arguments(family, spec, resolve_config(family, spec, kern.config)))
    host, dev = _decode_call(spec, [12, 33])
    torch_stream = strict_cuda.new_stream(non_blocking=True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=torch_stream))
    torch_ops._real(spec.name, default)(**{name: _TorchCudaTensor(a) for name, a in dev.items()})
    assert [ln.stream for ln in strict_cuda.launches] == [torch_stream]
    strict_cuda.synchronize_stream(torch_stream, "the test waits for torch's stream")
    assert reference_check(spec, host, to_numpy(dev["out"])).passed


def test_reading_a_result_without_waiting_for_its_stream_is_a_race(strict_cuda):
    """The model's stream rule, seen through kgen: the output read on the legacy stream before the
    non-blocking stream that wrote it was waited for."""
    cp = kgen_cupy()
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    _, dev = _decode_call(spec, [9])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = kern(**dev)
    out.get()
    assert any("written on stream" in v for v in strict_cuda.violations), strict_cuda.violations
    strict_cuda.violations.clear()
    stream.synchronize()  # before the arrays it used are freed


def test_a_planned_call_allocates_nothing_and_never_waits_after_its_first(strict_cuda):
    """What CUDA-graph capture needs of kern(..., plan=plan): no allocation, no copy, no sync."""
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False, config={"threads": 64, "partition_size": 16})
    host, dev = _decode_call(spec, [40, 3, 70])
    plan = kern.plan(host["seq_lens"], num_sms=2, partition_tokens=16)
    kern(**dev, plan=plan)  # the first call allocates the plan's split-KV scratch
    before = len(strict_cuda.log)
    out = kern(**dev, plan=plan)
    after = strict_cuda.log[before:]
    assert after and all(kind == "launch" for kind, *_ in after), after
    assert len(after) == len(plan.launches) >= 2  # split: the partitions and their merge
    assert reference_check(spec, host, to_numpy(out)).passed


def test_arrays_on_two_devices_are_refused_naming_both(monkeypatch):
    from strict_cuda import install, uninstall

    driver = install(monkeypatch, device_count=2)
    try:
        cp = kgen_cupy()
        spec = tiny_decode()
        kern = build(spec, backend="cuda", verify=False)
        host, dev = _decode_call(spec, [4])
        with cp.cuda.Device(1):
            dev["q"] = cp.asarray(host["q"])
        with pytest.raises(ArgumentError, match="q is on cuda:1 but"):
            kern(**dev)
        with cp.cuda.Device(1):
            on_one = args_to_backend(host, "cuda")
        with pytest.raises(ArgumentError, match="on cuda:1, but this kernel was loaded on cuda:0"):
            kern(**on_one)
        assert driver.launches == [] and not driver.violations
    finally:
        uninstall()


def test_verification_releases_its_device_memory(strict_cuda):
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    report = run_verify(kern, cases=["len_B+1", "mixed_batch"])
    assert report.passed, report.summary()
    assert strict_cuda.peak_bytes > 0
    assert strict_cuda.pool_cached_bytes == 0, "the cases' arrays stay cached in CuPy's pool"


class _WildAddress(CudaModule):
    """Launches its kernels with one pointer argument moved outside any allocation: on a GPU, the
    illegal address a kernel that computes a wild pointer faults on."""

    def __init__(self, inner: CudaModule):
        self.__dict__.update(inner.__dict__)

    def launch(self, launch: Launch) -> None:
        args = [np.uint64(0xDEAD0000) if i == 0 else a for i, a in enumerate(launch.args)]
        super().launch(Launch(launch.kernel, launch.grid, launch.block, launch.smem, args))


def test_a_fault_during_verification_is_the_cases_verdict(strict_cuda):
    """The error surfaces at the next CUDA call (the copy back) and the context is lost: the report
    names the kernel and the case instead of raising CuPy's error out of build()."""
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    kern.module = _WildAddress(kern.module)
    report = run_verify(kern, cases=["len_1", "len_B"])
    assert not report.passed and len(report.cases) == 1
    note = report.cases[0].note
    assert "case 'len_1'" in note and spec.name in note and "CUDA context is lost" in note, note
    assert any("illegal address" in v for v in strict_cuda.violations)
    strict_cuda.violations.clear()


def test_the_tuner_times_the_launches_and_nothing_else(strict_cuda):
    from kgen.tune.measure import make_task, run_task

    spec = tiny_decode()
    # a split config: its call without a plan allocates the split-KV scratch (must not be timed)
    result = run_task(make_task(spec, {"threads": 64, "partition_size": 16}, (2, 40), "cuda", 0.0, seed=3))
    assert result["status"] == "ok", result
    log = strict_cuda.log
    events = [i for i, entry in enumerate(log) if entry[0] == "event"]
    assert len(events) >= 2 * (result["reps"]), events
    for start, stop in zip(events[::2], events[1::2], strict=True):
        between = log[start + 1:stop]
        assert between and all(kind == "launch" for kind, *_ in between), between


def test_a_rebuilt_generated_module_loads_its_new_cubin(strict_cuda, tmp_path):
    from kgen.errors import KgenError
    from kgen.generated import load_generated, write_generated

    spec = tiny_decode()
    for threads in (64, 128):
        kern = build(spec, backend="cuda", verify=False, archs=["sm_90"], config={"threads": threads})
        write_generated(kern, tmp_path)
        loaded = load_generated(tmp_path / spec.name).load(backend="cuda")
        assert loaded.config["threads"] == threads
        host, dev = _decode_call(spec, [20])
        out = loaded(**dev)
        assert strict_cuda.launches[-1].block[0] == threads
        assert reference_check(spec, host, to_numpy(out)).passed
    cubin = tmp_path / spec.name / "kernel.sm_90.cubin"
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(KgenError, match="cubin does not match its manifest"):
        load_generated(tmp_path / spec.name).load(backend="cuda")


def kgen_cupy():
    """The `cupy` kgen imports: the model, under the strict_cuda fixture."""
    import cupy

    return cupy


@pytest.mark.parametrize("name", ["copy_blocks_fp16", "cache_write_fp8_e4m3"])
def test_the_cache_kernels_build_and_verify_on_cuda(strict_cuda, name):
    """copy_blocks reaches its pools through a device table of addresses (which the model cannot
    check, docs/testing.md); cache_write writes the pool in place: both verified through CuPy."""
    kern = build(kgen.load_spec(ROOT / "specs" / f"{name}.yaml"), backend="cuda")
    assert kern.report.passed, kern.report.summary()
    assert strict_cuda.launches and strict_cuda.pool_cached_bytes == 0


def test_copy_blocks_with_torch_tensors_runs_on_torchs_stream_without_a_host_sync(strict_cuda, monkeypatch):
    """vLLM's copy-on-write call: pools and pairs are torch CUDA tensors. The plane table goes to the
    device on torch's current stream through pinned staging (no host wait), the copy launches there
    too, and every layer's blocks are copied."""
    import types

    import torch

    from kgen.formats.cache import cache_shapes

    cp = kgen_cupy()
    spec = kgen.load_spec(ROOT / "specs" / "copy_blocks_fp16.yaml")
    kern = build(spec, backend="cuda", verify=False)
    rng = np.random.default_rng(7)
    num_blocks, layers = 9, 2
    pools = {name: [rng.standard_normal(shape).astype(np.float16) for _ in range(layers)]
             for name, shape in cache_shapes(spec, num_blocks).items()}
    pairs = np.asarray([[1, 4], [1, 5], [3, 8]], np.int32)
    torch_stream = strict_cuda.new_stream(non_blocking=True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=torch_stream))
    with cp.cuda.Stream(non_blocking=True):  # torch's work in flight: a blocking copy would be seen
        dev = {name: [cp.asarray(p) for p in ps] for name, ps in pools.items()}
        dev_pairs = cp.asarray(pairs)
        cp.cuda.get_current_stream().synchronize()
    before = len(strict_cuda.log)
    kern(**{name: [_TorchCudaTensor(a) for a in arrays] for name, arrays in dev.items()},
         pairs=_TorchCudaTensor(dev_pairs))
    during = strict_cuda.log[before:]
    assert [ln.stream for ln in strict_cuda.launches] == [torch_stream]
    assert not [entry for entry in during if entry[0] == "sync"], during
    table_bytes = len(pools) * layers * 3 * 8  # (address, block stride, block bytes) per pool array
    assert ("copy_h2d", torch_stream, table_bytes) in during  # the plane table, on torch's stream
    strict_cuda.synchronize_stream(torch_stream, "the test waits for torch's stream")
    for name, ps in pools.items():
        for i, p in enumerate(ps):
            expected = p.copy()
            expected[pairs[:, 1]] = p[pairs[:, 0]]
            np.testing.assert_array_equal(to_numpy(dev[name][i]), expected, err_msg=f"{name}[{i}]")


def test_a_planned_call_is_captured_in_a_cuda_graph_and_replays_with_new_inputs(strict_cuda, monkeypatch):
    """What vLLM's full CUDA graphs do with a decode layer: torch's capture stream (global mode, so no
    cudaMalloc), the planned call captured after a warm-up call, then replayed with new values in the
    same arrays: every launch of the plan is in the graph and the replay's output is right."""
    import types

    import torch

    cp = kgen_cupy()
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False, config={"threads": 64, "partition_size": 16})
    lens = [40, 3, 70]
    host, dev = _decode_call(spec, lens)
    plan = kern.plan(host["seq_lens"], num_sms=2, partition_tokens=16)
    capture_stream = cp.cuda.Stream(non_blocking=True)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: types.SimpleNamespace(cuda_stream=capture_stream.ptr))
    _torch_cuda_allocations(monkeypatch)
    tensors = {name: _TorchCudaTensor(a) for name, a in dev.items()}
    kern(**tensors, plan=plan)  # the warm-up: the plan's split-KV scratch is allocated here
    capture_stream.synchronize()
    capture_stream.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
    kern(**tensors, plan=plan)
    graph = capture_stream.end_capture()
    assert len(strict_cuda.launches) == len(plan.launches) >= 2  # the warm-up's only: the capture ran nothing

    new = make_decode_case(spec, lens, np.random.default_rng(1))
    for name, array in dev.items():
        if name != "out":
            array.set(new[name], stream=capture_stream)
    graph.launch(stream=capture_stream)
    capture_stream.synchronize()
    assert len(strict_cuda.launches) == 2 * len(plan.launches)
    assert reference_check(spec, new, to_numpy(dev["out"])).passed


def test_an_unplanned_split_call_cannot_be_captured(strict_cuda):
    """Without a plan a split-KV call allocates its scratch per call: a cudaMalloc that a global-mode
    capture refuses (and that a relaxed one would bake into the graph, then free). docs/abi.md: plan,
    call once, then capture."""
    cp = kgen_cupy()
    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False, config={"threads": 64, "partition_size": 16})
    _, dev = _decode_call(spec, [40, 3, 70])
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        with pytest.raises(Exception, match="capturing"):
            kern(**dev)
        with pytest.raises(Exception, match="invalidated by cudaMalloc"):
            s.end_capture()
    assert strict_cuda.violations
    strict_cuda.violations.clear()
