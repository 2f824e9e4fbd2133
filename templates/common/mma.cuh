// Warp-level tensor-core primitives: mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate) and
// ldmatrix m8n8 (.b16, x1/x2/x4, optionally .trans). On the GPU they are inline PTX; on the CPU
// the SIMT runtime emulates them with the PTX ISA's fragment layouts (templates/simt/kgen_simt_mma.h
// documents which lane holds which element). Every lane of the warp must call them together.
#pragma once

namespace kgen {

// Two 16-bit values of T in one .b32 register, `lo` in the low half (the lower-indexed element).
template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  unsigned r;
  memcpy(&r, &h, 4);
  return r;
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  unsigned r;
  memcpy(&r, &h, 4);
  return r;
}

#ifdef KGEN_SIMT

template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
  ::kgen_simt::mma_m16n8k16<T>(d, a, b, c);
}
template <int N, bool TRANS>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[N], const void* smem_row) {
  ::kgen_simt::ldmatrix<N, TRANS>(r, smem_row);
}

#else  // the GPU

template <class T> struct MmaPtx;
template <> struct MmaPtx<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
};
template <> struct MmaPtx<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
};

template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
  MmaPtx<T>::run(d, a, b, c);
}

template <int N, bool TRANS> struct LdmatrixPtx;
template <> struct LdmatrixPtx<1, false> {
  static __device__ __forceinline__ void run(unsigned (&r)[1], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
  }
};
template <> struct LdmatrixPtx<2, false> {
  static __device__ __forceinline__ void run(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  }
};
template <> struct LdmatrixPtx<4, false> {
  static __device__ __forceinline__ void run(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
};
template <> struct LdmatrixPtx<1, true> {
  static __device__ __forceinline__ void run(unsigned (&r)[1], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
  }
};
template <> struct LdmatrixPtx<2, true> {
  static __device__ __forceinline__ void run(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  }
};
template <> struct LdmatrixPtx<4, true> {
  static __device__ __forceinline__ void run(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
};

template <int N, bool TRANS>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[N], const void* smem_row) {
  LdmatrixPtx<N, TRANS>::run(r, static_cast<unsigned>(__cvta_generic_to_shared(smem_row)));
}

#endif

}  // namespace kgen
