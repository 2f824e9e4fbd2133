"""The CPU backend's cp.async (templates/simt/kgen_simt_async.h, used through
templates/common/async_copy.cuh) against the PTX ISA's semantics, and the packed
conversions of templates/common/convert.cuh against the scalar ones, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kgen.compile.nvrtc import compile_cubin
from kgen.errors import KernelRuntimeError
from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

POISON = np.uint32(0xFFFFFFFF)  # what an issued, not yet landed copy leaves in shared memory


def _headers(*names: str) -> str:
    common = templates_dir() / "common"
    return "\n".join((common / n).read_text() for n in names)


PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"

ASYNC_SRC = r"""
// Each thread copies 16 bytes of src into shared memory; snapshots (4 words each) go to out:
// [0] before the wait, [1] after wait_group, [2] after a second group's wait.
extern "C" __global__ void land_at_wait(const unsigned* src, unsigned* out) {
  __shared__ __align__(16) unsigned s[2 * 64 * 4];
  const int t = threadIdx.x;
  unsigned* mine = s + t * 4;
  unsigned* other = s + (64 + t) * 4;
  kgen::cp_async<16>(mine, src + t * 4, 16);
  kgen::cp_async_commit();
  kgen::cp_async<16>(other, src + (64 + t) * 4, 16);
  kgen::cp_async_commit();
  for (int i = 0; i < 4; ++i) out[(t * 3 + 0) * 4 + i] = mine[i];
  kgen::cp_async_wait<1>();  // the first group has landed, the second may not have
  for (int i = 0; i < 4; ++i) out[(t * 3 + 1) * 4 + i] = mine[i] ^ other[i];
  kgen::cp_async_wait<0>();
  for (int i = 0; i < 4; ++i) out[(t * 3 + 2) * 4 + i] = other[i];
}

// Three groups A, B (committed) and C (not committed); a word of out per stage and copy:
// after wait<1>, wait<0>, wait_all, for A, B, C.
extern "C" __global__ void groups(const unsigned* src, unsigned* out) {
  __shared__ __align__(16) unsigned s[3];
  kgen::cp_async<4>(s + 0, src + 0, 4);
  kgen::cp_async_commit();
  kgen::cp_async<4>(s + 1, src + 1, 4);
  kgen::cp_async_commit();
  kgen::cp_async<4>(s + 2, src + 2, 4);
  kgen::cp_async_wait<1>();
  out[0] = s[0]; out[1] = s[1]; out[2] = s[2];
  kgen::cp_async_wait<0>();  // C is in no committed group: still pending
  out[3] = s[0]; out[4] = s[1]; out[5] = s[2];
  kgen::cp_async_wait_all();  // commits C, then waits for it
  out[6] = s[0]; out[7] = s[1]; out[8] = s[2];
}

// Every cp-size with every src-size: bytes past src-size are zero-filled. Thread t copies
// size 4 << (t / 17) with src-size t % 17 (clipped to the size).
extern "C" __global__ void zero_fill(const unsigned char* src, unsigned char* out) {
  __shared__ __align__(16) unsigned char s[51 * 16];
  const int t = threadIdx.x, size = 4 << (t / 17), n = min(t % 17, size);
  unsigned char* d = s + t * 16;
  for (int i = 0; i < 16; ++i) d[i] = 0x55;
  if (size == 4) kgen::cp_async<4>(d, src + t * 16, n);
  if (size == 8) kgen::cp_async<8>(d, src + t * 16, n);
  if (size == 16) kgen::cp_async<16>(d, src + t * 16, n);
  kgen::cp_async_wait_all();
  for (int i = 0; i < 16; ++i) out[t * 16 + i] = d[i];
}

// Thread 0 copies for thread 1, which reads after a barrier; `wait_first` puts thread 0's
// wait before the barrier (correct) or after it (thread 1 reads too early).
extern "C" __global__ void cross_thread(const unsigned* src, unsigned* out, int wait_first) {
  __shared__ __align__(16) unsigned s[4];
  if (threadIdx.x == 0) {
    kgen::cp_async<16>(s, src, 16);
    kgen::cp_async_commit();
    if (wait_first) kgen::cp_async_wait<0>();
  }
  __syncthreads();
  if (threadIdx.x == 1) for (int i = 0; i < 4; ++i) out[i] = s[i];
  if (threadIdx.x == 0 && !wait_first) kgen::cp_async_wait<0>();
}

// Block 0 issues and exits without waiting; block 1 (same worker) only waits: nothing of
// block 0 may land in its shared memory.
extern "C" __global__ void left_pending(const unsigned* src, unsigned* out) {
  __shared__ __align__(16) unsigned s[4];
  if (blockIdx.x == 0) {
    kgen::cp_async<16>(s, src, 16);
    kgen::cp_async_commit();
    return;
  }
  kgen::cp_async_wait_all();
  for (int i = 0; i < 4; ++i) out[i] = s[i];
}

