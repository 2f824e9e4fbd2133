// The fp8_ds_mla latent row (docs/abi.md "MLA", kgen/formats/ds_mla.py): 656 bytes a token,
//   [0, 512)   512 e4m3 latent values, [512, 528) 4 fp32 scales (one per 128 latent values),
//   [528, 656) 64 bf16 rope values.
// Read side: the attention body dequantizes a staged row into bf16 operands (e4m3 * scale in fp32,
// one rounding to bf16, as FlashMLA computes in bf16). Write side: the scale rule of
// kgen/quantize.py (FlashMLA's tests/quant.py): scale = the smallest power of two >= max(amax / 448,
// 1e-4), stored = e4m3(x / scale).
//
// Needs cuda_bf16.h, cuda_fp8.h and kgen/platform.cuh before it; includes convert.cuh (the fp8 pair
// conversion).
#pragma once

#include "kgen/convert.cuh"

namespace kgen {

struct DsMlaRow {
  static constexpr int LATENT = 512, ROPE = 64, TILE = 128, TILES = 4, HEAD_DIM = LATENT + ROPE;
  static constexpr int SCALES_AT = LATENT, ROPE_AT = SCALES_AT + 4 * TILES, BYTES = ROPE_AT + 2 * ROPE;
  static_assert(BYTES == 656 && BYTES % 16 == 0, "a row is 41 16-byte units");
};

// Two e4m3 values (low byte first) times the tile scale, as two bf16 in one register.
__device__ __forceinline__ unsigned ds_mla_dequant2(unsigned short two, float scale) {
  const float2 f = fp8x2_to_float2<__NV_E4M3>(two);  // exact: e4m3 values are fp16 values
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);  // one rounding each
  unsigned r;
  memcpy(&r, &b, 4);
  return r;
}

// Elements [d0, d0 + 8) of a staged row (d0 a multiple of 8) as eight bf16 in one 16-byte word.
__device__ __forceinline__ uint4 ds_mla_dequant8(const unsigned char* __restrict__ row, int d0) {
  typedef DsMlaRow R;
  if (d0 >= R::LATENT) return *reinterpret_cast<const uint4*>(row + R::ROPE_AT + (d0 - R::LATENT) * 2);
  const float s = *reinterpret_cast<const float*>(row + R::SCALES_AT + (d0 / R::TILE) * 4);
  const uint2 v = *reinterpret_cast<const uint2*>(row + d0);
  uint4 w;
  w.x = ds_mla_dequant2((unsigned short)(v.x & 0xFFFFu), s);
  w.y = ds_mla_dequant2((unsigned short)(v.x >> 16), s);
  w.z = ds_mla_dequant2((unsigned short)(v.y & 0xFFFFu), s);
  w.w = ds_mla_dequant2((unsigned short)(v.y >> 16), s);
  return w;
}

// The smallest power of two >= v (v > 0 finite, or inf), exactly: FlashMLA's 2^ceil(log2(v)).
__device__ __forceinline__ float ds_mla_pow2_ceil(float v) {
  const unsigned bits = __float_as_uint(v);
  if ((bits & 0x007FFFFFu) == 0u || bits >= 0x7F800000u) return v;  // a power of two already, or inf
  return __uint_as_float((bits & 0x7F800000u) + 0x00800000u);      // next exponent, mantissa 0
}

}  // namespace kgen
