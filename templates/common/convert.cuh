// Packed conversions to float: a 32-bit word of elements at a time, bit for bit what the
// scalar to_float (platform.cuh) gives for each element.
//   fp16, bf16   a half2 / bfloat162 -> float2 (NVIDIA's __half22float2, __bfloat1622float2)
//   fp8          two e4m3 / e5m2 -> half2 (fp8x2_to_half2_bits: one cvt.rn.f16x2.e4m3x2 on sm_89+),
//                the scalar path's own fp8 -> half -> float route (fp8x2_to_float2)
//   int8         four per word by byte permutation: 0x4B000000 | (x + 128) is the float
//                2^23 + 128 + x exactly, so subtracting 2^23 + 128 gives x (no I2F)
//   nvfp4        eight nibbles per word by bit placement into half2, times the group's e4m3
//                scale (load_fp4_as_float)
#pragma once

namespace kgen {

template <class T> struct Widen;  // PER_WORD elements of T in one 32-bit word -> floats

template <> struct Widen<float> {
  static constexpr int PER_WORD = 1;
  static __device__ __forceinline__ void word(unsigned w, float* d) { d[0] = __uint_as_float(w); }
};

template <> struct Widen<__half> {
  static constexpr int PER_WORD = 2;
  static __device__ __forceinline__ void word(unsigned w, float* d) {
    __half2 h;
    memcpy(&h, &w, 4);  // the word as is: each half converts straight from its register half
    const float2 f = __half22float2(h);
    d[0] = f.x;
    d[1] = f.y;
  }
};

template <> struct Widen<__nv_bfloat16> {
  static constexpr int PER_WORD = 2;
  static __device__ __forceinline__ void word(unsigned w, float* d) {
    __nv_bfloat162 h;
    memcpy(&h, &w, 4);
    const float2 f = __bfloat1622float2(h);
    d[0] = f.x;
    d[1] = f.y;
  }
};

// Two fp8 values (the low and high byte of `two`) as a half2's bits, exactly (fp8 values are fp16
// values): one cvt.rn.f16x2.e4m3x2 / e5m2x2 on sm_89+. Every fp8 pair conversion starts here (the
// attention MMA operands, attention/kv_format.cuh's KvPair; fp8_ds_mla rows, ds_mla_row.cuh).
template <__nv_fp8_interpretation_t KIND>
__device__ __forceinline__ unsigned fp8x2_to_half2_bits(unsigned short two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, KIND);
  unsigned r;
  memcpy(&r, &h, 4);
  return r;
}

// ... and as two floats (exact).
template <__nv_fp8_interpretation_t KIND>
__device__ __forceinline__ float2 fp8x2_to_float2(unsigned short two) {
  const unsigned h = fp8x2_to_half2_bits<KIND>(two);
  __half2 hh;
  memcpy(&hh, &h, 4);
  return __half22float2(hh);
}

template <__nv_fp8_interpretation_t KIND>
struct WidenFp8 {
  static constexpr int PER_WORD = 4;
  static __device__ __forceinline__ void pair(unsigned short two, float* d) {
    const float2 f = fp8x2_to_float2<KIND>(two);
    d[0] = f.x;
    d[1] = f.y;
  }
  static __device__ __forceinline__ void word(unsigned w, float* d) {
    pair((unsigned short)(w & 0xFFFFu), d);
    pair((unsigned short)(w >> 16), d + 2);
  }
};
template <> struct Widen<__nv_fp8_e4m3> : WidenFp8<__NV_E4M3> {};
template <> struct Widen<__nv_fp8_e5m2> : WidenFp8<__NV_E5M2> {};

template <> struct Widen<i8> {
  static constexpr int PER_WORD = 4;
  static __device__ __forceinline__ void word(unsigned w, float* d) {
    const unsigned u = w ^ 0x80808080u;  // each byte x + 128, unsigned
#pragma unroll
    for (int k = 0; k < 4; ++k) d[k] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u | k)) - 8388736.0f;
  }
};

