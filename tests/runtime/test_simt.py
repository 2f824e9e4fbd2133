"""The CPU SIMT runtime against documented CUDA semantics, with small kernels."""

from __future__ import annotations

import multiprocessing as mp

import ml_dtypes
import numpy as np
import pytest

from kgen.errors import ArgumentError, KernelRuntimeError, KgenUserError
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

FULL = 0xFFFFFFFF
# numpy warns when casting NaN/inf sweeps between float formats; the values are what we test
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning",
                                        "ignore:overflow encountered in cast:RuntimeWarning")

SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

// ---- barrier ordering across warps: reverse 256 values through shared memory ----
extern "C" __global__ void __launch_bounds__(256) rev256(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float s[256];
  const int t = threadIdx.x, base = blockIdx.x * 256;
  s[t] = x[base + t];
  __syncthreads();
  float v = s[255 - t];
  __syncthreads();  // everyone has read before anyone overwrites
  s[t] = v * 2.0f;
  __syncthreads();
  y[base + t] = s[255 - t];
}

// ---- __syncthreads_count/and/or ----
extern "C" __global__ void sync_preds(const int* preds, int* out) {
  const int p = preds[blockIdx.x * blockDim.x + threadIdx.x];
  const int c = __syncthreads_count(p), a = __syncthreads_and(p), o = __syncthreads_or(p);
  if (threadIdx.x == 77) { out[blockIdx.x * 3] = c; out[blockIdx.x * 3 + 1] = a; out[blockIdx.x * 3 + 2] = o; }
}

// ---- shuffles: one configuration per block of 32 threads ----
extern "C" __global__ void shfl_cfg(const int* vals, const int* args, const int* ops, const int* widths,
                                    const unsigned* masks, int* out) {
  const int b = blockIdx.x, lane = threadIdx.x;
  const unsigned mask = masks[b];
  out[b * 32 + lane] = -1;
  if (!((mask >> lane) & 1u)) return;
  const int v = vals[b * 32 + lane], a = args[b * 32 + lane], w = widths[b];
  int r;
  switch (ops[b]) {
    case 0: r = __shfl_sync(mask, v, a, w); break;
    case 1: r = __shfl_up_sync(mask, v, (unsigned)a, w); break;
    case 2: r = __shfl_down_sync(mask, v, (unsigned)a, w); break;
    default: r = __shfl_xor_sync(mask, v, a, w); break;
  }
  out[b * 32 + lane] = r;
}

template <class T>
__device__ void shfl_one(double* out, int k, T v, double (*conv)(T)) {
  const int lane = threadIdx.x;
  out[(k * 4 + 0) * 32 + lane] = conv(__shfl_xor_sync(0xffffffffu, v, 7));
  out[(k * 4 + 1) * 32 + lane] = conv(__shfl_sync(0xffffffffu, v, 3));
  out[(k * 4 + 2) * 32 + lane] = conv(__shfl_down_sync(0xffffffffu, v, 2));
  out[(k * 4 + 3) * 32 + lane] = conv(__shfl_up_sync(0xffffffffu, v, 5));
}
extern "C" __global__ void shfl_types(double* out) {
  const int l = threadIdx.x;
  shfl_one<int>(out, 0, -1000 * l - 7, [](int x) { return (double)x; });
  shfl_one<unsigned>(out, 1, 0x80000000u + l, [](unsigned x) { return (double)x; });
  shfl_one<float>(out, 2, 1.5f * l + 0.25f, [](float x) { return (double)x; });
  shfl_one<double>(out, 3, 1e300 * (l + 1), [](double x) { return x; });
  shfl_one<long long>(out, 4, ((long long)l << 40) + l, [](long long x) { return (double)x; });
  shfl_one<__half>(out, 5, __float2half_rn(0.5f * l), [](__half x) { return (double)__half2float(x); });
  shfl_one<__nv_bfloat16>(out, 6, __float2bfloat16_rn(-2.0f * l), [](__nv_bfloat16 x) { return (double)__bfloat162float(x); });
  shfl_one<unsigned long long>(out, 7, (1ull << 60) + l, [](unsigned long long x) { return (double)(x - (1ull << 60)); });
}

// ---- votes: one mask per block ----
extern "C" __global__ void votes(const int* preds, const unsigned* masks, unsigned* out) {
  const int b = blockIdx.x, lane = threadIdx.x;
  const unsigned mask = masks[b];
  unsigned* o = out + (b * 32 + lane) * 4;
  o[0] = o[1] = o[2] = 0xdeadbeefu;
  o[3] = __activemask();
  if (!((mask >> lane) & 1u)) return;
  const int p = preds[b * 32 + lane];
  o[0] = __any_sync(mask, p);
  o[1] = __all_sync(mask, p);
  o[2] = __ballot_sync(mask, p);
}

// ---- __syncwarp orders shared-memory traffic inside a warp ----
extern "C" __global__ void warp_sync_order(int* out) {
  __shared__ int s[64];
  const int t = threadIdx.x, lane = t & 31;
  s[t] = t * 10;
  __syncwarp();
  int v = s[(t & ~31) + ((lane + 1) & 31)];
  __syncwarp(0xffffffffu);
  s[t] = v + 1;
  __syncwarp();
  out[t] = s[(t & ~31) + ((lane + 31) & 31)];
}

