// Cache write: store new K/V rows (one per token and KV head) into the paged pool at
// slot_mapping[token] = block * BLOCK_SIZE + offset (negative = skip), quantizing to the
// cache type. The numpy model of every conversion is kgen/quantize.py: keep them in step.
//
// Work decomposition: one warp per (token, K-or-V, KV head) row; blockIdx.x is the
// token, blockIdx.y * WARPS + warp the row kind and head. Lanes stride over the row's width
// (HEAD_DIM for K, V_HEAD_DIM for V; lane, lane + 32, ...), so a warp's stores are contiguous for
// NHD/HND rows. With
// per_token_head scales the warp first reduces max|x| with shuffles, and lane 0 writes
// the row's scale into the scale pool.
//
// Cfg (rendered per spec) supplies the types and compile-time constants.
#pragma once

#include "kgen/attention/traits.cuh"

namespace kgen {

template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

// Largest magnitude each quantized cache type stores (per_token_head: scale = max|x| / QMAX).
template <class T> struct quant_max;
template <> struct quant_max<__nv_fp8_e4m3> { static constexpr float value = 448.0f; };
template <> struct quant_max<__nv_fp8_e5m2> { static constexpr float value = 57344.0f; };
template <> struct quant_max<i8> { static constexpr float value = 127.0f; };

// fp32 (already divided by the scale) -> quantized cache type.
template <class T> __device__ __forceinline__ T quantize_value(float x);
template <> __device__ __forceinline__ __nv_fp8_e4m3 quantize_value<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);  // RNE, |x| > 448 -> ±448, NaN stays NaN
  return r;
}
template <> __device__ __forceinline__ __nv_fp8_e5m2 quantize_value<__nv_fp8_e5m2>(float x) {
  __nv_fp8_e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);  // RNE, |x| > 57344 -> ±57344
  return r;
}
template <> __device__ __forceinline__ i8 quantize_value<i8>(float x) {
  // Clamp first (symmetric range; NaN -> 0): __float2int_rn of an out-of-range float is not portable.
  const float c = x != x ? 0.0f : fminf(fmaxf(x, -127.0f), 127.0f);
  return (i8)__float2int_rn(c);  // round half to even
}

// The largest of the warp's 32 values (every lane gets it).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, 32));
  return v;
}

// A per_token_head row's scale: max|x| / QMAX over the row's D values, which the warp's lanes take in
// turn (lane, lane + 32, ...); every lane gets it. The cache writers of every layout share it.
template <class T, class In>
__device__ __forceinline__ float token_scale(const In* __restrict__ src, int D, int lane) {
  float amax = 0.0f;
  for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
  float scale = warp_max(amax) / quant_max<T>::value;
  if (!(scale > 0.0f)) scale = 1.0f;  // all-zero (or underflowing) row: any scale stores zeros
  return scale;
}

// nvfp4 (kgen/formats/nvfp4.py): fp32 (already divided by the group's scale) -> e2m1 nibble, round
// to nearest even (a midpoint goes to the even code), saturating to ±6; -0 for a negative value that
// rounds to zero, +0 for NaN.
__device__ __forceinline__ unsigned e2m1_rn_sat(float y) {
  const float a = fabsf(y);
  const unsigned code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f);
  return code | (y == y ? (__float_as_uint(y) >> 31) << 3 : 0u);
}

// One nvfp4 row of D elements: a lane per 16-element group. amax_g (NaN ignored), s_g = e4m3(amax_g /
// (6 ts)) saturating, t_g = s_g * ts, nibble = e2m1(x / t_g); a group whose s_g is 0 stores zeros.
template <int D, class In>
__device__ __forceinline__ void write_fp4_row(const In* src, unsigned char* row, unsigned char* scales, float ts,
                                              int lane) {
  for (int g = lane; g < D / 16; g += 32) {
    float x[16];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      x[i] = to_float(src[g * 16 + i]);
      amax = fmaxf(amax, fabsf(x[i]));
    }
    const __nv_fp8_storage_t s = __nv_cvt_float_to_fp8(amax / (6.0f * ts), __NV_SATFINITE, __NV_E4M3);
    const float sf = __half2float(__half(__nv_cvt_fp8_to_halfraw(s, __NV_E4M3)));
    const float t = sf * ts;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned lo = e2m1_rn_sat(x[2 * i] / t), hi = e2m1_rn_sat(x[2 * i + 1] / t);
      row[g * 8 + i] = sf == 0.0f ? (unsigned char)0 : (unsigned char)(lo | (hi << 4));
    }
    scales[g] = s;
  }
}

