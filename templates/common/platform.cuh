// kgen platform layer, provided by kgen to both compilers: kernels write
//   #include "kgen/platform.cuh"
// and NVRTC and g++ both read this file. It holds the few primitives whose spelling
// differs between the GPU (NVRTC) and the CPU SIMT runtime (templates/simt/, which
// defines KGEN_SIMT and its own KGEN_DYNAMIC_SMEM), so that kernel sources never
// branch on the compiler (kgen's source policy refuses that).
#pragma once

#ifndef KGEN_SIMT
// Dynamic shared memory: one 16-byte aligned buffer per thread block.
#define KGEN_DYNAMIC_SMEM(T, name) \
  extern __shared__ __align__(16) unsigned char kgen_dynamic_smem_[]; \
  T* name = reinterpret_cast<T*>(kgen_dynamic_smem_)
#endif

#define KGEN_NEG_INF (__int_as_float(0xff800000u))

namespace kgen {

typedef signed char i8;

// V's and the output's head dim of a Cfg: its V_HEAD_DIM, or HEAD_DIM for a Cfg that has none (one
// written before attention.v_head_dim: a hand-written ABI 1 kernel that calls kgen's provided bodies).
template <class Cfg, class = void> struct CfgVHeadDim { static constexpr int value = Cfg::HEAD_DIM; };
template <class Cfg> struct CfgVHeadDim<Cfg, decltype(void(Cfg::V_HEAD_DIM))> {
  static constexpr int value = Cfg::V_HEAD_DIM;
};

// nvfp4 (docs/abi.md): two e2m1 values in one byte, element 2i in the low nibble. Pointers to a
// packed cache step by whole bytes, so element e of a row is at fp4x2 e / ElemsPer<T>::value. An
// opaque enum (a complete one-byte type that may be declared again: `kgen abi`'s prelude does).
enum class fp4x2 : unsigned char;
template <class T> struct ElemsPer { static constexpr int value = 1; };
template <> struct ElemsPer<fp4x2> { static constexpr int value = 2; };
// nvfp4's scales as one argument of a kernel body (where other caches pass one float pointer):
// the e4m3 block-scale pool and the fp32 tensor scale.
template <class P> struct Fp4Scales {
  P block;
  const float* tensor;
};
template <class P> __device__ __forceinline__ Fp4Scales<P> fp4_scales(P block, const float* tensor) {
  return Fp4Scales<P>{block, tensor};
}

// ---- 2^x with denormal results flushed to 0: one MUFU.EX2 on the GPU (ex2.approx.ftz, no range
// fix-up around it, unlike __expf's ex2.approx without -ftz); exp2f on the CPU.
#ifdef KGEN_SIMT
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
#else
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// ---- scalar conversions to and from float (the kernels compute in fp32) ----
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return float(x); }
__device__ __forceinline__ float to_float(i8 x) { return float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---- vector memory access: N elements of T as one load when the bytes allow ----
template <int BYTES> struct VecStorage;
template <> struct VecStorage<16> { typedef uint4 type; };
template <> struct VecStorage<8> { typedef uint2 type; };
template <> struct VecStorage<4> { typedef unsigned int type; };
template <> struct VecStorage<2> { typedef unsigned short type; };
template <> struct VecStorage<1> { typedef unsigned char type; };

// Load N contiguous, N*sizeof(T)-aligned elements and widen them to float.
template <class T, int N>
__device__ __forceinline__ void load_vec_as_float(const T* __restrict__ ptr, float (&dst)[N]) {
  typedef typename VecStorage<N * sizeof(T)>::type V;
  const V raw = *reinterpret_cast<const V*>(ptr);
  T e[N];
  memcpy(e, &raw, sizeof(raw));  // not a pointer cast: that would break strict aliasing under g++ -O2
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = to_float(e[i]);
}

}  // namespace kgen
