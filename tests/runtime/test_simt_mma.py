"""The CPU runtime's mma.sync m16n8k16 and ldmatrix (templates/common/mma.cuh on the CPU side,
templates/simt/kgen_simt_mma.h) against the PTX ISA's fragment layouts: every lane's registers
are checked element by element against the documented (row, column) of each fragment, not only
the product. The layouts come from tests/runtime/ptx_layouts.py (transcribed from the PTX ISA,
independently of the emulation); ldmatrix's 16-byte row alignment is checked too."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ptx_layouts import (
    LDMATRIX_ROW_ALIGN,
    ldmatrix_address_lane,
    ldmatrix_elem,
    mma_a,
    mma_b,
    mma_c,
)

from kgen.errors import KernelRuntimeError
from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

KERNELS = r"""
// Each lane takes its registers as the host built them (af: 4 a lane, bf: 2, cf: 4; one set per
// warp), runs one mma and stores d0..d3 at out[warp * 128 + lane * 4 + i]: the host reads them by
// the PTX ISA's maps (ptx_layouts), so the kernel itself holds no layout.
template <class T>
__device__ void mma_probe(const unsigned* af, const unsigned* bf, const float* cf, float* out) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const unsigned a[4] = {af[w * 128 + lane * 4], af[w * 128 + lane * 4 + 1], af[w * 128 + lane * 4 + 2],
                         af[w * 128 + lane * 4 + 3]};
  const unsigned b[2] = {bf[w * 64 + lane * 2], bf[w * 64 + lane * 2 + 1]};
  const float c[4] = {cf[w * 128 + lane * 4], cf[w * 128 + lane * 4 + 1], cf[w * 128 + lane * 4 + 2],
                      cf[w * 128 + lane * 4 + 3]};
  float d[4];
  kgen::mma_m16n8k16<T>(d, a, b, c);
  for (int i = 0; i < 4; ++i) out[w * 128 + lane * 4 + i] = d[i];
}
extern "C" __global__ void mma_f16(const unsigned* af, const unsigned* bf, const float* cf, float* out) {
  mma_probe<__half>(af, bf, cf, out);
}
extern "C" __global__ void mma_bf16(const unsigned* af, const unsigned* bf, const float* cf, float* out) {
  mma_probe<__nv_bfloat16>(af, bf, cf, out);
}

