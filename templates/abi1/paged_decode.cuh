// ABI 1's paged_decode body calls (docs/abi.md, section 6): the positional signatures of
// `kgen::paged_decode_body<Cfg>(out, q, ..., vs_s_token)` and `kgen::paged_decode_merge_body<Cfg>(...)`
// as ABI 1's `kgen show` printed them (`partition_tokens` and `sinks` defaulted at the end), for a
// hand-written decode source that calls kgen's body instead of carrying its own copy. Each fills
// the internal body's Params and calls it (templates/abi1/paged_prefill.cuh says why).
#pragma once

#include "kgen/bodies/paged_decode.cuh"

namespace kgen {
namespace abi1 {

// The internal bodies' Params, from ABI 1's positional parameters (one field each, in their order).
template <class Cfg> struct DecodeParams {
  typename Cfg::out_t* out;
  const typename Cfg::q_t* q;
  const typename Cfg::kv_t *k_cache, *v_cache;
  const int *block_tables, *seq_lens;
  typename Cfg::scale_arg_t k_scale, v_scale;
  const float* alibi_slopes;
  float *part_o, *part_ml, *lse;
  int max_blocks_per_seq, max_partitions;
  long long q_s_seq, q_s_head, o_s_seq, o_s_head;
  long long k_s_block, k_s_head, k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run;
  long long ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head, vs_s_token;
  int partition_tokens;
  const float* sinks;
};

template <class Cfg> struct DecodeMergeParams {
  typename Cfg::out_t* out;
  const float *part_o, *part_ml;
  float* lse;
  const int* seq_lens;
  int max_partitions, partition_tokens;
  long long o_s_seq, o_s_head;
  const float* sinks;
};

}  // namespace abi1

// ABI 1's positional parameters of a decode body call (`partition_tokens` and `sinks` last, defaulted: sources
// written before them still compile), and the Params fields they fill: paged_decode_body's and paged_decode_mma_body's
// (templates/abi1/paged_decode_mma.cuh), written once.
#define KGEN_ABI1_DECODE_PARAMETERS                                                                                    \
  typename Cfg::out_t* __restrict__ out, const typename Cfg::q_t* __restrict__ q,                                      \
    const typename Cfg::kv_t* __restrict__ k_cache, const typename Cfg::kv_t* __restrict__ v_cache,                    \
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,                                            \
    typename Cfg::scale_arg_t k_scale, typename Cfg::scale_arg_t v_scale,                                              \
    const float* __restrict__ alibi_slopes, float* __restrict__ part_o, float* __restrict__ part_ml,                   \
    float* __restrict__ lse, int max_blocks_per_seq, int max_partitions, long long q_s_seq,                            \
    long long q_s_head, long long o_s_seq, long long o_s_head, long long k_s_block, long long k_s_head,                \
    long long k_s_token, long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token,              \
    long long v_s_run, long long ks_s_block, long long ks_s_head, long long ks_s_token,                                \
    long long vs_s_block, long long vs_s_head, long long vs_s_token, int partition_tokens = 0,                         \
    const float* __restrict__ sinks = nullptr
#define KGEN_ABI1_DECODE_FIELDS                                                                                        \
  {out, q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, part_o, part_ml, lse,            \
    max_blocks_per_seq, max_partitions, q_s_seq, q_s_head, o_s_seq, o_s_head, k_s_block, k_s_head, k_s_token,          \
    k_s_run, v_s_block, v_s_head, v_s_token, v_s_run, ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head,        \
    vs_s_token, partition_tokens, sinks}

template <class Cfg>
__device__ __forceinline__ void paged_decode_body(KGEN_ABI1_DECODE_PARAMETERS) {
  const abi1::DecodeParams<Cfg> p = KGEN_ABI1_DECODE_FIELDS;
  paged_decode_body<Cfg>(p);
}

template <class Cfg>
__device__ __forceinline__ void paged_decode_merge_body(typename Cfg::out_t* __restrict__ out,
                                                        const float* __restrict__ part_o,
                                                        const float* __restrict__ part_ml,
                                                        float* __restrict__ lse,
                                                        const int* __restrict__ seq_lens, int max_partitions,
                                                        int partition_tokens, long long o_s_seq,
                                                        long long o_s_head, const float* __restrict__ sinks = nullptr) {
  const abi1::DecodeMergeParams<Cfg> p = {out,      part_o,           part_ml, lse,      seq_lens,
                                          max_partitions, partition_tokens, o_s_seq, o_s_head, sinks};
  paged_decode_merge_body<Cfg>(p);
}

}  // namespace kgen