// Float cache: same type is a plain copy; otherwise widen to fp32 and round to nearest even.
template <class T, class In>
__device__ __forceinline__ T convert_value(In x) {
  if constexpr (same_type<T, In>::value) {
    return x;
  } else {
    return from_float<T>(to_float(x));
  }
}

template <class Cfg>
__device__ __forceinline__ void cache_write_body(
    const typename Cfg::in_t* __restrict__ key, const typename Cfg::in_t* __restrict__ value,
    typename Cfg::kv_t* __restrict__ k_cache, typename Cfg::kv_t* __restrict__ v_cache,
    typename Cfg::scale_arg_t k_scale, typename Cfg::scale_arg_t v_scale, const int* __restrict__ slot_mapping,
    long long num_slots, long long key_s_tok, long long key_s_head, long long val_s_tok, long long val_s_head,
    long long k_s_block, long long k_s_head, long long k_s_token, long long k_s_run, long long v_s_block,
    long long v_s_head, long long v_s_token, long long v_s_run, long long ks_s_block, long long ks_s_head,
    long long ks_s_token, long long vs_s_block, long long vs_s_head, long long vs_s_token) {
  typedef typename Cfg::in_t in_t;
  typedef typename Cfg::kv_t kv_t;
  constexpr int H = Cfg::NUM_KV_HEADS;
  constexpr int WARPS = Cfg::NUM_THREADS / 32;
  const long long token = blockIdx.x;
  const int slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // -1 = padding token; range is checked on the host
  const long long blk = slot / Cfg::BLOCK_SIZE;
  const int off = slot % Cfg::BLOCK_SIZE;
  const int lane = threadIdx.x % 32;

  for (int row = blockIdx.y * WARPS + threadIdx.x / 32; row < 2 * H; row += gridDim.y * WARPS) {
    const bool is_v = row >= H;
    const int h = is_v ? row - H : row;
    const in_t* src = is_v ? value + token * val_s_tok + h * val_s_head : key + token * key_s_tok + h * key_s_head;
    kv_t* dst = is_v ? v_cache + blk * v_s_block + h * v_s_head + off * v_s_token
                     : k_cache + blk * k_s_block + h * k_s_head + off * k_s_token;
    const long long s_run = is_v ? v_s_run : k_s_run;
    const int run = is_v ? Cfg::V_RUN : Cfg::K_RUN;
    const int D = is_v ? Cfg::V_HEAD_DIM : Cfg::HEAD_DIM;  // the row's width (warp-uniform)

    if constexpr (ScaleModeOf<Cfg>::value == ScaleMode::block) {  // nvfp4: the row's bytes and its block scales
      const auto& sc = is_v ? v_scale : k_scale;
      unsigned char* pool = reinterpret_cast<unsigned char*>(
          is_v ? sc.block + blk * vs_s_block + h * vs_s_head + off * vs_s_token
               : sc.block + blk * ks_s_block + h * ks_s_head + off * ks_s_token);
      write_fp4_row<Cfg::HEAD_DIM>(src, reinterpret_cast<unsigned char*>(dst), pool, *sc.tensor, lane);  // nvfp4: V as wide as K
    } else if constexpr (ScaleModeOf<Cfg>::value == ScaleMode::none) {
      for (int d = lane; d < D; d += 32) dst[(d / run) * s_run + d % run] = convert_value<kv_t>(src[d]);
    } else {
      const float* scales = is_v ? v_scale : k_scale;
      float scale;
      if constexpr (ScaleModeOf<Cfg>::value == ScaleMode::per_tensor) {
        scale = scales[0];
      } else if constexpr (ScaleModeOf<Cfg>::value == ScaleMode::per_head) {
        scale = scales[h];
      } else {
        scale = token_scale<kv_t>(src, D, lane);
        if (lane == 0) {
          float* pool = is_v ? v_scale + blk * vs_s_block + h * vs_s_head + off * vs_s_token
                             : k_scale + blk * ks_s_block + h * ks_s_head + off * ks_s_token;
          *pool = scale;
        }
      }
      for (int d = lane; d < D; d += 32) dst[(d / run) * s_run + d % run] = quantize_value<kv_t>(to_float(src[d]) / scale);
    }
  }
}

}  // namespace kgen
