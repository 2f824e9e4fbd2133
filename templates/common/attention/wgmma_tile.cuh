// The wgmma tile of the Hopper attention bodies (paged_prefill_wgmma.cuh, paged_mla_wgmma.cuh), once:
// the 16-bit operands in shared memory with the 128-byte swizzle, the accumulator fragment, and the
// two products, each a batch of wgmma fenced, committed and waited on as one. The bodies keep their
// orchestration: who copies the tiles, the barriers, the masks, the softmax's row maxima.
//
//   wg_swizzled<R>(r, c)   byte offset of element (r, c) of a tile of R rows stored as column blocks
//                          of 64 elements (one 128-byte row a key or query row), from a 1024-byte
//                          aligned base: element (r, c) at (c / 64) R 128 + r 128 + (c % 64) 2, chunk
//                          bits [4,7) XORed with row bits [7,10)
//   wg_desc_plus(desc, bytes)  a matrix descriptor `bytes` further on in shared memory
//   wg_row(e), wg_col(e, t)    where element e of a thread's m64nN accumulator sits (the m16n8
//                          C-fragment layout per warp, [N/8][4]): row g + 8 wg_row(e) of its warp's 16,
//                          column wg_col(e, t) (g = lane / 4, t = lane % 4); O's elements alike
//   wg_qk<T, N, K, A_ROWS, B_ROWS>(s, da, db)   S = A B^T over K: K/16 wgmma_ss m64nNk16, A and B
//                          K-major tiles of A_ROWS and B_ROWS rows (the next 64 columns R 128 bytes on)
//   wg_weigh(softmax, s, mb, st)   P = exp(S - m) in place (attention/softmax_tile.cuh), the row
//                          sums of the thread's shares added to st[0..1].l
//   wg_pv_rs<T, N, KT>(o, p, dv)   O += P V: P rounded to T into wgmma's A fragments, KT/16 wgmma_rs
//                          m64nNk16 with V [KT x N] MN-major (the next 8 keys 1024 bytes on)
//   wg_store_p<T, R>(p_s, s, row0, col0, t)   P rounded to T into a swizzled shared tile of R rows
//                          (the thread's rows row0, row0 + 8; its keys from column col0)
//   wg_pv_ss<T, N, KT>(o, dp, dv)  O += P V with P K-major in shared memory
//
// Ordering (PTX ISA, wgmma.fence): a register a wgmma reads or writes (accumulators, A fragments) is
// accessed only before the wgmma.fence that precedes it or after the wait_group that completes it.
// So P's A fragments are all written before the fence, and register fences (wgmma_fence_operand) on
// the accumulators and A registers at both ends of each batch keep the compiler from moving their
// accesses into the window. Writing A inside the window made ptxas fence each wgmma itself and
// serialise them (advisory C7520); kgen/compile/wgmma_order.py checks the PTX and SASS for it
// (tests/compile/test_wgmma_order.py). Each batch waits for itself (wait_group 0): no product
// overlaps the softmax.
//
// Provided by kgen to both compilers as "kgen/attention/wgmma_tile.cuh" (kgen/compile/provided.py);
// needs kgen/softmax.cuh, mma.cuh (pack2), hopper.cuh and attention/softmax_tile.cuh before it.
#pragma once

namespace kgen {

template <int R>
__device__ __forceinline__ int wg_swizzled(int r, int c) {
  const int off = (c / 64) * (R * 128) + r * 128 + (c % 64) * 2;
  return off ^ (((off >> 7) & 7) << 4);
}

// The start address field (bits 0-13) is address >> 4; shared addresses stay below 2^18, so a
// 32-bit add does not carry into the next field and the high word stays.
__device__ __forceinline__ unsigned long long wg_desc_plus(unsigned long long desc, int bytes) {
  const unsigned lo = (unsigned)desc + (unsigned)(bytes >> 4);
  return (desc & 0xffffffff00000000ull) | lo;
}

__device__ __forceinline__ int wg_row(int e) { return (e >> 1) & 1; }
__device__ __forceinline__ int wg_col(int e, int t) { return 8 * (e >> 2) + 2 * t + (e & 1); }

// One batch on the accumulators acc: `issue` spells its wgmma.
template <class Acc, class Issue>
__device__ __forceinline__ void wg_batch(Acc& acc, Issue issue) {
  wgmma_fence_operand(acc);
  wgmma_fence();
  issue();
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(acc);
}

template <class T, int N, int K, int A_ROWS, int B_ROWS>
__device__ __forceinline__ void wg_qk(float (&s)[N / 2], unsigned long long da, unsigned long long db) {
  wg_batch(s, [&] {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
      wgmma_ss<T, N, 0, 0>(s, wg_desc_plus(da, (kk / 4) * (A_ROWS * 128) + (kk % 4) * 32),
                           wg_desc_plus(db, (kk / 4) * (B_ROWS * 128) + (kk % 4) * 32), kk > 0 ? 1 : 0);
  });
}

template <int NS>
__device__ __forceinline__ void wg_weigh(const TileSoftmax& softmax, float (&s)[NS], const float (&mb)[2],
                                         SoftmaxState (&st)[2]) {
  float l_tile[2] = {0.0f, 0.0f};
#pragma unroll
  for (int e = 0; e < NS; ++e) {
    s[e] = softmax.weight(s[e], mb[wg_row(e)]);
    l_tile[wg_row(e)] += s[e];
  }
  st[0].l += l_tile[0];
  st[1].l += l_tile[1];
}

template <class T, int N, int KT>
__device__ __forceinline__ void wg_pv_rs(float (&o)[N / 2], const float (&p)[KT / 2], unsigned long long dv) {
  unsigned pa[KT / 16][4];  // all written before the fence
#pragma unroll
  for (int kk = 0; kk < KT / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) pa[kk][j] = pack2<T>(p[8 * kk + 2 * j], p[8 * kk + 2 * j + 1]);
  wgmma_fence_operand(pa);
  wg_batch(o, [&] {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) wgmma_rs<T, N, 1>(o, pa[kk], wg_desc_plus(dv, kk * 16 * 128), 1);
  });
  wgmma_fence_operand(pa);
}

template <class T, int R, int NS>
__device__ __forceinline__ void wg_store_p(unsigned char* p_s, const float (&s)[NS], int row0, int col0, int t) {
#pragma unroll
  for (int e = 0; e < NS; e += 2)
    *reinterpret_cast<unsigned*>(p_s + wg_swizzled<R>(row0 + 8 * wg_row(e), col0 + wg_col(e, t))) =
        pack2<T>(s[e], s[e + 1]);
}

template <class T, int N, int KT>
__device__ __forceinline__ void wg_pv_ss(float (&o)[N / 2], unsigned long long dp, unsigned long long dv) {
  wg_batch(o, [&] {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk)
      wgmma_ss<T, N, 0, 1>(o, wg_desc_plus(dp, kk * 32), wg_desc_plus(dv, kk * 16 * 128), 1);
  });
}

}  // namespace kgen
