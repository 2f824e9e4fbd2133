"""The CPU runtime's mma.sync m16n8k16 and ldmatrix (templates/common/mma.cuh on the CPU side,
templates/simt/kgen_simt_mma.h) against the PTX ISA's fragment layouts: every lane's registers
are checked element by element against the documented (row, column) of each fragment, not only
the product. The layout formulas below are written from the PTX ISA text, independently of the
emulation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

KERNELS = r"""
// Each lane builds its fragments from A [16x16], B [16x8] (row-major, k by n) and C [16x8] with the
// index maps of the PTX ISA, runs one mma and stores d0..d3 at out[lane*4 + i].
template <class T>
__device__ void mma_probe(const T* a, const T* b, const float* c, float* out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  unsigned af[4], bf[2];
  float cf[4], d[4];
  for (int r = 0; r < 4; ++r) {
    const int row = g + ((r & 1) ? 8 : 0), col = 2 * t + ((r & 2) ? 8 : 0);
    af[r] = kgen::pack2<T>(float(a[row * 16 + col]), float(a[row * 16 + col + 1]));
  }
  for (int r = 0; r < 2; ++r) {
    const int k = 2 * t + 8 * r;
    bf[r] = kgen::pack2<T>(float(b[k * 8 + g]), float(b[(k + 1) * 8 + g]));
  }
  for (int i = 0; i < 4; ++i) cf[i] = c[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)];
  kgen::mma_m16n8k16<T>(d, af, bf, cf);
  for (int i = 0; i < 4; ++i) out[(threadIdx.x >> 5) * 128 + lane * 4 + i] = d[i];
}
extern "C" __global__ void mma_f16(const __half* a, const __half* b, const float* c, float* out) {
  mma_probe<__half>(a + (threadIdx.x >> 5) * 256, b + (threadIdx.x >> 5) * 128, c + (threadIdx.x >> 5) * 128, out);
}
extern "C" __global__ void mma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c, float* out) {
  mma_probe<__nv_bfloat16>(a + (threadIdx.x >> 5) * 256, b + (threadIdx.x >> 5) * 128, c + (threadIdx.x >> 5) * 128,
                           out);
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
"""
NAMES = ["mma_f16", "mma_bf16", "ld_x1", "ld_x2", "ld_x4", "ld_x1_t", "ld_x2_t", "ld_x4_t", "ld_mma"]


@pytest.fixture(scope="module")
def module():
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    mma = (templates_dir() / "common" / "mma.cuh").read_text()
    return CpuModule.from_source(head + mma + KERNELS, NAMES)


# ---- the PTX ISA's layouts (groupID = lane >> 2, threadID_in_group = lane % 4) ----------------
def a_coord(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of a_i, i = 0..7, of m16n8k16 .f16/.bf16."""
    g, t = lane >> 2, lane % 4
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_coord(lane: int, i: int) -> tuple[int, int]:
    """(row k, col n) of b_i, i = 0..3."""
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def c_coord(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of c_i / d_i, i = 0..3."""
    g, t = lane >> 2, lane % 4
    return g + (8 if i >= 2 else 0), t * 2 + (i & 1)


def ld_coord(lane: int, j: int, trans: bool) -> tuple[int, int]:
    """(row, col) within its 8x8 matrix of the j-th (0 = low half) element of a lane's register."""
    return (2 * (lane % 4) + j, lane >> 2) if trans else (lane >> 2, 2 * (lane % 4) + j)


def _call(module, name, grid, block, args):
    module.launch(Launch(name, grid, (block, 1, 1), 0, list(args)))


def test_the_layout_formulas_cover_each_matrix_once():
    """The formulas above are a bijection lanes x registers -> elements (a check of the test itself)."""
    assert sorted(a_coord(lane, i) for lane in range(32) for i in range(8)) == [(r, c) for r in range(16)
                                                                             for c in range(16)]
    assert sorted(b_coord(lane, i) for lane in range(32) for i in range(4)) == [(r, c) for r in range(16)
                                                                             for c in range(8)]
    assert sorted(c_coord(lane, i) for lane in range(32) for i in range(4)) == [(r, c) for r in range(16)
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
    _call(module, name, (1, 1, 1), 64, [a, b, c, out])
    for w in range(2):
        want = a[w].astype(np.float64) @ b[w].astype(np.float64) + c[w]
        for lane in range(32):
            for i in range(4):
                assert out[w * 128 + lane * 4 + i] == want[c_coord(lane, i)], (w, lane, i)


def test_mma_accumulates_in_fp32(module):
    """Random fp16 inputs: the result is the fp32 accumulation (close to float64 at fp32 precision,
    far closer than an fp16 accumulator would be)."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 16, 16)).astype(np.float16)
    b = rng.standard_normal((2, 16, 8)).astype(np.float16)
    c = (rng.standard_normal((2, 16, 8)) * 1000).astype(np.float32)
    out = np.zeros(256, dtype=np.float32)
    _call(module, "mma_f16", (1, 1, 1), 64, [a, b, c, out])
    want = np.einsum("wmk,wkn->wmn", a.astype(np.float64), b.astype(np.float64)) + c
    got = np.array([[out[w * 128 + lane * 4 + i] for lane in range(32) for i in range(4)] for w in range(2)])
    ref = np.array([[want[w][c_coord(lane, i)] for lane in range(32) for i in range(4)] for w in range(2)])
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
                row, col = ld_coord(lane, j, trans)
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
            assert out[lane * 4 + i] == want[c_coord(lane, i)]
            assert out[128 + lane * 4 + i] == want[c_coord(lane, i)]