extern "C" __global__ void misaligned(const unsigned* src, int shift) {
  __shared__ __align__(16) unsigned char s[32];
  kgen::cp_async<16>(s + shift, src, 16);
  kgen::cp_async_wait_all();
}

extern "C" __global__ void too_many_bytes(const unsigned* src) {
  __shared__ __align__(16) unsigned s[2];
  kgen::cp_async<8>(s, src, 9);
  kgen::cp_async_wait_all();
}

// Race detection: thread 1 reads thread 0's copy after a barrier that comes before thread 0's
// wait (wait_first = 0), or after thread 0 waited (1); `reuse`: thread 0 refills the buffer
// while thread 1 may still read it.
extern "C" __global__ void async_race(const unsigned* src, unsigned* out, int wait_first, int reuse) {
  __shared__ __align__(16) unsigned s[4];
  if (threadIdx.x == 0) {
    kgen::cp_async<16>(s, src, 16);
    kgen::cp_async_commit();
    if (wait_first) kgen::cp_async_wait<0>();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (!wait_first) kgen::cp_async_wait<0>();
    if (reuse) {
      kgen::cp_async<16>(s, src + 4, 16);
      kgen::cp_async_wait_all();
    }
  }
  if (threadIdx.x == 1) for (int i = 0; i < 4; ++i) out[i] = s[i];
}
"""
ASYNC_KERNELS = ["land_at_wait", "groups", "zero_fill", "cross_thread", "left_pending", "misaligned",
                 "too_many_bytes", "async_race"]


def _source() -> str:
    return PRELUDE + _headers("platform.cuh", "async_copy.cuh") + ASYNC_SRC


@pytest.fixture(scope="module")
def mod() -> CpuModule:
    return CpuModule.from_source(_source(), ASYNC_KERNELS)


def run(mod, kernel, grid, block, *args):
    mod.launch(Launch(kernel, (grid, 1, 1), (block, 1, 1), 0, list(args)))


def _words(rng, n) -> np.ndarray:
    return rng.integers(0, 2**31, n, dtype=np.uint32)  # never the poison pattern


def test_data_lands_at_the_wait_not_at_issue(mod):
    src = _words(np.random.default_rng(0), 2 * 64 * 4)
    out = np.zeros(64 * 3 * 4, np.uint32)
    run(mod, "land_at_wait", 1, 64, src, out)
    out = out.reshape(64, 3, 4)
    mine, other = src[:256].reshape(64, 4), src[256:].reshape(64, 4)
    assert (out[:, 0] == POISON).all(), "read before the wait: the copy must not have landed"
    assert (out[:, 1] == (mine ^ POISON)).all(), "wait_group 1: the first group landed, the second not"
    assert (out[:, 2] == other).all()


def test_wait_group_counts_committed_groups_and_wait_all_commits(mod):
    src = np.asarray([11, 22, 33], np.uint32)
    out = np.zeros(9, np.uint32)
    run(mod, "groups", 1, 1, src, out)
    assert out.tolist() == [11, POISON, POISON, 11, 22, POISON, 11, 22, 33]


def test_src_size_zero_fills_the_rest(mod):
    src = np.arange(51 * 16, dtype=np.uint8) % 251 + 1
    out = np.zeros(51 * 16, np.uint8)
    run(mod, "zero_fill", 1, 51, src, out)
    for t in range(51):
        size, n = 4 << (t // 17), min(t % 17, 4 << (t // 17))
        row = out[t * 16:(t + 1) * 16]
        assert row[:n].tolist() == src[t * 16:t * 16 + n].tolist(), t
        assert (row[n:size] == 0).all(), t
        assert (row[size:] == 0x55).all(), t  # beyond cp-size: untouched


@pytest.mark.parametrize("wait_first", [1, 0])
def test_another_threads_copy_is_visible_after_its_wait_and_a_barrier(mod, wait_first):
    src = np.asarray([1, 2, 3, 4], np.uint32)
    out = np.zeros(4, np.uint32)
    # reverse: after the barrier thread 1 runs before thread 0 (one order a GPU may take)
    run(CpuModule(mod.artifact, schedule="reverse"), "cross_thread", 1, 32, src, out, np.int32(wait_first))
    assert out.tolist() == ([1, 2, 3, 4] if wait_first else [POISON] * 4)


def test_copies_left_pending_by_a_block_never_land_in_the_next():
    one_worker = CpuModule(CpuModule.from_source(_source(), ASYNC_KERNELS).artifact, workers=1)
    out = np.zeros(4, np.uint32)
    run(one_worker, "left_pending", 2, 1, np.asarray([5, 6, 7, 8], np.uint32), out)
    assert out.tolist() == [POISON] * 4


def test_misaligned_and_oversized_copies_are_errors(mod):
    src = np.zeros(8, np.uint32)
    with pytest.raises(KernelRuntimeError, match=r"cp\.async: misaligned address .* 16 bytes"):
        run(mod, "misaligned", 1, 1, src, np.int32(4))
    run(mod, "misaligned", 1, 1, src, np.int32(16))  # aligned: fine
    with pytest.raises(KernelRuntimeError, match="src-size 9 exceeds cp-size 8"):
        run(mod, "too_many_bytes", 1, 1, src)


@pytest.fixture(scope="module")
def race_mod() -> CpuModule:
    return CpuModule.from_source(_source(), ASYNC_KERNELS, race_check=True)


def test_race_detection_sees_where_copies_land(race_mod):
    src = np.arange(8, dtype=np.uint32)
    out = np.zeros(4, np.uint32)
    run(race_mod, "async_race", 1, 32, src, out, np.int32(1), np.int32(0))
    assert out.tolist() == [0, 1, 2, 3]
    with pytest.raises(KernelRuntimeError, match="shared-memory race on __shared__ 's'"):
        run(race_mod, "async_race", 1, 32, src, out, np.int32(0), np.int32(0))  # landed after the barrier
    with pytest.raises(KernelRuntimeError, match="shared-memory race on __shared__ 's'"):
        run(race_mod, "async_race", 1, 32, src, out, np.int32(1), np.int32(1))  # refilled while being read


def test_async_copy_header_compiles_for_the_gpu():
    """The PTX side (sm_80+: cp.async) and the plain-copy fallback (older archs) both compile."""
    src = PRELUDE + _headers("platform.cuh", "async_copy.cuh") + r"""
