// How an attention body finishes a row, once: the dense decode, decode-mma, prefill and Hopper prefill
// bodies end the same way, whatever their tiles. A finished row (query row `row`: a decode sequence
// or a prefill query token; query head h) has its softmax state st and an accumulator, which the body
// normalises (1 / l, and V's scale where the cache has one) and hands over element by element:
//
//   Epilogue<Cfg>::of(p, o_s_row, part)  the prologue: the launch's output side read off the body's
//                        Params (out and its strides, the split-KV scratch, lse, sinks) and whether
//                        the block writes partials (split: Cfg::SPLIT and more than one partition)
//   sink(st, h)          the row's attention sink merged into its final state, ONCE: single pass
//                        only (a partial holds none; the merge kernel, softmax.cuh, adds it); returns
//                        the accumulator's factor (1 without a sink or when split); fold_sink(st, h,
//                        acc) multiplies acc by it
//   element(row, h, d, x)  element d of the row: the output (out_t) or the partition's normalised
//                        partial, part_o [rows, NUM_Q_HEADS, max_partitions, V_HEAD_DIM]
//   state(st, row, h)    the row's state: (m, l) into part_ml [rows, NUM_Q_HEADS, max_partitions, 2]
//                        when split, else its LSE when the caller asked for one
//   finish(st, row, h, d, acc, v)  the decode bodies' per-element form of the three: acc times the
//                        sink's factor, 1 / l and v, in that order; the state with element 0
//
// Each body keeps its order of the products (accumulator, sink factor, 1 / l, V's scale): floating-
// point products do not reassociate, and the outputs stay bit-identical to the bodies' before this
// part. The prologue lives here, not in a part of its own: the Params fields it reads are exactly the
// ones the epilogue writes through, plus the split flag both ends read (the block's partition of the
// keys at the top, partials or the output at the end). The K/V pool's fields are the loads' (the
// KV-format part), the query's the body's Q load's.
//
// Provided by kgen to both compilers as "kgen/attention/epilogue.cuh" (kgen/compile/provided.py);
// needs kgen/platform.cuh (from_float) and kgen/softmax.cuh (SoftmaxState) before it.
#pragma once

namespace kgen {

template <class Cfg>
struct Epilogue {
  typedef typename Cfg::out_t out_t;
  static constexpr int DV = Cfg::V_HEAD_DIM;  // the output's width

  out_t* __restrict__ out;
  float* __restrict__ part_o;
  float* __restrict__ part_ml;
  float* __restrict__ lse;
  const float* __restrict__ sinks;
  long long o_s_row, o_s_head;  // out's strides: a row (o_s_seq, o_s_tok), a head
  int max_partitions, part;
  bool split;  // Cfg::SPLIT and more than one partition: this block writes a partial

  template <class Params>
  static __device__ __forceinline__ Epilogue of(const Params& p, long long o_s_row, int part) {
    return Epilogue{p.out, p.part_o, p.part_ml, p.lse, p.sinks, o_s_row, p.o_s_head, p.max_partitions, part,
                    Cfg::SPLIT && p.max_partitions > 1};
  }

  __device__ __forceinline__ void fold_sink(SoftmaxState& st, int h, float& acc) const {
    if (sinks != nullptr && !split) acc *= st.add_sink(sinks[h]);
  }
  __device__ __forceinline__ float sink(SoftmaxState& st, int h) const {
    float f = 1.0f;
    fold_sink(st, h, f);
    return f;
  }

  // The row's partial of this partition: its index in part_o's rows and part_ml's pairs.
  __device__ __forceinline__ long long partial(int row, int h) const {
    return ((long long)row * Cfg::NUM_Q_HEADS + h) * max_partitions + part;
  }

  // The two ends of a block, split or not, each on its own (element and state pick one).
  __device__ __forceinline__ void partial_element(int row, int h, int d, float x) const {
    part_o[partial(row, h) * DV + d] = x;
  }
  __device__ __forceinline__ void output_element(int row, int h, int d, float x) const {
    out[row * o_s_row + (long long)h * o_s_head + d] = from_float<out_t>(x);
  }
  __device__ __forceinline__ void partial_state(const SoftmaxState& st, int row, int h) const {
    float* ml = part_ml + partial(row, h) * 2;
    ml[0] = st.m;
    ml[1] = st.l;
  }
  __device__ __forceinline__ void output_lse(const SoftmaxState& st, int row, int h) const {
    if (lse != nullptr) lse[(long long)row * Cfg::NUM_Q_HEADS + h] = st.lse();
  }

  __device__ __forceinline__ void element(int row, int h, int d, float x) const {
    if (split)
      partial_element(row, h, d, x);
    else
      output_element(row, h, d, x);
  }

  __device__ __forceinline__ void state(const SoftmaxState& st, int row, int h) const {
    if (split)
      partial_state(st, row, h);
    else
      output_lse(st, row, h);
  }

  // Element d of a row whose accumulator acc still takes the sink's factor, 1 / l and V's scale v, in
  // that order, and at d = 0 the row's state. The two ends are spelled apart, each with its own
  // stores: written as element() after fold_sink(), the compiler merges them into one path and the
  // CUDA-core decode of a windowed spec takes 3 registers more (benchmarks/sass_census.py).
  __device__ __forceinline__ void finish(SoftmaxState& st, int row, int h, int d, float acc, float v = 1.0f) const {
    if (split) {
      partial_element(row, h, d, acc * st.inv_sum() * v);
      if (d == 0) partial_state(st, row, h);
    } else {
      fold_sink(st, h, acc);
      output_element(row, h, d, acc * st.inv_sum() * v);
      if (d == 0) output_lse(st, row, h);
    }
  }
};

}  // namespace kgen
