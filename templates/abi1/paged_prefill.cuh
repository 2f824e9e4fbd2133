// ABI 1's paged_prefill body call (docs/abi.md, section 6): the positional signature a hand-written
// source written against ABI 1 calls (`#include "kgen/paged_prefill.cuh"`, then
// `kgen::paged_prefill_body<Cfg>(out, q, ..., vs_s_token)`, as `kgen show` printed it), with the shims
// that keep older sources compiling: `partition_tokens` and `sinks` defaulted at the end, and a Cfg
// written before M_TILES or V_HEAD_DIM. It fills the internal body's Params and calls it: kgen's own
// sources call the internal bodies (kgen/bodies/, `const Params&`) directly, so those may change; this
// file may not (a change to it is a new ABI version, templates/abi2/).
#pragma once

#include "kgen/bodies/paged_prefill.cuh"

namespace kgen {
namespace abi1 {

// Cfg::M_TILES, or 1 for a Cfg without it (sources written before m tiles: 16 rows a warp)
template <class Cfg, class = void> struct MTiles { static constexpr int value = 1; };
template <class Cfg> struct MTiles<Cfg, decltype(void(Cfg::M_TILES))> { static constexpr int value = Cfg::M_TILES; };

// An ABI 1 source's Cfg as the internal bodies read it: the constants added since, at ABI 1's values.
template <class Cfg> struct PrefillCfg : Cfg {
  static constexpr int M_TILES = MTiles<Cfg>::value;
  static constexpr int V_HEAD_DIM = CfgVHeadDim<Cfg>::value;
};

// The internal bodies' Params, from ABI 1's positional parameters (one field each, in their order).
template <class Cfg> struct PrefillParams {
  typename Cfg::out_t* out;
  const typename Cfg::q_t* q;
  const typename Cfg::kv_t *k_cache, *v_cache;
  const int *q_indptr, *block_tables, *seq_lens;
  typename Cfg::scale_arg_t k_scale, v_scale;
  const float* alibi_slopes;
  float *part_o, *part_ml, *lse;
  int num_seqs, max_blocks_per_seq, max_partitions;
  long long q_s_tok, q_s_head, o_s_tok, o_s_head;
  long long k_s_block, k_s_head, k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run;
  long long ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head, vs_s_token;
  int partition_tokens;
  const float* sinks;
};

template <class Cfg> struct PrefillMergeParams {
  typename Cfg::out_t* out;
  const float *part_o, *part_ml;
  float* lse;
  const int *q_indptr, *seq_lens;
  int num_seqs, max_partitions, partition_tokens;
  long long o_s_tok, o_s_head;
  const float* sinks;
};

}  // namespace abi1

// ABI 1's positional parameters of a prefill body call (`partition_tokens` and `sinks` last, defaulted: older
// sources compile), and the Params fields they fill: paged_prefill_body's and paged_prefill_wgmma_body's
// (templates/abi1/paged_prefill_wgmma.cuh), written once.
#define KGEN_ABI1_PREFILL_PARAMETERS                                                                                   \
  typename Cfg::out_t* __restrict__ out, const typename Cfg::q_t* __restrict__ q,                                      \
    const typename Cfg::kv_t* __restrict__ k_cache, const typename Cfg::kv_t* __restrict__ v_cache,                    \
    const int* __restrict__ q_indptr, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,          \
    typename Cfg::scale_arg_t k_scale, typename Cfg::scale_arg_t v_scale, const float* __restrict__ alibi_slopes,      \
    float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ lse, int num_seqs,                    \
    int max_blocks_per_seq, int max_partitions, long long q_s_tok, long long q_s_head, long long o_s_tok,              \
    long long o_s_head, long long k_s_block, long long k_s_head, long long k_s_token, long long k_s_run,               \
    long long v_s_block, long long v_s_head, long long v_s_token, long long v_s_run, long long ks_s_block,             \
    long long ks_s_head, long long ks_s_token, long long vs_s_block, long long vs_s_head, long long vs_s_token,        \
    int partition_tokens = 0, const float* __restrict__ sinks = nullptr
#define KGEN_ABI1_PREFILL_FIELDS                                                                                       \
  {out, q, k_cache, v_cache, q_indptr, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, part_o, part_ml,        \
    lse, num_seqs, max_blocks_per_seq, max_partitions, q_s_tok, q_s_head, o_s_tok, o_s_head, k_s_block, k_s_head,      \
    k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run, ks_s_block, ks_s_head, ks_s_token, vs_s_block,        \
    vs_s_head, vs_s_token, partition_tokens, sinks}

template <class Cfg>
__device__ __forceinline__ void paged_prefill_body(KGEN_ABI1_PREFILL_PARAMETERS) {
  const abi1::PrefillParams<Cfg> p = KGEN_ABI1_PREFILL_FIELDS;
  paged_prefill_body<abi1::PrefillCfg<Cfg>>(p);
}

template <class Cfg>
__device__ __forceinline__ void paged_prefill_merge_body(typename Cfg::out_t* __restrict__ out,
                                                         const float* __restrict__ part_o,
                                                         const float* __restrict__ part_ml, float* __restrict__ lse,
                                                         const int* __restrict__ q_indptr,
                                                         const int* __restrict__ seq_lens, int num_seqs,
                                                         int max_partitions, int partition_tokens, long long o_s_tok,
                                                         long long o_s_head,
                                                         const float* __restrict__ sinks = nullptr) {
  const abi1::PrefillMergeParams<Cfg> p = {out,      part_o,         part_ml,          lse,     q_indptr, seq_lens,
                                           num_seqs, max_partitions, partition_tokens, o_s_tok, o_s_head, sinks};
  paged_prefill_merge_body<abi1::PrefillCfg<Cfg>>(p);
}

}  // namespace kgen