extern "C" __global__ void k(const uint4* g, uint4* out, int n) {
  __shared__ uint4 s[64];
  kgen::cp_async<16>(s + threadIdx.x, g + threadIdx.x, n);
  kgen::cp_async<8>(reinterpret_cast<uint2*>(s + 32 + threadIdx.x % 32), g + threadIdx.x, 8);
  kgen::cp_async_commit();
  kgen::cp_async_wait<0>();
  kgen::cp_async_wait_all();
  __syncthreads();
  out[threadIdx.x] = s[63 - threadIdx.x];
}
"""
    for arch in ("sm_75", "sm_80", "sm_90"):
        assert "k" in compile_cubin(src, arch).resources


# ---------------------------------------------------------------- packed conversions
CONVERT_SRC = r"""
// For each type: every word of `words` through Widen<T>::word (packed) and element by
// element through to_float (scalar); float results as bits.
template <class T>
__device__ void both(const unsigned* words, int n, unsigned* packed, unsigned* scalar) {
  constexpr int PER = kgen::Widen<T>::PER_WORD;
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < n; w += gridDim.x * blockDim.x) {
    float f[PER];
    kgen::Widen<T>::word(words[w], f);
    T e[PER];
    memcpy(e, &words[w], 4);
    for (int i = 0; i < PER; ++i) {
      packed[w * PER + i] = __float_as_uint(f[i]);
      scalar[w * PER + i] = __float_as_uint(kgen::to_float(e[i]));
    }
  }
}
extern "C" __global__ void cvt_half(const unsigned* w, int n, unsigned* p, unsigned* s) { both<__half>(w, n, p, s); }
extern "C" __global__ void cvt_bf16(const unsigned* w, int n, unsigned* p, unsigned* s) { both<__nv_bfloat16>(w, n, p, s); }
extern "C" __global__ void cvt_e4m3(const unsigned* w, int n, unsigned* p, unsigned* s) { both<__nv_fp8_e4m3>(w, n, p, s); }
extern "C" __global__ void cvt_e5m2(const unsigned* w, int n, unsigned* p, unsigned* s) { both<__nv_fp8_e5m2>(w, n, p, s); }
extern "C" __global__ void cvt_int8(const unsigned* w, int n, unsigned* p, unsigned* s) { both<kgen::i8>(w, n, p, s); }
extern "C" __global__ void cvt_float(const unsigned* w, int n, unsigned* p, unsigned* s) { both<float>(w, n, p, s); }

// load_as_float over N elements (16-byte pieces, a word, or element by element) vs to_float.
template <class T, int N>
__device__ void load_n(const T* x, float* out) {
  __shared__ __align__(16) T s[64];
  for (int i = threadIdx.x; i < 64; i += blockDim.x) s[i] = x[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    float f[N];
    kgen::load_as_float<T, N>(s + N, f);
    for (int i = 0; i < N; ++i) out[i] = f[i] - kgen::to_float(x[N + i]);
  }
}
extern "C" __global__ void load_fp8_32(const __nv_fp8_e4m3* x, float* out) { load_n<__nv_fp8_e4m3, 32>(x, out); }
extern "C" __global__ void load_half_1(const __half* x, float* out) { load_n<__half, 1>(x, out); }
extern "C" __global__ void load_bf16_2(const __nv_bfloat16* x, float* out) { load_n<__nv_bfloat16, 2>(x, out); }
extern "C" __global__ void load_int8_8(const kgen::i8* x, float* out) { load_n<kgen::i8, 8>(x, out); }

