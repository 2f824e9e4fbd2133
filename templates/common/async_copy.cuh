// Asynchronous global -> shared copies (PTX cp.async, sm_80+), issued in groups:
//   cp_async<N>(dst, src, src_bytes)  copy N = 4, 8 or 16 bytes (both addresses N-aligned);
//                                     bytes [src_bytes, N) of dst are zero-filled instead
//                                     (src_bytes = 0: nothing is read; src must still be aligned)
//   cp_async_commit()                 close the group of the copies issued since the last commit
//   cp_async_wait<N>()                wait until at most the N most recent groups are pending
//   cp_async_wait_all()               commit, then wait for every group
// A copy may land any time up to the wait that covers it: read a buffer only after that
// wait (another thread's copies: after the __syncthreads that follows its wait). The CPU
// backend lands every copy exactly at the wait (templates/simt/kgen_simt_async.h).
#pragma once

namespace kgen {

#if defined(KGEN_SIMT)
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  ::kgen_simt::cp_async(dst, src, N, (unsigned)src_bytes, N == 16);
}
__device__ __forceinline__ void cp_async_commit() { ::kgen_simt::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { ::kgen_simt::cp_async_wait_group(N); }
__device__ __forceinline__ void cp_async_wait_all() { ::kgen_simt::cp_async_wait_all(); }

#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  if (N == 16) {  // .cg: the KV stream bypasses L1
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(src), "n"(N), "r"(src_bytes)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

#else  // before sm_80: a plain copy lands at once (allowed: no later than the wait)
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  unsigned char* d = static_cast<unsigned char*>(dst);
  const unsigned char* s = static_cast<const unsigned char*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] = i < src_bytes ? s[i] : (unsigned char)0;
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
__device__ __forceinline__ void cp_async_wait_all() {}
#endif

}  // namespace kgen