// ---- atomics under contention ----
extern "C" __global__ void atomics(int* ci, unsigned* cu, float* cf, double* cd, int* imax, int* imin,
                                   unsigned* umax, unsigned* umin, unsigned long long* cas64, int* cas32,
                                   unsigned* casu, int* slot, int* olds, unsigned long long* add64) {
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(ci, 1);
  atomicAdd(cu, 2u);
  atomicAdd(cf, 1.0f);
  atomicAdd(cd, 0.5);
  atomicAdd(add64, 3ull);
  atomicMax(imax, gid - 1000);
  atomicMin(imin, 1000 - gid);
  atomicMax(umax, (unsigned)gid * 3u);
  atomicMin(umin, 100000u - (unsigned)gid);
  unsigned long long o = *cas64, seen;
  while ((seen = atomicCAS(cas64, o, o + 1)) != o) o = seen;
  int oi = *cas32, si;
  while ((si = atomicCAS(cas32, oi, oi + 1)) != oi) oi = si;
  unsigned ou = *casu, su;
  while ((su = atomicCAS(casu, ou, ou + 1u)) != ou) ou = su;
  olds[gid] = atomicExch(slot, gid);
  __threadfence();
}

// ---- static shared memory is private to each block, also inside a __device__ helper ----
__device__ int* helper_smem() {
  __shared__ int buf[64];
  return buf;
}
extern "C" __global__ void smem_iso(int* bad, int rounds) {
  __shared__ int s[128];
  int* h = helper_smem();
  const int t = threadIdx.x;
  for (int r = 0; r < rounds; ++r) {
    s[t] = blockIdx.x * 1000 + r;
    if (t < 64) h[t] = blockIdx.x * 7 + r;
    __syncthreads();
    for (int i = 0; i < 128; ++i)
      if (s[i] != (int)blockIdx.x * 1000 + r) { atomicAdd(bad, 1); break; }
    if (h[t & 63] != (int)blockIdx.x * 7 + r) atomicAdd(bad, 1);
    __syncthreads();
  }
}

// ---- dynamic shared memory ----
extern "C" __global__ void dyn_smem(float* out, unsigned* misaligned) {
  KGEN_DYNAMIC_SMEM(float, s);
  const int t = threadIdx.x, n = blockDim.x;
  if (((unsigned long long)(void*)s) % 16) atomicAdd(misaligned, 1u);
  s[t] = blockIdx.x * 100.0f + t;
  __syncthreads();
  out[blockIdx.x * n + t] = s[n - 1 - t];
}

// ---- a big per-thread array (kernels keep accumulators in registers) ----
extern "C" __global__ void big_local(const int* idx, float* out) {
  float acc[256];
  const int t = threadIdx.x;
  for (int i = 0; i < 256; ++i) acc[i] = t + i;
  __syncthreads();
  for (int i = 0; i < 256; ++i) acc[idx[i]] += 1.0f;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < 256; ++i) s += acc[i];
  out[t] = s;
}

// ---- a per-thread array far bigger than the fiber stack ----
extern "C" __global__ void overflow_big(const int* idx, float* out) {
  float a[40000];
  for (int i = 0; i < 40000; ++i) a[i] = i;
  out[threadIdx.x] = a[idx[threadIdx.x]];
}

// ---- 3-D indices ----
extern "C" __global__ void indices(unsigned* out) {
  const unsigned tl = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned bl = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
  unsigned* o = out + (bl * nt + tl) * 4;
  o[0] = threadIdx.x | (threadIdx.y << 8) | (threadIdx.z << 16);
  o[1] = blockIdx.x | (blockIdx.y << 8) | (blockIdx.z << 16);
  o[2] = blockDim.x | (blockDim.y << 8) | (blockDim.z << 16);
  o[3] = gridDim.x | (gridDim.y << 8) | (gridDim.z << 16);
}

// ---- number formats (NVIDIA's headers, host mode) ----
extern "C" __global__ void fmt_convert(const float* f, const unsigned short* h16, const unsigned char* h8,
                                       unsigned short* f2h, unsigned short* f2bf, float* h2f, float* bf2f,
                                       unsigned char* f2e4, unsigned char* f2e5, float* e42f, float* e52f,
                                       unsigned char* ctor_e4, int n16, int n8, int nf) {
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nf; i += stride) {
    f2h[i] = __half_as_ushort(__float2half_rn(f[i]));
    f2bf[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f[i]));
    f2e4[i] = __nv_cvt_float_to_fp8(f[i], __NV_SATFINITE, __NV_E4M3);
    f2e5[i] = __nv_cvt_float_to_fp8(f[i], __NV_SATFINITE, __NV_E5M2);
    ctor_e4[i] = __nv_fp8_e4m3(f[i]).__x;
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
    h2f[i] = __half2float(__ushort_as_half(h16[i]));
    bf2f[i] = __bfloat162float(__ushort_as_bfloat16(h16[i]));
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
    __nv_fp8_e4m3 a; a.__x = h8[i];
    __nv_fp8_e5m2 b; b.__x = h8[i];
    e42f[i] = float(a);
    e52f[i] = float(b);
  }
}

