// A logit from its q . k product: the one logits policy of the attention bodies.
//
//   logit = soft_cap(dot x scale) + slope x (key - pos)      (soft-cap and ALiBi: adjust_logit, softmax.cuh)
//
// scale is the softmax scale times K's dequantisation scales (per tensor or head: once per block;
// per token: times that key's). The mask comes after (attention/visibility.cuh: -inf).
// LINEAR: no soft-cap and no ALiBi, so the logit is the product times a positive scale and a body
// may keep the raw products, take a row's max on them and fold the scale into the exponent
// (TileSoftmax, attention/softmax_tile.cuh): one FFMA a logit instead of a multiply and an FFMA.
//
// Provided by kgen to both compilers as "kgen/attention/logits.cuh" (kgen/compile/provided.py);
// needs kgen/softmax.cuh before it.
#pragma once

namespace kgen {

template <class Cfg>
struct Logits {
  static constexpr bool LINEAR = !(Cfg::SOFT_CAP > 0.0f) && !Cfg::ALIBI;

  // The logit of product `dot` of a row at position `pos` with key `key`.
  static __device__ __forceinline__ float of(float dot, float scale, float slope, int key, int pos) {
    return adjust_logit<Cfg>(dot * scale, slope, key, pos);
  }

  // What a raw product is multiplied by to make its logit, where a body keeps raw products
  // (LINEAR): scale, kept positive (a negative one's sign goes into Q beforehand), so that a
  // masked -inf stays -inf (a zero scale: 1e-30, every weight 1 all the same; NaN stays NaN).
  static __device__ __forceinline__ float raw_scale(float scale) { return scale == 0.0f ? 1e-30f : scale; }
};

}  // namespace kgen
