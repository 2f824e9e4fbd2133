// The tile products of the mma.sync bodies (the tensor-core decode and the prefill body): S = Q K^T
// and O += P V over the k16 steps of a tile, with K and V rows of 16-bit operands (q's type) in shared
// memory, in the fragments of mma.sync m16n8k16 (PTX ISA layouts, kgen_simt_mma.h). Lane 4g + t holds:
//
//   C fragment  float[4] of an m16n8 tile: [0], [1] row g, [2], [3] row g + 8; columns 2t, 2t + 1
//   A fragment  unsigned[4], two T a register: (row g, k 2t, 2t + 1), (g + 8, 2t ..), (g, 2t + 8 ..),
//               (g + 8, 2t + 8 ..): register 2j + r of P's A fragment is row half r of S's C
//               fragment j (a_from_c)
//   B fragment  unsigned[2] of a k16n8 tile: (k 2t, 2t + 1 of column g), (k 2t + 8, 2t + 9)
//
// A warp's tile: MT m16 tiles of rows (A fragments a[MT]), keys in n8 tiles. UPPER: the lane's rows
// g + 8 are kept (false: a group of at most 8 rows, rows 8..15 padding whose accumulators are
// neither kept nor read, which halves the registers of S and of O). Rows in shared memory are
// pointers to T, LD elements apart (Q and K: head_dim and padding; V: v_head_dim and padding); a body
// takes the lane's ldmatrix row (a_lane_row / k_lane_row / v_lane_row) once and the loops add
// constants to it. a_of(kk, a): the A fragments of k16 step kk (Q's from shared memory or registers,
// P's from S's C fragments), called inside the tile loop.
//
//   mma_tile<T, UPPER>(acc, a, b)           acc += A B (T: fp16 or bf16 operands, fp32 accumulate)
//   a_step<MT, LD>(a, a_lane, k0)           A fragments of MT m16 tiles of rows (Q) from shared memory
//   a_from_c<T>(a, c0, c1)                  P's A fragment of a k16 step from S's C fragments
//   qk_tile<..>(s, a_of, k_lane)            s[mt][j] += A[mt] . K[keys 8j .. 8j + 7]^T over head_dim's steps
//   pv_tile<..>(o, a_of, v_lane, lane, dn)  o[mt][nt] += A[mt] . V[keys, columns 8nt ..] over the keys' steps
//
// The 8-bit and nvfp4 operands the tensor-core decode converts in registers are its own
// (paged_decode_mma.cuh: decode_mma_qk / decode_mma_pv, on mma_tile); prefill converts them into
// 16-bit tiles first.
//
// Provided by kgen to both compilers as "kgen/attention/mma_tile.cuh" (kgen/compile/provided.py);
// needs kgen/mma.cuh (mma_m16n8k16, ldmatrix, pack2) before it.
#pragma once