extern "C" __global__ void vec2_basics(float* out) {
  __half2 a = __floats2half2_rn(1.5f, -2.25f);
  float2 fa = __half22float2(__hadd2(a, a));
  __nv_bfloat162 b = __floats2bfloat162_rn(3.0f, 0.5f);
  float2 fb = __bfloat1622float2(__hmul2(b, b));
  float4 v = make_float4(1.f, 2.f, 3.f, 4.f);
  int4 iv = make_int4(1, 2, 3, 4);
  uchar4 cv = make_uchar4(250, 1, 2, 3);
  out[0] = fa.x; out[1] = fa.y; out[2] = fb.x; out[3] = fb.y;
  out[4] = v.x + v.w; out[5] = (float)(iv.y * iv.z); out[6] = (float)cv.x;
  out[7] = __int_as_float(__float_as_int(1.25f)) + __uint_as_float(__float_as_uint(2.0f));
  out[8] = (float)(__popc(0xF0F0u) + __clz(1) + __ffs(8));
  out[9] = fmaxf(min(3, 4), max(2.0f, 1.0f)) + __fdividef(1.0f, 4.0f) + __frcp_rn(2.0f) + rsqrtf(4.0f);
  out[10] = __fmaf_rn(2.0f, 3.0f, 1.0f) + fmaf(1.0f, 1.0f, 1.0f) + exp2f(3.0f) + log2f(8.0f) + (isinf(INFINITY) ? 1.f : 0.f);
  out[11] = __expf(0.0f) + expf(0.0f) + __logf(1.0f) + logf(1.0f) + tanhf(0.0f) + sqrtf(16.0f) + fabsf(-1.0f);
}

// ---- thread schedules: the order in which threads start and leave a barrier ----
extern "C" __global__ void run_order(int* counter, int* first, int* second) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  first[t] = atomicAdd(&counter[2 * blockIdx.x], 1);
  __syncthreads();
  second[t] = atomicAdd(&counter[2 * blockIdx.x + 1], 1);
}

