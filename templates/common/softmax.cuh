// The online-softmax state of kgen's attention bodies, the logit adjustments and the split-KV
// contract. Every attention source includes it (decode, prefill and MLA).
//
//   SoftmaxState           running max m and sum l of one row and its merges: merge (two states:
//                          lanes, warps, KV partitions), add (one logit; the SoftmaxState test's,
//                          no body calls it), raise_max (a tile's max raises m: the first half of
//                          a tile update), add_sink, inv_sum, lse. Their factors are __expf of a
//                          difference, with a guard for an empty state (rescale).
//   adjust_logit           a logit's adjustments after the scaled dot product (soft-cap, ALiBi)
//   split_partitions,      the split-KV contract: how many partitions a sequence has and which
//   clip_to_partition      keys partition z holds (the bodies and the merge agree through these)
//   run_offset             a head_dim element's offset in a cached row cut into runs (vLLM K)
//
// Not here: the split-KV merge kernel's body (merge_partitions_body, paged_prefill_merge_body) is
// attention/epilogue.cuh's, beside the partials' layout and the output's stores. The per-tile update (a tile's row max, raise m, rescale O, weigh each logit, the row
// sum) is attention/softmax_tile.cuh's TileSoftmax, one numeric (exp2 with log2(e) folded into the
// scale, one FFMA a logit); every attention body uses it (dense decode, decode-mma, prefill, Hopper
// prefill, and the MLA bodies paged_mla.cuh and paged_mla_wgmma.cuh). Which keys a row sees is
// attention/visibility.cuh; the logit policy (when the scale may fold into the exponent),
// attention/logits.cuh.
//
// Provided by kgen to both compilers as "kgen/softmax.cuh" (kgen/compile/provided.py); needs
// kgen/platform.cuh (KGEN_NEG_INF, from_float) before it.
#pragma once

namespace kgen {

// Online softmax of one row: running max m of the logits seen, running sum l of
// exp(logit - m). The caller keeps the accumulator (sum of exp(logit - m) * value) and
// rescales it with the factors merge() returns: acc = acc * f.self + acc_other * f.other.
// The empty state (no key seen) is m = -inf, l = 0; its factor is 0, never the NaN of
// exp(-inf - -inf), and its LSE is -inf. Used for every merge: one logit into a row's state,
// a tile's max, token groups by shuffles, warps through shared memory, KV partitions.
struct SoftmaxFactors {
  float self, other;
};

struct SoftmaxState {
  float m, l;

  static __device__ __forceinline__ SoftmaxState empty() { return SoftmaxState{KGEN_NEG_INF, 0.0f}; }

  // exp(m_from - m_to): what a quantity accumulated against max m_from weighs against m_to.
  static __device__ __forceinline__ float rescale(float m_from, float m_to) {
    return m_from == KGEN_NEG_INF ? 0.0f : __expf(m_from - m_to);
  }

  // this := this (+) other; returns the factors for this state's and other's accumulators.
  __device__ __forceinline__ SoftmaxFactors merge(SoftmaxState other) {
    const float m_new = fmaxf(m, other.m);
    const SoftmaxFactors f{rescale(m, m_new), rescale(other.m, m_new)};
    l = l * f.self + other.l * f.other;
    m = m_new;
    return f;
  }

  // One (finite) logit s: merge() with the single-element state (s, 1), whose own factor
  // exp(s - m_new) needs no guard.
  __device__ __forceinline__ SoftmaxFactors add(float s) {
    const float m_new = fmaxf(m, s);
    const SoftmaxFactors f{rescale(m, m_new), __expf(s - m_new)};
    l = l * f.self + f.other;
    m = m_new;
    return f;
  }

  // A tile of logits at once: raise m to at least m_tile (nothing added yet) and return the
  // factor for this state's accumulators; the caller then adds each logit s with weight
  // exp(s - m) to l itself. m_tile = -inf (no logit) leaves an empty state empty.
  __device__ __forceinline__ float raise_max(float m_tile) {
    const float m_new = fmaxf(m, m_tile);
    const float f = rescale(m, m_new);
    l *= f;
    m = m_new;
    return f;
  }

  // An attention sink (docs/abi.md): a virtual key of logit `sink` and value zero, merged ONCE
  // into a row's final state (never per partition); returns the factor for the row's accumulator.
  // An empty row becomes (sink, 1): its output 0, its LSE the sink.
  __device__ __forceinline__ float add_sink(float sink) { return merge(SoftmaxState{sink, 1.0f}).self; }

  __device__ __forceinline__ float inv_sum() const { return l > 0.0f ? 1.0f / l : 0.0f; }
  __device__ __forceinline__ float lse() const { return m + logf(l); }  // -inf + log(0) = -inf when empty
};

// One query head's logit adjustments after the scaled dot product, in the ABI's order (docs/abi.md):
// the soft-cap, then the ALiBi bias slope * (key_pos - query_pos). (The mask comes last, in
// each body.)
template <class Cfg>
__device__ __forceinline__ float adjust_logit(float s, float alibi_slope, int key_pos, int query_pos) {
  if (Cfg::SOFT_CAP > 0.0f) s = Cfg::SOFT_CAP * tanhf(s / Cfg::SOFT_CAP);
  if (Cfg::ALIBI) s += alibi_slope * (float)(key_pos - query_pos);
  return s;
}

// ---- split-KV (flash-decoding): the call's plan (kgen/plan/split.py) chooses
// partition_tokens P and max_partitions at call time. Partition z holds keys [z * P, (z + 1) * P),
// the last one everything to the end of the sequence (so a plan made for shorter lengths still
// gives the right answer). Each block writes its normalised partial output and (m, l); the merge
// kernel (attention/epilogue.cuh) combines them.

// The partitions a sequence of kv_len keys has (a block of a later partition writes nothing,
// and the merge reads exactly these).
__device__ __forceinline__ int split_partitions(int kv_len, int partition_tokens, int max_partitions) {
  return min((kv_len + partition_tokens - 1) / partition_tokens, max_partitions);
}

// Narrow the keys [lo, hi) a block would see to those of partition `part`.
__device__ __forceinline__ void clip_to_partition(int part, int partition_tokens, int max_partitions, int& lo,
                                                  int& hi) {
  lo = max(lo, part * partition_tokens);
  if (part < max_partitions - 1) hi = min(hi, (part + 1) * partition_tokens);
}

// Offset of head_dim element d in a token row cut into runs of RUN contiguous elements,
// consecutive runs `run_stride` elements apart (NHD/HND: one run; vLLM K: runs of x).
template <int RUN>
__device__ __forceinline__ long long run_offset(int d, long long run_stride) {
  return (long long)(d / RUN) * run_stride + d % RUN;
}

}  // namespace kgen