namespace kgen {

template <class T, bool UPPER = true>
__device__ __forceinline__ void mma_tile(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  if constexpr (UPPER) {
    mma_m16n8k16<T>(acc, a, b, acc);
  } else {
    const float c[4] = {acc[0], acc[1], 0.0f, 0.0f};
    float d[4];
    mma_m16n8k16<T>(d, a, b, c);
    acc[0] = d[0];
    acc[1] = d[1];
  }
}

// P's A fragment of a k16 step from the C fragments of its two n8 tiles of columns (keys).
template <class T>
__device__ __forceinline__ void a_from_c(unsigned (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// The lane's ldmatrix row (bytes from the first row, at column 0): for the A fragment of 16 rows
// (Q) over one k16 step, and for B fragments of two n8 tiles of keys over one k16 step: K (x4,
// matrices: keys 0-7 x k 0-7, 0-7 x 8-15, 8-15 x 0-7, 8-15 x 8-15) and V (x4 .trans, matrices:
// keys 0-7 and 8-15 of columns 0-7, then of 8-15).
// (Pointer adds, not one integer offset: the compiler then folds the steps' constants into the
// ldmatrix addresses, where an integer sum of them costs address math in the loop.)
template <int LD, class T>
__device__ __forceinline__ const T* a_lane_row(const T* rows, int lane) {  // A: x4, rows 0-15 x k 0-7, then x k 8-15
  return rows + (lane % 16) * LD + (lane / 16) * 8;
}
template <int LD, class T>
__device__ __forceinline__ const T* k_lane_row(const T* rows, int lane) {
  return rows + ((lane / 16) * 8 + lane % 8) * LD + ((lane / 8) % 2) * 8;
}
template <int LD, class T>
__device__ __forceinline__ const T* v_lane_row(const T* rows, int lane) {  // (matrices 2, 3: pv_step adds 8 columns)
  return rows + (((lane / 8) % 2) * 8 + lane % 8) * LD;
}

// The A fragments of MT m16 tiles of rows over one k16 step, from shared memory (a_lane: the lane's
// row, a_lane_row; k0: the step's first column).
template <int MT, int LD, class T>
__device__ __forceinline__ void a_step(unsigned (&a)[MT][4], const T* a_lane, int k0) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) ldmatrix<4, false>(a[mt], a_lane + 16 * mt * LD + k0);
}

// s[mt][j] += A[mt] . K[keys 8j .. 8j + 7]^T over STEPS k16 steps: a_of(kk, a) gives step kk's A
// fragments, k_lane is the lane's K row (k_lane_row). Each K fragment ldmatrix loads feeds MT MMAs.
// (The step loops stay in one function with the fragment loops: split into a function a step, the
// prefill kernels' loops grew by up to 50 instructions.)
template <class T, bool UPPER, int MT, int N8, int STEPS, int LD, class AOf>
__device__ __forceinline__ void qk_tile(float (&s)[MT][N8][4], AOf&& a_of, const T* k_lane) {
  static_assert(N8 % 2 == 0, "keys in pairs of n8 tiles");
#pragma unroll
  for (int kk = 0; kk < STEPS; ++kk) {
    unsigned a[MT][4];
    a_of(kk, a);
#pragma unroll
    for (int j = 0; j < N8; j += 2) {
      unsigned b[4];
      ldmatrix<4, false>(b, k_lane + j * 8 * LD + kk * 16);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_tile<T, UPPER>(s[mt][j], a[mt], b0);
        mma_tile<T, UPPER>(s[mt][j + 1], a[mt], b1);
      }
    }
  }
}

// o[mt][nt] += A[mt] . V[keys 16kk .. 16kk + 15, columns 8nt .. 8nt + 7] over STEPS k16 steps of
// keys, for the n8 tiles nt below dn / 8 (dn: a multiple of 8, at most 8 ONT; uniform): a_of(kk, a)
// gives step kk's A fragments (P's), v_lane is the lane's V row (v_lane_row) at the first column.
template <class T, bool UPPER, int MT, int ONT, int STEPS, int LD, class AOf>
__device__ __forceinline__ void pv_tile(float (&o)[MT][ONT][4], AOf&& a_of, const T* v_lane, int lane, int dn) {
#pragma unroll
  for (int kk = 0; kk < STEPS; ++kk) {
    unsigned a[MT][4];
    a_of(kk, a);
    const T* v_row = v_lane + kk * 16 * LD;
#pragma unroll
    for (int nt = 0; nt < ONT; nt += 2) {
      if (8 * nt >= dn) break;
      if (nt + 1 < ONT && 8 * (nt + 1) < dn) {
        unsigned b[4];
        ldmatrix<4, true>(b, v_row + (lane / 16) * 8 + 8 * nt);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_tile<T, UPPER>(o[mt][nt], a[mt], b0);
          mma_tile<T, UPPER>(o[mt][nt + 1], a[mt], b1);
        }
      } else {  // a last odd n8 tile: matrices 0 and 1
        unsigned b[2];
        ldmatrix<2, true>(b, v_row + 8 * nt);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma_tile<T, UPPER>(o[mt][nt], a[mt], b);
      }
    }
  }
}

}  // namespace kgen
