// How an attention body finishes a row, once: the dense decode, decode-mma, prefill, Hopper prefill
// and MLA bodies end the same way, whatever their tiles; and the split-KV merge kernel that turns
// their partials into the output (one place owns the partials' layout and the output's stores). A finished row (query row `row`: a decode sequence
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
//   fragment<N>(st, row, h, col, val, with_state)  a row's N elements from a lane of an MMA fragment:
//                        element col(i) is val(i), already normalised by the caller (the MLA bodies:
//                        no sink), and the state when with_state
//   merge_partitions_body  the merge kernel's body: a row's partitions combined by log-sum-exp and
//                        written through the same output stores; paged_prefill_merge_body, the merge
//                        of packed query rows (prefill: dense and mla)
//
// The output's width DV is Cfg::V_HEAD_DIM, or the MLA layout's V_DIM, else HEAD_DIM (OutWidth).
//
// Each body keeps its order of the products (accumulator, sink factor, 1 / l, V's scale): floating-
// point products do not reassociate, and the outputs stay bit-identical to the bodies' before this
// part. The prologue lives here, not in a part of its own: the Params fields it reads are exactly the
// ones the epilogue writes through, plus the split flag both ends read (the block's partition of the
// keys at the top, partials or the output at the end). The K/V pool's fields are the loads' (the
// KV-format part), the query's the body's Q load's.
//
// Provided by kgen to both compilers as "kgen/attention/epilogue.cuh" (kgen/compile/provided.py);
// needs kgen/platform.cuh (from_float) and kgen/softmax.cuh (SoftmaxState, split_partitions) before it.
#pragma once

namespace kgen {

// The output's width: V_HEAD_DIM (dense), V_DIM (mla: V is the latent row's first V_DIM elements),
// else HEAD_DIM.
template <class Cfg, class = void> struct OutWidth { static constexpr int value = CfgVHeadDim<Cfg>::value; };
template <class Cfg> struct OutWidth<Cfg, decltype(void(Cfg::V_DIM))> { static constexpr int value = Cfg::V_DIM; };

template <class Cfg>
struct Epilogue {
  typedef typename Cfg::out_t out_t;
  static constexpr int DV = OutWidth<Cfg>::value;  // the output's width

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

  // The split-KV scratch: the partials of (row, h) are entries [first_partial, + max_partitions) of
  // part_o's rows and part_ml's pairs; the row's partial of this partition is entry `part`.
  static __device__ __forceinline__ long long first_partial(long long row, int h, int max_partitions) {
    return ((long long)row * Cfg::NUM_Q_HEADS + h) * max_partitions;
  }
  __device__ __forceinline__ long long partial(long long row, int h) const {
    return first_partial(row, h, max_partitions) + part;
  }

  // The two ends of a block, split or not, each on its own (element and state pick one).
  __device__ __forceinline__ void partial_element(long long row, int h, int d, float x) const {
    part_o[partial(row, h) * DV + d] = x;
  }
  __device__ __forceinline__ void output_element(long long row, int h, int d, float x) const {
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

  // A row's N elements held by a lane of an MMA fragment: element col(i) is val(i) (normalised by
  // the caller), i < N; and the row's state when with_state (one lane of the row). The two ends each
  // with their own loop and stores (one branch a row, not an element).
  template <int N, class Col, class Val>
  __device__ __forceinline__ void fragment(const SoftmaxState& st, long long row, int h, Col col, Val val,
                                           bool with_state) const {
    if (split) {
#pragma unroll
      for (int i = 0; i < N; ++i) partial_element(row, h, col(i), val(i));
      if (with_state) partial_state(st, row, h);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) output_element(row, h, col(i), val(i));
      if (with_state) output_lse(st, row, h);
    }
  }
};

// The merge kernel's body: the log-sum-exp merge of the KV partitions of one output row `row` (a
// decode sequence, or a prefill query token, whose sequence has kv_len keys) and query head
// blockIdx.x, from the scratch the Epilogue's partial ends wrote (normalised partial outputs and
// their (m, l)), through its output stores. The partitions hold no sink: with `sinks` (a spec with
// sinks) the merge adds the head's once.
template <class Cfg>
__device__ __forceinline__ void merge_partitions_body(typename Cfg::out_t* __restrict__ out,
                                                      const float* __restrict__ part_o,
                                                      const float* __restrict__ part_ml, float* __restrict__ lse,
                                                      int row, int kv_len, int max_partitions, int partition_tokens,
                                                      long long o_s_row, long long o_s_head,
                                                      const float* __restrict__ sinks = nullptr) {
  typedef Epilogue<Cfg> E;
  constexpr int D = E::DV;
  const E ep{out, nullptr, nullptr, lse, nullptr, o_s_row, o_s_head, max_partitions, 0, false};  // the output end
  const int h = blockIdx.x;
  const int num_parts = split_partitions(kv_len, partition_tokens, max_partitions);
  const long long base = E::first_partial(row, h, max_partitions);
  const float* ml = part_ml + base * 2;
  // every partition's state merged, starting from the sink's (a key of value zero: no accumulator)
  SoftmaxState tot = sinks != nullptr ? SoftmaxState{sinks[h], 1.0f} : SoftmaxState::empty();
  for (int p = 0; p < num_parts; ++p) tot.merge(SoftmaxState{ml[2 * p], ml[2 * p + 1]});
  const float inv = tot.inv_sum();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < num_parts; ++p) {
      // Partials are normalised: partition p weighs l_p * exp(m_p - m); an empty one is not read.
      const float wp = ml[2 * p + 1] * SoftmaxState::rescale(ml[2 * p], tot.m);
      if (wp != 0.0f) acc += part_o[(base + p) * D + d] * wp;
    }
    ep.output_element(row, h, d, acc * inv);
  }
  if (threadIdx.x == 0) ep.output_lse(tot, row, h);
}

// The merge kernel of packed query rows (q_indptr; dense and mla prefill): the partitions of one
// (query token blockIdx.y, query head blockIdx.x), as many as its sequence's seq_len gives.
template <class Cfg, class Params>
__device__ __forceinline__ void paged_prefill_merge_body(const Params& p) {
  const int tok = blockIdx.y;
  int lo = 0, hi = p.num_seqs;  // the token's sequence: the last s with q_indptr[s] <= tok
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.q_indptr[mid] <= tok) lo = mid; else hi = mid;
  }
  merge_partitions_body<Cfg>(p.out, p.part_o, p.part_ml, p.lse, tok, p.seq_lens[lo], p.max_partitions,
                             p.partition_tokens, p.o_s_tok, p.o_s_head, p.sinks);
}

}  // namespace kgen
