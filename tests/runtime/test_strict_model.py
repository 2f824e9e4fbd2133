"""The strict model of the CUDA driver and CuPy (tests/strict_cuda/) refuses what a real driver
refuses: each rule shown failing on a small kernel, so that the tests that rely on the model
(test_cuda_strict.py) can trust a pass."""

from __future__ import annotations

import numpy as np
import pytest
from strict_cuda import CUDARuntimeError

from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin
from kgen.runtime.cuda import loaded_cubin

SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "kgen/platform.cuh"
extern "C" __global__ void axpy(float* y, const float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
extern "C" __global__ void staged(float* y, int n) {
  __shared__ float tile[12288];  // 48 KiB of static shared memory
  KGEN_DYNAMIC_SMEM(float, more);
  tile[threadIdx.x] = 1.0f;
  more[threadIdx.x] = 2.0f;
  __syncthreads();
  if (threadIdx.x < n) y[threadIdx.x] = tile[threadIdx.x] + more[threadIdx.x];
}
"""


@pytest.fixture
def mod(strict_cuda):
    import cupy

    art = compile_cubin(SRC, "sm_90")
    return cupy.RawModule(path=str(loaded_cubin(ArtifactCache(), art.cubin, SRC)))


def _arrays(n=32):
    import cupy

    y, x = cupy.zeros(n, np.float32), cupy.asarray(np.arange(n, dtype=np.float32))
    cupy.cuda.get_current_stream().synchronize()  # both written on the legacy stream; other streams use them
    return y, x


def test_values_flow_through_a_launch(mod):
    y, x = _arrays()
    mod.get_function("axpy")((1,), (32,), (y, x, np.float32(3), np.int32(32)))
    np.testing.assert_array_equal(y.get(), 3 * np.arange(32, dtype=np.float32))


def test_static_plus_dynamic_shared_memory_needs_the_opt_in(mod, strict_cuda):
    y, _ = _arrays()
    fn = mod.get_function("staged")
    assert fn.shared_size_bytes == 48 * 1024  # read from the cubin's .nv.shared.staged section
    with pytest.raises(CUDARuntimeError, match="without the opt-in"):
        fn((1,), (32,), (y, np.int32(32)), shared_mem=128)
    fn.max_dynamic_shared_size_bytes = 128
    fn((1,), (32,), (y, np.int32(32)), shared_mem=128)
    assert (y.get() == 3).all()
    with pytest.raises(CUDARuntimeError, match="opt-in limit"):
        fn.max_dynamic_shared_size_bytes = 200 * 1024


def test_cupys_packing_refuses_unknown_objects_and_sizes_python_scalars(mod, strict_cuda):
    y, x = _arrays()
    with pytest.raises(TypeError, match="Unsupported type"):
        mod.get_function("axpy")((1,), (32,), (object(), x, np.float32(1), np.int32(32)))
    mod.get_function("axpy")((1,), (32,), (y, x, 1.0, np.int32(32)))  # CuPy packs a float as 8 bytes
    assert strict_cuda.violations and "packed as 8 bytes (float64) for a 4-byte parameter" in strict_cuda.violations[0]
    strict_cuda.violations.clear()


def test_a_zero_grid_or_a_wild_pointer_is_a_sticky_fault(mod, strict_cuda):
    from strict_cuda import CUDARuntimeError

    y, x = _arrays()
    mod.get_function("axpy")((0,), (32,), (y, x, np.float32(1), np.int32(32)))  # returns: the fault is async
    with pytest.raises(CUDARuntimeError, match="illegal memory access"):
        y.get()
    with pytest.raises(CUDARuntimeError, match="illegal memory access"):  # and every later call
        _arrays()
    strict_cuda.violations.clear()


def test_a_pointer_outside_every_allocation_faults(mod, strict_cuda):
    from strict_cuda import CUDARuntimeError

    y, x = _arrays()
    mod.get_function("axpy")((1,), (32,), (np.uint64(y.data.ptr + (1 << 20)), x, np.float32(1), np.int32(32)))
    with pytest.raises(CUDARuntimeError):
        y.get()
    assert "in no live allocation" in strict_cuda.violations[0]
    strict_cuda.violations.clear()


def test_streams_need_an_event_or_a_sync_between_them(mod, strict_cuda):
    import cupy

    y, x = _arrays()
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    fn = mod.get_function("axpy")
    fn((1,), (32,), (y, x, np.float32(1), np.int32(32)), stream=a)
    b.wait_event(a.record())
    fn((1,), (32,), (x, y, np.float32(1), np.int32(32)), stream=b)  # ordered: no report
    assert not strict_cuda.violations
    fn((1,), (32,), (y, x, np.float32(1), np.int32(32)), stream=a)  # writes y while... b only read it: a race
    assert any("that stream" in v and "reads" in v for v in strict_cuda.violations), strict_cuda.violations
    strict_cuda.violations.clear()
    a.synchronize()
    b.synchronize()
    fn((1,), (32,), (y, x, np.float32(1), np.int32(32)))  # the legacy stream, after host syncs: ordered
    assert not strict_cuda.violations


def test_memory_freed_while_another_stream_uses_it_is_reported(mod, strict_cuda):
    import cupy

    y, _ = _arrays()
    side = cupy.cuda.Stream(non_blocking=True)
    tmp = cupy.asarray(np.ones(32, np.float32))  # allocated on the legacy stream
    side.wait_event(cupy.cuda.get_current_stream().record())
    mod.get_function("axpy")((1,), (32,), (y, tmp, np.float32(1), np.int32(32)), stream=side)
    del tmp  # back to the legacy stream's pool while `side` may still read it
    assert any("freed" in v and "may still use it" in v for v in strict_cuda.violations), strict_cuda.violations
    strict_cuda.violations.clear()
    side.synchronize()  # y too was written on `side`: done before it is freed


def test_implicit_conversion_to_numpy_is_refused(strict_cuda):
    y, _ = _arrays()
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(y)


def test_a_host_to_device_copy_is_asynchronous_on_the_current_stream(mod, strict_cuda):
    """CuPy 14's asarray stages the values in pinned memory and copies on the current stream without
    waiting (blocking=False); another stream reading the copy needs an event, or blocking=True."""
    import cupy

    y = cupy.zeros(32, np.float32)
    x = cupy.asarray(np.arange(32, dtype=np.float32))
    side = cupy.cuda.Stream(non_blocking=True)
    mod.get_function("axpy")((1,), (32,), (y, x, np.float32(1), np.int32(32)), stream=side)
    assert any("reads memory" in v and "stream 0x0" in v for v in strict_cuda.violations), strict_cuda.violations
    strict_cuda.violations.clear()
    side.synchronize()
    cupy.cuda.get_current_stream().synchronize()
    x = cupy.asarray(np.arange(32, dtype=np.float32), blocking=True)
    mod.get_function("axpy")((1,), (32,), (y, x, np.float32(1), np.int32(32)), stream=side)
    assert not strict_cuda.violations
    side.synchronize()
    assert ("pinned_alloc", None, 128) in strict_cuda.log


def test_a_captured_launch_runs_at_each_replay_with_the_values_it_was_given(mod, strict_cuda):
    import cupy

    y, x = _arrays()
    s = cupy.cuda.Stream(non_blocking=True)
    s.begin_capture()
    mod.get_function("axpy")((1,), (32,), (y, x, np.float32(2), np.int32(32)), stream=s)
    graph = s.end_capture()
    assert not strict_cuda.launches  # recorded, not run
    graph.launch(stream=s)
    graph.launch(stream=s)
    s.synchronize()
    np.testing.assert_array_equal(y.get(), 4 * np.arange(32, dtype=np.float32))
    assert [ln.stream for ln in strict_cuda.launches] == [s.ptr, s.ptr]


def test_a_replay_after_the_captured_memory_was_freed_faults(mod, strict_cuda):
    import cupy

    y, _ = _arrays()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        tmp = cupy.asarray(np.ones(32, np.float32))  # a temporary made before the capture...
    s.synchronize()
    s.begin_capture()
    mod.get_function("axpy")((1,), (32,), (y, tmp, np.float32(1), np.int32(32)), stream=s)
    graph = s.end_capture()
    del tmp  # ... and freed after it: the graph still holds its address
    graph.launch(stream=s)
    with pytest.raises(CUDARuntimeError, match="illegal memory access"):
        s.synchronize()
    assert any("in no live allocation" in v for v in strict_cuda.violations), strict_cuda.violations
    strict_cuda.violations.clear()


@pytest.mark.parametrize("mode, refused", [(0, True), (2, False)])
def test_cudamalloc_during_a_global_mode_capture_is_refused(strict_cuda, mode, refused):
    """torch.cuda.graph captures in global mode (no cudaMalloc); CuPy's default, relaxed, allows it."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    s.begin_capture(mode)
    if refused:
        with pytest.raises(CUDARuntimeError, match="capturing"):
            cupy.empty(64, np.float32)
        with pytest.raises(CUDARuntimeError, match="invalidated by cudaMalloc"):
            s.end_capture()
        assert any("cudaMalloc of 256 bytes during stream capture" in v for v in strict_cuda.violations)
        strict_cuda.violations.clear()
    else:
        cupy.empty(64, np.float32)
        assert s.end_capture() is not None


@pytest.mark.parametrize("sync", ["stream", "device", "legacy stream"])
def test_a_sync_or_the_legacy_stream_during_a_capture_invalidates_it(mod, strict_cuda, sync):
    import cupy

    y, x = _arrays()
    s = cupy.cuda.Stream(non_blocking=True)
    s.begin_capture()
    with pytest.raises(CUDARuntimeError, match="capturing"):
        if sync == "stream":
            s.synchronize()
        elif sync == "device":
            cupy.cuda.runtime.deviceSynchronize()
        else:
            mod.get_function("axpy")((1,), (32,), (y, x, np.float32(1), np.int32(32)))
    with pytest.raises(CUDARuntimeError, match="invalidated"):
        s.end_capture()
    assert strict_cuda.violations
    strict_cuda.violations.clear()