// Vector types for reinterpreting shared memory (g++: may_alias, the buffer is bytes).
template <int BYTES> struct AliasVec;
#if defined(KGEN_SIMT)
template <> struct AliasVec<16> { typedef uint4 __attribute__((may_alias)) type; };
template <> struct AliasVec<8> { typedef uint2 __attribute__((may_alias)) type; };
template <> struct AliasVec<4> { typedef unsigned __attribute__((may_alias)) type; };
#else
template <> struct AliasVec<16> { typedef uint4 type; };
template <> struct AliasVec<8> { typedef uint2 type; };
template <> struct AliasVec<4> { typedef unsigned type; };
#endif

// nvfp4 (two e2m1 a byte) by bit placement, no conversion instruction on sm_80/sm_90: nibble
// s e1 e0 m becomes the half with bits s << 15 | e1 e0 m << 9, which is exactly 2^-14 times the
// e2m1 value (e = 0 lands on the half subnormal 2^-15 m). The e4m3 block scale becomes a half the
// same way (bits << 7: 2^-8 times its value; 0x7F / 0xFF stay NaN), so with
//   factor = float(scale half) * 2^22 = e4m3 * 2^14,   element = float(nibble half) * factor
// is e2m1 * e4m3 exactly (2 and 4 significant bits), every product in fp32.
// (PTX cvt.rn.f16x2.e2m1x2 exists on sm_100a / sm_120a only; kgen compiles for sm_100 and sm_120,
// where it is not available, so the bit placement serves every arch.)
__device__ __forceinline__ float2 fp4x2_scaled(unsigned byte) {  // (low, high) nibble, each x 2^-14
  const unsigned u = (byte | (byte << 12)) & 0x000F000Fu;           // low nibble at bit 0, high at 16
  const unsigned h = ((u & 0x00080008u) << 12) | ((u & 0x00070007u) << 9);
  __half2 v;
  memcpy(&v, &h, 4);
  return __half22float2(v);
}

// An e4m3 block scale times 2^14 (undoing the nibbles' 2^-14), exact; NaN for 0x7F and 0xFF.
__device__ __forceinline__ float fp4_group_factor(unsigned char e4m3) {
  const unsigned b = e4m3;
  const unsigned short h = (unsigned short)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7) |
                                            ((b & 0x7Fu) == 0x7Fu ? 0x7C00u : 0u));
  __half x;
  memcpy(&x, &h, 2);
  return __half2float(x) * 4194304.0f;
}

// N (a multiple of 8, within one 16-element group) nvfp4 elements of a row at byte p, times their
// group's scale: 8 elements a 32-bit word.
template <int N>
__device__ __forceinline__ void load_fp4_as_float(const fp4x2* p, unsigned char scale, float* dst) {
  static_assert(N % 8 == 0 && N <= 16, "whole words of one scale group");
  const float f = fp4_group_factor(scale);
  constexpr int BYTES = N / 2;
  typedef typename AliasVec<BYTES>::type V;
  const V raw = *reinterpret_cast<const V*>(p);
  unsigned w[BYTES / 4];
  memcpy(w, &raw, BYTES);
#pragma unroll
  for (int k = 0; k < BYTES / 4; ++k) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float2 e = fp4x2_scaled((w[k] >> (8 * b)) & 0xFFu);
      dst[k * 8 + 2 * b] = e.x * f;
      dst[k * 8 + 2 * b + 1] = e.y * f;
    }
  }
}

// N elements of T at p as floats: vector loads of up to 16 bytes (p aligned to
// min(16, N * sizeof(T))), packed conversions; element by element when N * sizeof(T)
// is not a whole number of words.
template <class T, int N>
__device__ __forceinline__ void load_as_float(const T* p, float* dst) {
  constexpr int BYTES = N * (int)sizeof(T);
  if constexpr (BYTES % 4 != 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = to_float(p[i]);
  } else {
    constexpr int PIECE = BYTES >= 16 ? 16 : BYTES;
    constexpr int WORDS = PIECE / 4;
    constexpr int PER = Widen<T>::PER_WORD;
#pragma unroll
    for (int piece = 0; piece < BYTES / PIECE; ++piece) {
      typedef typename AliasVec<PIECE>::type V;
      const V raw = *reinterpret_cast<const V*>(reinterpret_cast<const unsigned char*>(p) + piece * PIECE);
      unsigned w[WORDS];
      memcpy(w, &raw, PIECE);
#pragma unroll
      for (int k = 0; k < WORDS; ++k) Widen<T>::word(w[k], dst + (piece * WORDS + k) * PER);
    }
  }
}

}  // namespace kgen
