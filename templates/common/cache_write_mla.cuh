// Cache write for the mla layout (docs/abi.md "MLA"): store each token's latent row kv[token]
// (head_dim elements: the latent vector, then the rope part) at slot_mapping[token] = block *
// BLOCK_SIZE + offset (negative = skip) of the one pool [num_blocks, block_size, head_dim],
// converted or quantized exactly as cache_write_body does (quantize_value, convert_value, token_scale,
// warp_max from cache_write.cuh, whose numpy model is kgen/quantize.py). A quantized pool has one scale set
// kv_scale: per tensor (read), or per token (written: max|x| / QMAX of the row, 1.0 if not > 0).
//
// fp8_ds_mla (Cfg::DS_MLA; ds_mla_row.cuh): each row is quantized into its 656-byte form, the scale
// of each 128-value tile chosen by kgen/quantize.py's rule (quantize_ds_mla_rows), no kv_scale.
//
// Work decomposition: one warp per token (blockIdx.x * WARPS + warp); lanes stride over head_dim,
// so a warp's loads and stores are contiguous.
#pragma once

namespace kgen {

// One fp8_ds_mla row: lane l quantizes latent values l + 32 j (j < 4) of each 128-value tile, whose
// max |x| the warp reduces (fmaxf: NaN ignored); lanes copy the rope's bf16 bits.
template <class In>
__device__ __forceinline__ void ds_mla_write_row(unsigned char* __restrict__ dst, const In* __restrict__ src,
                                                 int lane) {
  typedef DsMlaRow R;
#pragma unroll
  for (int t = 0; t < R::TILES; ++t) {
    float x[R::TILE / 32], amax = 0.0f;
#pragma unroll
    for (int j = 0; j < R::TILE / 32; ++j) {
      x[j] = to_float(src[t * R::TILE + lane + 32 * j]);
      amax = fmaxf(amax, fabsf(x[j]));
    }
    amax = warp_max(amax);
    // FlashMLA's scale: 2^ceil(log2(max(amax / 448, 1e-4))), amax / 448 an IEEE fp32 division
    const float scale = ds_mla_pow2_ceil(fmaxf(amax / quant_max<__nv_fp8_e4m3>::value, 1e-4f));
    if (lane == 0) *reinterpret_cast<float*>(dst + R::SCALES_AT + 4 * t) = scale;
#pragma unroll
    for (int j = 0; j < R::TILE / 32; ++j)
      dst[t * R::TILE + lane + 32 * j] = quantize_value<__nv_fp8_e4m3>(x[j] / scale).__x;  // exact division
  }
  for (int i = lane; i < R::ROPE; i += 32) memcpy(dst + R::ROPE_AT + 2 * i, src + R::LATENT + i, 2);
}

template <class Cfg>
__device__ __forceinline__ void mla_cache_write_body(
    const typename Cfg::in_t* __restrict__ kv, typename Cfg::kv_t* __restrict__ kv_cache,
    float* __restrict__ kv_scale, const int* __restrict__ slot_mapping, int num_tokens, long long num_slots,
    long long kv_s_tok, long long c_s_block, long long c_s_token, long long cs_s_block, long long cs_s_token) {
  typedef typename Cfg::kv_t kv_t;
  constexpr int D = Cfg::HEAD_DIM;
  constexpr int WARPS = Cfg::NUM_THREADS / 32;
  const long long token = (long long)blockIdx.x * WARPS + threadIdx.x / 32;
  if (token >= num_tokens) return;
  const int slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // -1 = padding token; range is checked on the host
  const long long blk = slot / Cfg::BLOCK_SIZE;
  const int off = slot % Cfg::BLOCK_SIZE;
  const int lane = threadIdx.x % 32;
  const typename Cfg::in_t* src = kv + token * kv_s_tok;
  kv_t* dst = kv_cache + blk * c_s_block + off * c_s_token;

  if constexpr (Cfg::DS_MLA) {
    ds_mla_write_row(reinterpret_cast<unsigned char*>(dst), src, lane);
  } else if constexpr (Cfg::SCALE_MODE == ScaleMode::none) {
    for (int d = lane; d < D; d += 32) dst[d] = convert_value<kv_t>(src[d]);
  } else {
    float scale;
    if constexpr (Cfg::SCALE_MODE == ScaleMode::per_tensor) {
      scale = kv_scale[0];
    } else {
      scale = token_scale<kv_t>(src, D, lane);
      if (lane == 0) kv_scale[blk * cs_s_block + off * cs_s_token] = scale;
    }
    for (int d = lane; d < D; d += 32) dst[d] = quantize_value<kv_t>(to_float(src[d]) / scale);
  }
}

}  // namespace kgen