// ldmatrix of four 8x8 matrices laid out in shared memory as m[4][8][8] (row stride 8 elements,
// matrix stride 64); lane l gives the address of row l % 8 of matrix l / 8. Stores the raw registers.
template <int N, bool TRANS>
__device__ void ld_probe(const unsigned short* m, unsigned* out) {
  __shared__ __align__(16) unsigned short s[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) s[i] = m[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  unsigned r[N];
  kgen::ldmatrix<N, TRANS>(r, s + (lane / 8) * 64 + (lane % 8) * 8);
  for (int i = 0; i < N; ++i) out[lane * 4 + i] = r[i];
}
extern "C" __global__ void ld_x1(const unsigned short* m, unsigned* out) { ld_probe<1, false>(m, out); }
extern "C" __global__ void ld_x2(const unsigned short* m, unsigned* out) { ld_probe<2, false>(m, out); }
extern "C" __global__ void ld_x4(const unsigned short* m, unsigned* out) { ld_probe<4, false>(m, out); }
extern "C" __global__ void ld_x1_t(const unsigned short* m, unsigned* out) { ld_probe<1, true>(m, out); }
extern "C" __global__ void ld_x2_t(const unsigned short* m, unsigned* out) { ld_probe<2, true>(m, out); }
extern "C" __global__ void ld_x4_t(const unsigned short* m, unsigned* out) { ld_probe<4, true>(m, out); }

// The way the prefill kernel feeds the tensor cores: A (16x16, row-major) by ldmatrix.x4, B from a
// K-major [n][k] tile by ldmatrix.x2 (non-transposed) and from a [k][n] tile by ldmatrix.x2.trans.
extern "C" __global__ void ld_mma(const __half* a, const __half* bt, const __half* b, float* out) {
  __shared__ __align__(16) __half sa[16 * 24], sbt[8 * 24], sb[16 * 16];  // padded rows (16-byte multiples)
  for (int i = threadIdx.x; i < 256; i += 32) sa[(i / 16) * 24 + i % 16] = a[i];
  for (int i = threadIdx.x; i < 128; i += 32) sbt[(i / 16) * 24 + i % 16] = bt[i];
  for (int i = threadIdx.x; i < 128; i += 32) sb[(i / 8) * 16 + i % 8] = b[i];
  __syncthreads();
  const int lane = threadIdx.x;
  unsigned af[4], b1[2], b2[2];
  kgen::ldmatrix<4, false>(af, sa + (lane % 16) * 24 + (lane / 16) * 8);
  kgen::ldmatrix<2, false>(b1, sbt + (lane % 8) * 24 + ((lane / 8) % 2) * 8);
  kgen::ldmatrix<2, true>(b2, sb + (lane % 16) * 16);
  float z[4] = {0.f, 0.f, 0.f, 0.f}, d1[4], d2[4];
  kgen::mma_m16n8k16<__half>(d1, af, b1, z);
  kgen::mma_m16n8k16<__half>(d2, af, b2, z);
  for (int i = 0; i < 4; ++i) {
    out[lane * 4 + i] = d1[i];
    out[128 + lane * 4 + i] = d2[i];
  }
}
// ldmatrix with lane `bad` giving its row address `skew` bytes off (the other rows as ld_probe's).
template <int N>
__device__ void ld_skewed(int bad, int skew, unsigned* out) {
  __shared__ __align__(16) unsigned short s[256 + 16];
  for (int i = threadIdx.x; i < 272; i += blockDim.x) s[i] = (unsigned short)i;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  unsigned r[N];
  kgen::ldmatrix<N, false>(r, reinterpret_cast<unsigned char*>(s + (lane / 8) * 64 + (lane % 8) * 8) +
                                  (lane == bad ? skew : 0));
  for (int i = 0; i < N; ++i) out[lane * 4 + i] = r[i];
}
extern "C" __global__ void ld_skewed_x(int n, int bad, int skew, unsigned* out) {
  if (n == 1) ld_skewed<1>(bad, skew, out);
  if (n == 2) ld_skewed<2>(bad, skew, out);
  if (n == 4) ld_skewed<4>(bad, skew, out);
}
"""
NAMES = ["mma_f16", "mma_bf16", "ld_x1", "ld_x2", "ld_x4", "ld_x1_t", "ld_x2_t", "ld_x4_t", "ld_mma", "ld_skewed_x"]


@pytest.fixture(scope="module")
def module():
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    mma = (templates_dir() / "common" / "mma.cuh").read_text()
    return CpuModule.from_source(head + mma + KERNELS, NAMES)


def fragments(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> list[np.ndarray]:
    """Per warp w (axis 0), the registers of every lane by the PTX ISA's maps: A's four .b32
    (element 2r in the low half, 2r + 1 in the high), B's two, C's four floats."""
    w = a.shape[0]
    ab, bb = a.view(np.uint16).astype(np.uint32), b.view(np.uint16).astype(np.uint32)
    af, bf, cf = np.zeros((w, 32, 4), np.uint32), np.zeros((w, 32, 2), np.uint32), np.zeros((w, 32, 4), np.float32)
    for x in range(w):
        for lane in range(32):
            for r in range(4):
                af[x, lane, r] = ab[(x, *mma_a(lane, 2 * r))] | ab[(x, *mma_a(lane, 2 * r + 1))] << 16
                cf[x, lane, r] = c[(x, *mma_c(lane, r))]
            for r in range(2):
                bf[x, lane, r] = bb[(x, *mma_b(lane, 2 * r))] | bb[(x, *mma_b(lane, 2 * r + 1))] << 16
    return [af.reshape(-1), bf.reshape(-1), cf.reshape(-1)]


def _call(module, name, grid, block, args):
    module.launch(Launch(name, grid, (block, 1, 1), 0, list(args)))


def test_the_layout_formulas_cover_each_matrix_once():
    """The ISA's maps are bijections lanes x registers -> elements (a check of the transcription)."""
    assert sorted(mma_a(lane, i) for lane in range(32) for i in range(8)) == [(r, c) for r in range(16)
                                                                             for c in range(16)]
    assert sorted(mma_b(lane, i) for lane in range(32) for i in range(4)) == [(r, c) for r in range(16)
                                                                             for c in range(8)]
    assert sorted(mma_c(lane, i) for lane in range(32) for i in range(4)) == [(r, c) for r in range(16)
                                                                             for c in range(8)]


@pytest.mark.parametrize("name,dt", [("mma_f16", np.float16), ("mma_bf16", ml_dtypes.bfloat16)])
def test_each_lane_holds_its_documented_accumulator_elements(module, name, dt):
    """Small integers: every product and sum is exact, so each d_i must equal its element exactly.
    Two warps with different data: the emulation keeps one staging area per warp."""
    rng = np.random.default_rng(5)
    a = rng.integers(-8, 9, (2, 16, 16)).astype(dt)
    b = rng.integers(-8, 9, (2, 16, 8)).astype(dt)
    c = rng.integers(-64, 65, (2, 16, 8)).astype(np.float32)
    out = np.full(256, np.nan, dtype=np.float32)
    _call(module, name, (1, 1, 1), 64, [*fragments(a, b, c), out])
    for w in range(2):
        want = a[w].astype(np.float64) @ b[w].astype(np.float64) + c[w]
        for lane in range(32):
            for i in range(4):
                assert out[w * 128 + lane * 4 + i] == want[mma_c(lane, i)], (w, lane, i)


def test_mma_accumulates_in_fp32(module):
    """Random fp16 inputs: the result is the fp32 accumulation (close to float64 at fp32 precision,
    far closer than an fp16 accumulator would be)."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 16, 16)).astype(np.float16)
    b = rng.standard_normal((2, 16, 8)).astype(np.float16)
    c = (rng.standard_normal((2, 16, 8)) * 1000).astype(np.float32)
    out = np.zeros(256, dtype=np.float32)
    _call(module, "mma_f16", (1, 1, 1), 64, [*fragments(a, b, c), out])
    want = np.einsum("wmk,wkn->wmn", a.astype(np.float64), b.astype(np.float64)) + c
    got = np.array([[out[w * 128 + lane * 4 + i] for lane in range(32) for i in range(4)] for w in range(2)])
    ref = np.array([[want[w][mma_c(lane, i)] for lane in range(32) for i in range(4)] for w in range(2)])
    assert np.max(np.abs(got - ref)) <= 16 * np.finfo(np.float32).eps * 1000 * 4
    assert np.max(np.abs(got - ref)) < 0.25  # an fp16 accumulator rounds values near 1000 to 0.5


@pytest.mark.parametrize("n,trans", [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)])
def test_ldmatrix_registers_follow_the_documented_layout(module, n, trans):
    m = np.arange(256, dtype=np.uint16)  # element value = matrix * 64 + row * 8 + col
    out = np.zeros(128, dtype=np.uint32)
    _call(module, f"ld_x{n}" + ("_t" if trans else ""), (1, 1, 1), 32, [m, out])
    for lane in range(32):
        for i in range(n):
            reg = int(out[lane * 4 + i])
            for j, half in enumerate((reg & 0xFFFF, reg >> 16)):
                row, col = ldmatrix_elem(lane, j, trans)
                assert half == i * 64 + row * 8 + col, (lane, i, j, half)


def test_ldmatrix_feeds_mma_fragments(module):
    """ldmatrix.x4 of a row-major A tile gives a0..a7; ldmatrix.x2 of a K-major B (one row per n)
    and ldmatrix.x2.trans of a row-major B (one row per k) give b0..b3: the products are A @ B."""
    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, (16, 16)).astype(np.float16)
    b = rng.integers(-4, 5, (16, 8)).astype(np.float16)
    out = np.zeros(256, dtype=np.float32)
    _call(module, "ld_mma", (1, 1, 1), 32, [a, np.ascontiguousarray(b.T), b, out])
    want = a.astype(np.float64) @ b.astype(np.float64)
    for lane in range(32):
        for i in range(4):
            assert out[lane * 4 + i] == want[mma_c(lane, i)]
            assert out[128 + lane * 4 + i] == want[mma_c(lane, i)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ldmatrix_refuses_a_row_address_that_is_not_16_byte_aligned(module, n):
    """PTX ISA: the row addresses "must be naturally aligned" to the 16 bytes four threads load.
    The last lane whose address .x{n} uses gives one 2 bytes off: an error naming it."""
    bad = ldmatrix_address_lane(n - 1, 7)
    with pytest.raises(KernelRuntimeError, match=rf"ldmatrix\.m8n8\.x{n}: lane {bad} gives the row address "
                                                 rf"0x[0-9a-f]+, which is not {LDMATRIX_ROW_ALIGN}-byte aligned"):
        _call(module, "ld_skewed_x", (1, 1, 1), 32, [n, bad, 2, np.zeros(128, np.uint32)])


@pytest.mark.parametrize("n", [1, 2])
def test_ldmatrix_ignores_the_addresses_of_lanes_it_does_not_use(module, n):
    """.x1 reads the addresses of threads 0-7, .x2 of 0-15: a skewed address above them is unused."""
    m = np.arange(272, dtype=np.uint16)
    out = np.zeros(128, np.uint32)
    _call(module, "ld_skewed_x", (1, 1, 1), 32, [n, ldmatrix_address_lane(n, 0), 2, out])
    for lane in range(32):
        for i in range(n):
            reg = int(out[lane * 4 + i])
            for j, half in enumerate((reg & 0xFFFF, reg >> 16)):
                row, col = ldmatrix_elem(lane, j, False)
                assert half == m[i * 64 + row * 8 + col]
