// The per-tile online-softmax update of the attention bodies, with one numeric choice.
//
// A row's state is a SoftmaxState (softmax.cuh). Per tile: the row's max over the tile's logits
// raises m (raise; the factor it returns rescales the row's output accumulators), then each logit
// weighs p = exp(logit - m), computed as
//
//   p = 2^(x c - mb),  c = x_scale log2(e),  mb = m log2(e)    (weight: one FFMA and one MUFU.EX2)
//
// where x is the logit (x_scale 1) or, for a LINEAR logit (attention/logits.cuh), the raw product
// (x_scale the positive logit scale: the max is taken on raw products and scaled once a row).
// A masked logit is -inf and weighs 0 with no test; a row with no key seen yet (m = -inf, all its
// logits -inf) takes a finite mb (-FLT_MAX: one FMNMX, no test), never the NaN of -inf - -inf;
// every other row's mb is m log2(e) itself. The row's sum of weights l is added by
// the caller (each lane its share; quad_sum adds an MMA row's lanes' shares at the end).
//
//   quad_max, quad_sum   over the four lanes of an m16n8 C fragment's row (lanes 4g .. 4g + 3)
//   scale_row            an m16n8 C-fragment row's accumulators times f (the rescale of O)
//
// Provided by kgen to both compilers as "kgen/attention/softmax_tile.cuh" (kgen/compile/provided.py);
// needs kgen/platform.cuh and kgen/softmax.cuh before it.
#pragma once

namespace kgen {

struct TileSoftmax {
  static constexpr float LOG2E = 1.4426950408889634f;
  float x_scale;  // logit = x * x_scale (> 0)
  float c;        // x_scale * log2(e)

  static __device__ __forceinline__ TileSoftmax of(float x_scale) { return TileSoftmax{x_scale, x_scale * LOG2E}; }

  // The row's max m_x over the tile (of x; -inf: nothing seen) raises its state: returns the factor
  // for the row's accumulators and sets mb, the exponent's offset for its weights.
  __device__ __forceinline__ float raise(SoftmaxState& st, float m_x, float& mb) const {
    const float f = st.raise_max(m_x * x_scale);
    mb = fmaxf(st.m * LOG2E, -3.402823466e38f);  // -FLT_MAX where m = -inf
    return f;
  }

  // exp(logit - m) of x (0 for a masked -inf).
  __device__ __forceinline__ float weight(float x, float mb) const { return fast_exp2(fmaf(x, c, -mb)); }
};

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1, 32));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2, 32));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1, 32);
  return v + __shfl_xor_sync(0xffffffffu, v, 2, 32);
}

// Row rr (0: g, 1: g + 8) of N m16n8 C fragments (acc[n][0..1] row g, acc[n][2..3] row g + 8) times f;
// the flat form takes the fragments as N / 4 runs of four (a wgmma accumulator).
template <int N>
__device__ __forceinline__ void scale_row(float (&acc)[N][4], int rr, float f) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][2 * rr] *= f, acc[n][2 * rr + 1] *= f;
}
template <int N>
__device__ __forceinline__ void scale_row(float (&acc)[N], int rr, float f) {
#pragma unroll
  for (int n = 0; n < N / 4; ++n) acc[4 * n + 2 * rr] *= f, acc[4 * n + 2 * rr + 1] *= f;
}

}  // namespace kgen
