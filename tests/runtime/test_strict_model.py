"""The strict model of the CUDA driver and CuPy (tests/strict_cuda/) refuses what a real driver
refuses: each rule shown failing on a small kernel, so that the tests that rely on the model
(test_cuda_strict.py) can trust a pass."""

from __future__ import annotations

import numpy as np
import pytest

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

    return cupy.zeros(n, np.float32), cupy.asarray(np.arange(n, dtype=np.float32))


def test_values_flow_through_a_launch(mod):
    y, x = _arrays()
    mod.get_function("axpy")((1,), (32,), (y, x, np.float32(3), np.int32(32)))
    np.testing.assert_array_equal(y.get(), 3 * np.arange(32, dtype=np.float32))


def test_static_plus_dynamic_shared_memory_needs_the_opt_in(mod, strict_cuda):
    from strict_cuda import CUDARuntimeError

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