// ---- broken kernels: must fail with a message, never hang ----
extern "C" __global__ void bad_barrier(int* out) {
  if (threadIdx.x >= 128) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
extern "C" __global__ void bad_shfl_exited(int* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
extern "C" __global__ void bad_shfl_mask(int* out) {
  const unsigned mask = threadIdx.x == 0 ? 0xffffffffu : 0xfffffffeu;
  out[threadIdx.x] = __shfl_sync(mask, (int)threadIdx.x, 0);
}
extern "C" __global__ void bad_cross(int* out) {
  // warp 0 waits in a shuffle for lane 31, which waits at __syncthreads for warp 0
  if (threadIdx.x == 31) __syncthreads();
  else if (threadIdx.x < 32) out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
  else __syncthreads();
}
"""

KERNELS = ["rev256", "sync_preds", "shfl_cfg", "shfl_types", "votes", "warp_sync_order", "atomics", "smem_iso", "dyn_smem",
           "big_local", "overflow_big", "indices", "fmt_convert", "vec2_basics", "bad_barrier", "bad_shfl_exited", "bad_shfl_mask",
           "bad_cross", "run_order"]


@pytest.fixture(scope="module")
def mod() -> CpuModule:
    return CpuModule.from_source(SRC, KERNELS)


def run(mod, kernel, grid, block, *args, smem=0):
    mod.launch(Launch(kernel, grid, block, smem, list(args)))


# ---------------------------------------------------------------- barrier / smem
def test_barrier_reverse_through_shared_memory(mod):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4 * 256).astype(np.float32)
    y = np.zeros_like(x)
    run(mod, "rev256", (4, 1, 1), (256, 1, 1), x, y)
    np.testing.assert_array_equal(y, 2 * x)


def test_syncthreads_count_and_or(mod):
    preds = np.zeros((4, 160), np.int32)
    preds[1, ::3] = 5
    preds[2] = -1
    preds[3, 159] = 1
    out = np.zeros((4, 3), np.int32)
    run(mod, "sync_preds", (4, 1, 1), (160, 1, 1), preds, out)
    np.testing.assert_array_equal(out, [[0, 0, 0], [54, 0, 1], [160, 1, 1], [1, 0, 1]])


def test_shared_memory_private_per_block_concurrent(mod):
    bad = np.zeros(1, np.int32)
    for workers in (1, 2, 4):
        mod.workers = workers
        run(mod, "smem_iso", (64, 1, 1), (128, 1, 1), bad, np.int32(20))
    mod.workers = 0
    assert bad[0] == 0


def test_dynamic_shared_memory(mod):
    n, blocks = 96, 5
    out = np.zeros(n * blocks, np.float32)
    mis = np.zeros(1, np.uint32)
    run(mod, "dyn_smem", (blocks, 1, 1), (n, 1, 1), out, mis, smem=n * 4)
    exp = np.array([[b * 100.0 + (n - 1 - t) for t in range(n)] for b in range(blocks)], np.float32).ravel()
    np.testing.assert_array_equal(out, exp)
    assert mis[0] == 0


def test_big_local_array_on_fiber_stack(mod):
    idx = np.random.default_rng(1).permutation(256).astype(np.int32)
    out = np.zeros(128, np.float32)
    run(mod, "big_local", (2, 1, 1), (128, 1, 1), idx, out)
    t = np.arange(128)
    np.testing.assert_array_equal(out, (256 * t + 255 * 128 + 256).astype(np.float32))


def test_fiber_stack_overflow_is_an_error_and_stack_size_configurable(mod):
    idx = (np.arange(64, dtype=np.int32) * 600) % 40000
    out = np.zeros(64, np.float32)
    with pytest.raises(KernelRuntimeError, match=r"overflow_big.*thread \(0,0,0\).*stack overflow"):
        run(mod, "overflow_big", (2, 1, 1), (64, 1, 1), idx, out)
    big = CpuModule(mod.artifact, stack_size=1 << 20)
    big.launch(Launch("overflow_big", (2, 1, 1), (64, 1, 1), 0, [idx, out]))
    np.testing.assert_array_equal(out, idx.astype(np.float32))
    test_barrier_reverse_through_shared_memory(mod)  # the module still works


def test_stack_size_and_workers_from_the_environment(mod, monkeypatch):
    """KGEN_SIMT_STACK / KGEN_SIMT_THREADS are read through kgen.settings: honoured, or refused."""
    idx = (np.arange(64, dtype=np.int32) * 600) % 40000
    out = np.zeros(64, np.float32)
    monkeypatch.setenv("KGEN_SIMT_STACK", "1M")
    monkeypatch.setenv("KGEN_SIMT_THREADS", "2")
    run(mod, "overflow_big", (2, 1, 1), (64, 1, 1), idx, out)
    np.testing.assert_array_equal(out, idx.astype(np.float32))
    monkeypatch.setenv("KGEN_SIMT_STACK", "lots")
    with pytest.raises(KgenUserError, match=r"KGEN_SIMT_STACK='lots'.*k or M suffix"):
        run(mod, "overflow_big", (2, 1, 1), (64, 1, 1), idx, out)
    monkeypatch.delenv("KGEN_SIMT_STACK")
    monkeypatch.delenv("KGEN_SIMT_THREADS")
    test_barrier_reverse_through_shared_memory(mod)


def test_kept_stacks_start_every_block_afresh_and_keep_their_guard_pages(mod):
    """Stacks outlive a launch (kgen/runtime/fiber_stacks.py): one a block abandoned mid-way after an
    error, or a stack whose guard page a fiber hit, runs the next launch's fibers from their start,
    and an overflow on a reused stack is still caught."""
    mod = CpuModule(mod.artifact, workers=1)  # one worker: the calling thread's stacks, every launch
    idx = (np.arange(64, dtype=np.int32) * 600) % 40000
    big_idx = np.random.default_rng(1).permutation(256).astype(np.int32)
    out = np.zeros(128, np.float32)
    expect = (256 * np.arange(64) + 255 * 256 // 2 + 256).astype(np.float32)  # big_local, 64 threads
    run(mod, "big_local", (2, 1, 1), (64, 1, 1), big_idx, out)
    held = mod._lib.keep_stacks(-1)
    assert held > 0, "the stacks were not kept: nothing here is reused"
    for _ in range(2):
        with pytest.raises(KernelRuntimeError, match=r"bad_cross.*can never complete"):
            run(mod, "bad_cross", (1, 1, 1), (64, 1, 1), np.zeros(64, np.int32))  # fibers left mid-way
        out[:] = 0
        run(mod, "big_local", (2, 1, 1), (64, 1, 1), big_idx, out)
        np.testing.assert_array_equal(out[:64], expect)
        with pytest.raises(KernelRuntimeError, match=r"overflow_big.*thread \(0,0,0\).*stack overflow"):
            run(mod, "overflow_big", (2, 1, 1), (64, 1, 1), idx, out)
        out[:] = 0
        run(mod, "big_local", (2, 1, 1), (64, 1, 1), big_idx, out)
        np.testing.assert_array_equal(out[:64], expect)
    assert mod._lib.keep_stacks(-1) == held  # the same stacks throughout


def test_indices_3d(mod):
    grid, block = (3, 2, 2), (4, 3, 2)
    nb, nt = 12, 24
    out = np.zeros(nb * nt * 4, np.uint32)
    run(mod, "indices", grid, block, out)
    out = out.reshape(nb, nt, 4)
    for bz in range(2):
        for by in range(2):
            for bx in range(3):
                bl = bx + 3 * (by + 2 * bz)
                for tz in range(2):
                    for ty in range(3):
                        for tx in range(4):
                            tl = tx + 4 * (ty + 3 * tz)
                            assert list(out[bl, tl]) == [tx | ty << 8 | tz << 16, bx | by << 8 | bz << 16,
                                                         4 | 3 << 8 | 2 << 16, 3 | 2 << 8 | 2 << 16]


# ---------------------------------------------------------------- warp shuffles
def shfl_model(op: int, lane: int, arg: int, width: int, mask: int, vals) -> int | None:
    """CUDA Programming Guide semantics of __shfl_*_sync; None where CUDA leaves the result undefined."""
    base = (lane // width) * width
    if op == 0:  # idx: srcLane modulo width, inside the caller's sub-group
        src = base + arg % width
    elif op == 1:  # up: lower `delta` lanes of each sub-group keep their own value
        src = lane - arg if lane - base >= arg else lane
    elif op == 2:  # down: upper `delta` lanes keep their own value
        src = lane + arg if lane - base + arg < width else lane
    else:  # xor: reading from a later sub-group returns the caller's own value
        src = lane ^ arg
        if src >= base + width:
            src = lane
    if not (mask >> src) & 1:
        return None  # source lane not participating: undefined
    return int(vals[src])


def test_shuffles_all_flavours_masks_widths(mod):
    rng = np.random.default_rng(2)
    masks = [FULL, 0x0000FFFF, 0xFFFF0000, 0xAAAAAAAA, 0x0F0F0F0F, 0x00000001, 0x80000001,
             int(rng.integers(1, 2**32))]
    cfgs = []
    for op in range(4):
        for width in (1, 2, 4, 8, 16, 32):
            for mask in masks:
                for pattern in range(3):
                    if pattern == 0:
                        args = np.full(32, int(rng.integers(0, 32)))
                    elif pattern == 1:
                        args = rng.integers(0, 32, 32)
                    else:
                        args = np.full(32, [1, 2, 16, 31][op % 4] if op else 33)  # idx: out-of-range srcLane
                    cfgs.append((op, width, mask, args))
    nb = len(cfgs)
    vals = rng.integers(-(2**31), 2**31, (nb, 32)).astype(np.int32)
    args = np.stack([c[3] for c in cfgs]).astype(np.int32)
    ops = np.array([c[0] for c in cfgs], np.int32)
    widths = np.array([c[1] for c in cfgs], np.int32)
    masks_a = np.array([c[2] for c in cfgs], np.uint32)
    out = np.zeros((nb, 32), np.int32)
    run(mod, "shfl_cfg", (nb, 1, 1), (32, 1, 1), vals, args, ops, widths, masks_a, out)
    checked = 0
    for b, (op, width, mask, _) in enumerate(cfgs):
        for lane in range(32):
            if not (mask >> lane) & 1:
                assert out[b, lane] == -1
                continue
            exp = shfl_model(op, lane, int(args[b, lane]), width, mask, vals[b])
            if exp is not None:
                assert out[b, lane] == exp, (op, width, hex(mask), lane, int(args[b, lane]))
                checked += 1
    assert checked > 5000


def test_shuffle_value_types(mod):
    out = np.zeros((8, 4, 32), np.float64)
    run(mod, "shfl_types", (1, 1, 1), (32, 1, 1), out)
    lane = np.arange(32)
    h = lambda x: np.float32(x).astype(np.float16).astype(np.float64)  # noqa: E731
    bf = lambda x: np.float32(x).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    values = [
        (-1000 * lane - 7).astype(np.float64), (0x80000000 + lane).astype(np.float64),
        (np.float32(1.5) * lane + np.float32(0.25)).astype(np.float64), 1e300 * (lane + 1.0),
        ((lane.astype(np.int64) << 40) + lane).astype(np.float64), h(0.5 * lane), bf(-2.0 * lane),
        lane.astype(np.float64),
    ]
    up = np.where(lane >= 5, lane - 5, lane)
    down = np.where(lane + 2 < 32, lane + 2, lane)
    for k, v in enumerate(values):
        np.testing.assert_array_equal(out[k, 0], v[lane ^ 7], err_msg=f"type {k} xor")
        np.testing.assert_array_equal(out[k, 1], v[np.full(32, 3)], err_msg=f"type {k} idx")
        np.testing.assert_array_equal(out[k, 2], v[down], err_msg=f"type {k} down")
        np.testing.assert_array_equal(out[k, 3], v[up], err_msg=f"type {k} up")


def test_votes_and_activemask(mod):
    rng = np.random.default_rng(3)
    masks = np.array([FULL, FULL, FULL, 0x0000FFFF, 0xAAAAAAAA, 0x00000004, 0x80000000,
                      int(rng.integers(1, 2**32))], np.uint32)
    nb = len(masks)
    preds = rng.integers(0, 2, (nb, 32)).astype(np.int32) * rng.integers(1, 100, (nb, 32)).astype(np.int32)
    preds[0] = 0
    preds[1] = 7
    out = np.zeros((nb, 32, 4), np.uint32)
    run(mod, "votes", (nb, 1, 1), (32, 1, 1), preds, masks, out)
    for b in range(nb):
        m = int(masks[b])
        ballot = sum(1 << lane for lane in range(32) if (m >> lane) & 1 and preds[b, lane])
        for lane in range(32):
            if (m >> lane) & 1:
                assert out[b, lane, 0] == int(ballot != 0)
                assert out[b, lane, 1] == int(ballot == m)
                assert out[b, lane, 2] == ballot
            else:
                assert out[b, lane, 0] == 0xDEADBEEF
            # __activemask: the warp's lanes that have not exited: always the caller; with a full-mask
            # vote after it, no lane can have exited yet
            act = int(out[b, lane, 3])
            assert (act >> lane) & 1
            if m == FULL:
                assert act == FULL


def test_syncwarp_orders_warp_memory(mod):
    out = np.zeros(64, np.int32)
    run(mod, "warp_sync_order", (1, 1, 1), (64, 1, 1), out)
    t = np.arange(64)
    np.testing.assert_array_equal(out, t * 10 + 1)


# ---------------------------------------------------------------- atomics
def test_atomics_under_contention(mod):
    blocks, threads = 64, 128
    n = blocks * threads
    ci, cu = np.zeros(1, np.int32), np.zeros(1, np.uint32)
    cf, cd = np.zeros(1, np.float32), np.zeros(1, np.float64)
    imax, imin = np.array([-(2**31)], np.int32), np.array([2**31 - 1], np.int32)
    umax, umin = np.zeros(1, np.uint32), np.array([2**32 - 1], np.uint32)
    cas64, cas32, casu = np.zeros(1, np.uint64), np.zeros(1, np.int32), np.zeros(1, np.uint32)
    slot, olds = np.array([-1], np.int32), np.zeros(n, np.int32)
    add64 = np.zeros(1, np.uint64)
    mod.workers = 2
    run(mod, "atomics", (blocks, 1, 1), (threads, 1, 1), ci, cu, cf, cd, imax, imin, umax, umin, cas64, cas32,
        casu, slot, olds, add64)
    mod.workers = 0
    assert ci[0] == n and cu[0] == 2 * n and cf[0] == n and cd[0] == 0.5 * n and add64[0] == 3 * n
    assert imax[0] == n - 1 - 1000 and imin[0] == 1000 - (n - 1)
    assert umax[0] == 3 * (n - 1) and umin[0] == 100000 - (n - 1)
    assert cas64[0] == n and cas32[0] == n and casu[0] == n
    assert sorted([*olds.tolist(), int(slot[0])]) == [-1, *range(n)]


def test_vector_types_and_intrinsics(mod):
    out = np.zeros(12, np.float32)
    run(mod, "vec2_basics", (1, 1, 1), (1, 1, 1), out)
    np.testing.assert_array_equal(out[:8], [3.0, -4.5, 9.0, 0.25, 5.0, 6.0, 250.0, 3.25])
    assert out[8] == 8 + 31 + 4
    assert out[9] == 3.0 + 0.25 + 0.5 + 0.5
    assert out[10] == 7.0 + 2.0 + 8.0 + 3.0 + 1.0
    assert out[11] == 1 + 1 + 0 + 0 + 0 + 4 + 1


# ---------------------------------------------------------------- number formats
def _float_sweep() -> np.ndarray:
    rng = np.random.default_rng(4)
    halves = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    bfs = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    # midpoints between neighbouring fp16 / bf16 values exercise round-to-nearest-even ties
    h_sorted = np.unique(halves[np.isfinite(halves)])
    mids = ((h_sorted[:-1].astype(np.float64) + h_sorted[1:]) / 2).astype(np.float32)
    bf_mid = ((np.arange(2**16, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    rnd = rng.integers(0, 2**32, 2**18, dtype=np.uint32).view(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 449.0, 464.0, 480.0, 1e6, -1e6, 57344.0,
                         61440.0, 65504.0, 65520.0, 1e-10, -1e-10, 2.0**-10, 2.0**-17, 2.0**-20], np.float32)
    span = np.linspace(-1000, 1000, 20001, dtype=np.float32)
    return np.concatenate([halves, bfs, mids, bf_mid, rnd, specials, span]).astype(np.float32)


@pytest.fixture(scope="module")
def formats(mod):
    f = _float_sweep()
    nf = f.size
    h16 = np.arange(2**16, dtype=np.uint16)
    h8 = np.arange(256, dtype=np.uint8)
    res = {
        "f2h": np.zeros(nf, np.uint16), "f2bf": np.zeros(nf, np.uint16), "h2f": np.zeros(2**16, np.float32),
        "bf2f": np.zeros(2**16, np.float32), "f2e4": np.zeros(nf, np.uint8), "f2e5": np.zeros(nf, np.uint8),
        "e42f": np.zeros(256, np.float32), "e52f": np.zeros(256, np.float32), "ctor_e4": np.zeros(nf, np.uint8),
    }
    run(mod, "fmt_convert", (64, 1, 1), (128, 1, 1), f, h16, h8, res["f2h"], res["f2bf"], res["h2f"], res["bf2f"],
        res["f2e4"], res["f2e5"], res["e42f"], res["e52f"], res["ctor_e4"], np.int32(2**16), np.int32(256),
        np.int32(nf))
    res["f"] = f
    return res


def assert_same_floats(got: np.ndarray, exp: np.ndarray, what: str) -> None:
    got = np.asarray(got, np.float64)
    exp = np.asarray(exp, np.float64)
    nan_g, nan_e = np.isnan(got), np.isnan(exp)
    assert (nan_g == nan_e).all(), f"{what}: NaN-ness differs at {np.flatnonzero(nan_g != nan_e)[:10]}"
    g, e = got[~nan_g], exp[~nan_e]
    same = (g == e) & (np.signbit(g) == np.signbit(e))
    assert same.all(), f"{what}: first mismatches {[(x, y) for x, y in zip(g[~same][:5], e[~same][:5], strict=True)]}"


def test_fp16_all_encodings_both_directions(formats):
    ref = np.arange(2**16, dtype=np.uint16).view(np.float16)
    assert_same_floats(formats["h2f"], ref.astype(np.float32), "half->float")
    # float -> half: the 2^16 half values (as floats) round-trip to the same bits, NaNs stay NaN
    back = formats["f2h"][: 2**16]
    nan = np.isnan(ref)
    assert (back[~nan] == np.arange(2**16, dtype=np.uint16)[~nan]).all()
    assert np.isnan(back[nan].view(np.float16)).all()
    assert_same_floats(formats["f2h"].view(np.float16), formats["f"].astype(np.float16), "float->half sweep")


def test_bf16_all_encodings_both_directions(formats):
    ref = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    assert_same_floats(formats["bf2f"], ref.astype(np.float32), "bf16->float")
    back = formats["f2bf"][2**16: 2**17]
    nan = np.isnan(ref.astype(np.float32))
    assert (back[~nan] == np.arange(2**16, dtype=np.uint16)[~nan]).all()
    exp = formats["f"].astype(ml_dtypes.bfloat16)
    assert_same_floats(formats["f2bf"].view(ml_dtypes.bfloat16).astype(np.float32), exp.astype(np.float32),
                       "float->bf16 sweep")


def test_bf16_matches_torch(formats):
    torch = pytest.importorskip("torch")
    f = torch.from_numpy(formats["f"])
    exp = f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = formats["f2bf"]
    nan = np.isnan(formats["f"])
    assert (got[~nan] == exp[~nan]).all()


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_all_encodings_and_saturating_conversion(formats, kind):
    dt = ml_dtypes.float8_e4m3fn if kind == "e4m3" else ml_dtypes.float8_e5m2
    ref = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    assert_same_floats(formats[f"e{kind[1]}2f"], ref, f"{kind}->float")
    f = formats["f"]
    fmax = float(ml_dtypes.finfo(dt).max)
    clamped = np.where(np.isnan(f), f, np.clip(f, -fmax, fmax)).astype(np.float32)
    exp = clamped.astype(dt).astype(np.float32)
    got = formats[f"f2e{kind[1]}"].view(dt).astype(np.float32)
    assert_same_floats(got, exp, f"float->{kind} (SATFINITE)")
    if kind == "e4m3":  # the class constructor saturates too
        assert_same_floats(formats["ctor_e4"].view(dt).astype(np.float32), exp, "__nv_fp8_e4m3(float)")
    finite = ref[np.isfinite(ref)]
    assert np.isin(finite, got).sum() > 0.9 * finite.size  # the sweep reaches almost every encoding


# ---------------------------------------------------------------- errors
def test_divergent_barrier_is_an_error_naming_kernel_block_thread(mod):
    out = np.zeros(256, np.int32)
    with pytest.raises(KernelRuntimeError) as ei:
        run(mod, "bad_barrier", (2, 1, 1), (256, 1, 1), out)
    msg = str(ei.value)
    assert "bad_barrier" in msg and "__syncthreads" in msg
    assert "block (" in msg and "thread (" in msg, msg


def test_shuffle_with_exited_lane_is_an_error(mod):
    out = np.zeros(32, np.int32)
    with pytest.raises(KernelRuntimeError) as ei:
        run(mod, "bad_shfl_exited", (1, 1, 1), (32, 1, 1), out)
    msg = str(ei.value)
    assert "bad_shfl_exited" in msg and "block (0,0,0)" in msg and "__shfl_xor_sync" in msg
    assert "(5,0,0)" in msg, msg


def test_shuffle_with_mismatched_masks_is_an_error(mod):
    with pytest.raises(KernelRuntimeError, match=r"bad_shfl_mask.*mask"):
        run(mod, "bad_shfl_mask", (1, 1, 1), (32, 1, 1), np.zeros(32, np.int32))


def test_cross_wait_deadlock_is_an_error(mod):
    with pytest.raises(KernelRuntimeError, match=r"bad_cross.*can never complete"):
        run(mod, "bad_cross", (1, 1, 1), (64, 1, 1), np.zeros(64, np.int32))


def test_module_usable_after_error_and_partial_warp_full_mask(mod):
    # a full-mask __syncwarp in the last, partial warp of a 40-thread block names lanes that do not exist
    with pytest.raises(KernelRuntimeError, match=r"warp_sync_order.*thread \(32,0,0\).*do not exist"):
        run(mod, "warp_sync_order", (1, 1, 1), (40, 1, 1), np.zeros(64, np.int32))
    test_barrier_reverse_through_shared_memory(mod)


def test_argument_checks(mod):
    x = np.zeros(256, np.float32)
    with pytest.raises(ArgumentError, match="takes 2 arguments"):
        run(mod, "rev256", (1, 1, 1), (256, 1, 1), x)
    with pytest.raises(ArgumentError, match="argument 1"):
        run(mod, "rev256", (1, 1, 1), (256, 1, 1), x, np.float32(1))
    with pytest.raises(ArgumentError, match="int32"):
        run(mod, "smem_iso", (1, 1, 1), (128, 1, 1), np.zeros(1, np.int32), np.int64(3))
    with pytest.raises(ArgumentError, match="unknown kernel"):
        run(mod, "nope", (1, 1, 1), (1, 1, 1))
    with pytest.raises(KernelRuntimeError, match="invalid block"):
        run(mod, "rev256", (1, 1, 1), (2048, 1, 1), x, x)
    assert mod.signature("smem_iso") == ("p", "i4")


def test_torch_tensors_as_arrays(mod):
    torch = pytest.importorskip("torch")
    x = torch.arange(256, dtype=torch.float32)
    y = torch.zeros(256, dtype=torch.float32)
    run(mod, "rev256", (1, 1, 1), (256, 1, 1), x, y)
    assert torch.equal(y, 2 * x)


_FORK_MOD: list[CpuModule] = []


def _run_order(mod, blocks: int = 3, n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    counter = np.zeros(2 * blocks, np.int32)
    first, second = np.full((blocks, n), -1, np.int32), np.full((blocks, n), -1, np.int32)
    run(mod, "run_order", (blocks, 1, 1), (n, 1, 1), counter, first, second)
    return first, second


def test_schedules_order_threads_at_start_and_at_barriers(mod):
    n = 96
    first, second = _run_order(mod)  # default (no race detection): FIFO
    assert (first == np.arange(n)).all()
    assert (second == np.roll(np.arange(n), -1)).all()  # the last to arrive goes on first, then arrival order
    first, second = _run_order(CpuModule(mod.artifact, schedule="reverse"))
    assert (first == np.arange(n)[::-1]).all() and (second == np.arange(n)[::-1]).all()
    shuffled = [_run_order(CpuModule(mod.artifact, schedule="shuffle", seed=s)) for s in (1, 1, 2)]
    for f, g in shuffled:
        assert all(sorted(row) == list(range(n)) for row in [*f.tolist(), *g.tolist()])
        assert not (f == np.arange(n)).all(axis=1).any() and not (f[0] == f[1]).all()
    np.testing.assert_array_equal(shuffled[0][0], shuffled[1][0])  # a seed repeats its orders
    assert not np.array_equal(shuffled[0][0], shuffled[2][0])
    first, _ = _run_order(CpuModule(mod.artifact, schedule="mixed", seed=4), blocks=12)
    kinds = {"fifo" if (r == np.arange(n)).all() else "reverse" if (r == np.arange(n)[::-1]).all() else "shuffle"
             for r in first}
    assert kinds == {"fifo", "reverse", "shuffle"}  # mixed: each block one of the three


@pytest.fixture(scope="module")
def race_mod() -> CpuModule:
    return CpuModule.from_source(SRC, KERNELS, race_check=True)


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "shuffle", "mixed"])
def test_race_mode_keeps_the_runtime_semantics_under_every_schedule(race_mod, schedule):
    """The runtime's own correct kernels, instrumented: no race reported, same results
    (barriers, __syncwarp ordering, block-private and dynamic shared memory, shuffles, votes,
    atomics, 3-D indices), whatever the thread order."""
    m = CpuModule(race_mod.artifact, schedule=schedule, seed=9)
    assert m.artifact.race_check
    test_barrier_reverse_through_shared_memory(m)
    test_syncthreads_count_and_or(m)
    test_shared_memory_private_per_block_concurrent(m)
    test_dynamic_shared_memory(m)
    test_syncwarp_orders_warp_memory(m)
    test_shuffles_all_flavours_masks_widths(m)
    test_votes_and_activemask(m)
    test_atomics_under_contention(m)
    test_indices_3d(m)
    test_divergent_barrier_is_an_error_naming_kernel_block_thread(m)


def _fork_child(mod=None):
    mod = mod or _FORK_MOD[0]  # in the child: inherited through fork, not pickled
    x = np.arange(4 * 256, dtype=np.float32)
    y = np.zeros_like(x)
    run(mod, "rev256", (4, 1, 1), (256, 1, 1), x, y)
    return bool((y == 2 * x).all())


def test_launch_in_forked_child(mod):
    """A fork()ed child has none of the parent's pool threads: it must start its own, not hang."""
    mod.workers = 2
    try:
        assert _fork_child(mod)  # the parent's pool now has a helper thread
        _FORK_MOD[:] = [mod]
        ctx = mp.get_context("fork")
        with ctx.Pool(1) as pool:
            assert pool.apply_async(_fork_child).get(timeout=60)
    finally:
        mod.workers = 0
        _FORK_MOD.clear()


def test_portable_ucontext_fallback():
    """The swapcontext fallback (used off x86-64), forced with -DKGEN_SIMT_UCONTEXT."""
    src = SRC.split("// ---- shuffles:")[0]  # rev256 + sync_preds only: a small build
    m = CpuModule.from_source(src, ["rev256", "sync_preds"], extra_flags=["-DKGEN_SIMT_UCONTEXT"])
    test_barrier_reverse_through_shared_memory(m)
    test_syncthreads_count_and_or(m)


# ---------------------------------------------------------------- sanitizer
SAN_SRC = r"""
extern "C" __global__ void oob_read(const float* x, float* y, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  y[t] = x[t + n - 8] * 2.0f;  // threads >= 8 read past the end of x (n elements)
}
extern "C" __global__ void in_range(const float* x, float* y, int n) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  s[t] = t < n ? x[t] : 0.0f;
  __syncthreads();
  if (t < n) y[t] = s[(t + 1) % n] + __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
"""


@pytest.fixture(scope="module")
def san_mod() -> CpuModule:
    return CpuModule.from_source(SAN_SRC, ["oob_read", "in_range"], sanitize=True)


def test_sanitizer_catches_out_of_range_read(san_mod):
    x = np.ones(40, np.float32)
    y = np.zeros(64, np.float32)
    with pytest.raises(KernelRuntimeError) as ei:
        san_mod.launch(Launch("oob_read", (1, 1, 1), (64, 1, 1), 0, [x, y, np.int32(40)]))
    msg = str(ei.value)
    assert "oob_read" in msg and "AddressSanitizer" in msg and "heap-buffer-overflow" in msg, msg


def test_sanitized_launch_copies_results_back(san_mod):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    san_mod.launch(Launch("in_range", (1, 1, 1), (64, 1, 1), 0, [x, y, np.int32(64)]))
    np.testing.assert_array_equal(y, np.roll(x, -1) + 1.0)
