// ABI 1's call of the Hopper (wgmma) prefill body: the positional signature a hand-written source
// written against ABI 1 calls (`#include "kgen/paged_prefill_wgmma.cuh"`, then
// `kgen::paged_prefill_wgmma_body<Cfg>(...)`, as `kgen show` printed it for an sm_90 target), filling
// the internal body's Params (templates/abi1/paged_prefill.cuh says why). Needs kgen/hopper.cuh first.
#pragma once

#include "kgen/abi1/paged_prefill.cuh"
#include "kgen/bodies/paged_prefill_wgmma.cuh"

namespace kgen {

template <class Cfg>
__device__ __forceinline__ void paged_prefill_wgmma_body(
    typename Cfg::out_t* __restrict__ out, const typename Cfg::q_t* __restrict__ q,
    const typename Cfg::kv_t* __restrict__ k_cache, const typename Cfg::kv_t* __restrict__ v_cache,
    const int* __restrict__ q_indptr, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    typename Cfg::scale_arg_t k_scale, typename Cfg::scale_arg_t v_scale, const float* __restrict__ alibi_slopes,
    float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ lse, int num_seqs,
    int max_blocks_per_seq, int max_partitions, long long q_s_tok, long long q_s_head, long long o_s_tok,
    long long o_s_head, long long k_s_block, long long k_s_head, long long k_s_token, long long k_s_run,
    long long v_s_block, long long v_s_head, long long v_s_token, long long v_s_run, long long ks_s_block,
    long long ks_s_head, long long ks_s_token, long long vs_s_block, long long vs_s_head, long long vs_s_token,
    int partition_tokens = 0, const float* __restrict__ sinks = nullptr) {
  const abi1::PrefillParams<Cfg> p = {
      out, q, k_cache, v_cache, q_indptr, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, part_o, part_ml,
      lse, num_seqs, max_blocks_per_seq, max_partitions, q_s_tok, q_s_head, o_s_tok, o_s_head, k_s_block, k_s_head,
      k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run, ks_s_block, ks_s_head, ks_s_token, vs_s_block,
      vs_s_head, vs_s_token, partition_tokens, sinks};
  paged_prefill_wgmma_body<abi1::PrefillCfg<Cfg>>(p);
}

}  // namespace kgen
