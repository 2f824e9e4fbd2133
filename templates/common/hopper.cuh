// Hopper (sm_90) primitives as kgen kernels spell them: inline PTX on the GPU (sm_90/sm_90a), the
// SIMT runtime's emulation on the CPU (templates/simt/kgen_simt_hopper.h states the semantics).
//
// mbarrier (a 64-bit object in shared memory, `unsigned long long` here):
//   mbar_init(bar, count)              expected arrivals per phase; follow with fence_mbarrier_init()
//                                      and a __syncthreads() before other threads use it
//   mbar_arrive(bar[, count])          returns the arrival's state token
//   mbar_arrive_expect_tx(bar, bytes)  one arrival that also expects `bytes` of transactions
//   mbar_expect_tx / mbar_complete_tx  transaction bytes expected / completed without arriving
//   mbar_wait(bar, parity)             block until the phase of that parity has completed
//   mbar_try_wait / mbar_test_wait     one test (try_wait may suspend a while first)
//   mbar_inval(bar)
// Bulk copies global -> shared, completing `bytes` transactions on `bar` when they land:
//   bulk_copy_g2s(dst, src, bytes, bar)               16-byte aligned, bytes a multiple of 16
//   tma_load_2d/3d/4d(dst, map, c0, c1.., bar)        the box at coordinates (elements, innermost
//                                                     first) of a tensor map made on the host
// The TensorMap parameter is passed by value as a `const __grid_constant__ kgen::TensorMap`:
// NVIDIA's CUtensorMap on the GPU, kgen's descriptor (kgen/runtime/tma.py) on the CPU.
#pragma once

namespace kgen {

#ifdef KGEN_SIMT

typedef ::kgen_simt::TensorMap TensorMap;

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) { ::kgen_simt::mbar_init(bar, count); }
__device__ __forceinline__ void fence_mbarrier_init() {}
__device__ __forceinline__ void mbar_inval(unsigned long long* bar) { ::kgen_simt::mbar_inval(bar); }
__device__ __forceinline__ unsigned long long mbar_arrive(unsigned long long* bar, unsigned count = 1) {
  return ::kgen_simt::mbar_arrive(bar, count, 0);
}
__device__ __forceinline__ unsigned long long mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  return ::kgen_simt::mbar_arrive(bar, 1, bytes);
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  ::kgen_simt::mbar_tx(bar, (long long)bytes);
}
__device__ __forceinline__ void mbar_complete_tx(unsigned long long* bar, unsigned bytes) {
  ::kgen_simt::mbar_tx(bar, -(long long)bytes);
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
  ::kgen_simt::mbar_wait(bar, parity);
  return true;
}
__device__ __forceinline__ bool mbar_test_wait(unsigned long long* bar, unsigned parity) {
  return ::kgen_simt::mbar_test_wait(bar, parity);
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) { ::kgen_simt::mbar_wait(bar, parity); }

__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  ::kgen_simt::bulk_copy(dst, src, bytes, bar, nullptr, nullptr, 0);
}
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, int c0, int c1, unsigned long long* bar) {
  const int c[2] = {c0, c1};
  ::kgen_simt::bulk_copy(dst, nullptr, 0, bar, &map, c, 2);
}
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap& map, int c0, int c1, int c2,
                                            unsigned long long* bar) {
  const int c[3] = {c0, c1, c2};
  ::kgen_simt::bulk_copy(dst, nullptr, 0, bar, &map, c, 3);
}
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, int c0, int c1, int c2, int c3,
                                            unsigned long long* bar) {
  const int c[4] = {c0, c1, c2, c3};
  ::kgen_simt::bulk_copy(dst, nullptr, 0, bar, &map, c, 4);
}

#else  // the GPU: sm_90 or later

struct __align__(64) TensorMap {
  unsigned long long opaque[16];  // CUtensorMap, encoded on the host by cuTensorMapEncodeTiled
};

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes the inits visible to the async proxy (TMA) and the other threads' mbarrier operations.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_inval(unsigned long long* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ unsigned long long mbar_arrive(unsigned long long* bar, unsigned count = 1) {
  unsigned long long state;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1], %2;\n"
               : "=l"(state) : "r"(smem_addr(bar)), "r"(count) : "memory");
  return state;
}
__device__ __forceinline__ unsigned long long mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  unsigned long long state;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
               : "=l"(state) : "r"(smem_addr(bar)), "r"(bytes) : "memory");
  return state;
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_complete_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ bool mbar_test_wait(unsigned long long* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, int c0, int c1, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_addr(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap& map, int c0, int c1, int c2,
                                            unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(smem_addr(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, int c0, int c1, int c2, int c3,
                                            unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_addr(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

#endif

}  // namespace kgen