extern "C" __global__ void byte_perm(const unsigned* x, const unsigned* y, const unsigned* s, unsigned* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __byte_perm(x[i], y[i], s[i]);
}
"""
CONVERSIONS = {"cvt_half": 2, "cvt_bf16": 2, "cvt_e4m3": 4, "cvt_e5m2": 4, "cvt_int8": 4, "cvt_float": 1}
LOADS = ["load_fp8_32", "load_half_1", "load_bf16_2", "load_int8_8"]


@pytest.fixture(scope="module")
def cvt_mod() -> CpuModule:
    src = PRELUDE + _headers("platform.cuh", "convert.cuh") + CONVERT_SRC
    return CpuModule.from_source(src, [*CONVERSIONS, *LOADS, "byte_perm"])


def _every_encoding(per_word: int) -> np.ndarray:
    """Words holding every encoding of an element of 32 / per_word bits at least once."""
    if per_word == 4:  # 8-bit elements: bytes 0..255 in every position
        b = np.arange(256, dtype=np.uint32)
        return b | (np.roll(b, 1) << 8) | (np.roll(b, 2) << 16) | (np.roll(b, 3) << 24)
    if per_word == 2:  # 16-bit elements: every one, low and high half
        h = np.arange(65536, dtype=np.uint32)
        return h | (np.roll(h, 12345) << 16)
    rng = np.random.default_rng(3)  # fp32: a sweep of bit patterns, specials included
    return np.concatenate([rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32),
                           np.asarray([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 1, 0x807FFFFF],
                                      np.uint32)])


@pytest.mark.parametrize("kernel", sorted(CONVERSIONS))
def test_packed_conversion_is_the_scalar_one_bit_for_bit(cvt_mod, kernel):
    per = CONVERSIONS[kernel]
    words = _every_encoding(per)
    packed = np.zeros(words.size * per, np.uint32)
    scalar = np.ones(words.size * per, np.uint32)
    run(cvt_mod, kernel, 8, 128, words, np.int32(words.size), packed, scalar)
    np.testing.assert_array_equal(packed, scalar)


@pytest.mark.parametrize("kernel,numpy_type", [("cvt_int8", np.int8), ("cvt_e4m3", ml_dtypes.float8_e4m3fn),
                                               ("cvt_e5m2", ml_dtypes.float8_e5m2)])
def test_packed_8bit_conversions_match_ml_dtypes(cvt_mod, kernel, numpy_type):
    words = _every_encoding(4)
    packed = np.zeros(words.size * 4, np.uint32)
    run(cvt_mod, kernel, 2, 128, words, np.int32(words.size), packed, np.zeros_like(packed))
    want = words.view(np.uint8).view(numpy_type).astype(np.float32)
    np.testing.assert_array_equal(packed.view(np.float32), want)  # NaN where ml_dtypes has NaN


@pytest.mark.parametrize("kernel,numpy_type,n", [("load_fp8_32", ml_dtypes.float8_e4m3fn, 32),
                                                 ("load_half_1", np.float16, 1),
                                                 ("load_bf16_2", ml_dtypes.bfloat16, 2),
                                                 ("load_int8_8", np.int8, 8)])
def test_vector_loads_from_shared_memory(cvt_mod, kernel, numpy_type, n):
    x = (np.random.default_rng(5).standard_normal(64) * 20).astype(numpy_type)
    out = np.full(n, np.nan, np.float32)
    run(cvt_mod, kernel, 1, 64, x, out)
    np.testing.assert_array_equal(out, np.zeros(n, np.float32))


def test_byte_perm_follows_cuda(cvt_mod):
    rng = np.random.default_rng(9)
    n = 4096
    x, y, s = (rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    out = np.zeros(n, np.uint32)
    run(cvt_mod, "byte_perm", 1, 64, x, y, s, out, np.int32(n))
    both = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    want = np.zeros(n, np.uint64)
    for k in range(4):  # result byte k = input byte s<4k+2:4k>; bit 3 of each selector is not used
        sel = (s.astype(np.uint64) >> np.uint64(4 * k)) & np.uint64(7)
        want |= ((both >> (np.uint64(8) * sel)) & np.uint64(0xFF)) << np.uint64(8 * k)
    np.testing.assert_array_equal(out, want.astype(np.uint32))
