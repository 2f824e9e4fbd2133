// The MLA layout's rows, for both MLA bodies (mma.sync: paged_mla.cuh; wgmma: paged_mla_wgmma.cuh):
// which latent row of the one pool [num_blocks, block_size, HEAD_DIM] a key is, which keys a query
// row sees, and which query rows a block attends.
//
//   LatentRows<Cfg>         the pool a block reads: kv_cache and its per-token kv_scale, the
//     ::of(p, table, indices)  sequence's block-table row (dense) or the row's SPARSE_TOPK entries
//     ::row(pos, s_block, s_token)  key pos's row, as an element offset in a pool of those strides:
//                           a dense row's key pos is the sequence's position pos through the block
//                           table; a sparse row's (SPARSE_TOPK > 0) is entry pos of its indices, a
//                           physical slot block_id * BLOCK_SIZE + offset, or -1 for none (then -1)
//   MlaKeys<Cfg>            which keys a row sees (attention/visibility.cuh): a dense row the
//                           sequence's positions by the causal rule (decode's query is the last key:
//                           DecodeKeys), a sparse row the entries of its list that name a slot
//   MlaRows                 the block's part of a sequence's q_len * NUM_Q_HEADS (query token, head)
//                           rows: row r is token r / NUM_Q_HEADS, head r % NUM_Q_HEADS
//   sparse_key_range<Cfg>   a sparse decode block's entries: all SPARSE_TOPK, or partition z's
//
// Provided by kgen to both compilers as "kgen/attention/latent_rows.cuh" (kgen/compile/provided.py);
// needs kgen/softmax.cuh (the split-KV contract) and attention/visibility.cuh before it.
#pragma once

namespace kgen {

template <class Cfg>
struct LatentRows {
  const typename Cfg::kv_t* __restrict__ kv_cache;
  const float* __restrict__ kv_scale;  // per tensor: [0]; per token: a pool of the rows' scales
  const int* __restrict__ table;       // dense: the sequence's block-table row
  const int* __restrict__ indices;     // sparse: the row's SPARSE_TOPK entries
  long long kv_s_block, kv_s_token, ks_s_block, ks_s_token;

  template <class Params>
  static __device__ __forceinline__ LatentRows of(const Params& p, const int* table, const int* indices) {
    return LatentRows{p.kv_cache, p.kv_scale, table, indices, p.kv_s_block, p.kv_s_token, p.ks_s_block, p.ks_s_token};
  }

  __device__ __forceinline__ long long row(int pos, long long s_block, long long s_token) const {
    constexpr int B = Cfg::BLOCK_SIZE;
    if constexpr (Cfg::SPARSE_TOPK > 0) {
      const int slot = indices[pos];
      return !ListedKeys::listed(slot) ? -1LL : (long long)((unsigned)slot / B) * s_block + ((unsigned)slot % B) * s_token;
    } else {
      return (long long)table[(unsigned)pos / B] * s_block + (pos % B) * s_token;
    }
  }
};

template <class Cfg, bool SPARSE = (Cfg::SPARSE_TOPK > 0)> struct MlaKeys {
  typedef typename PrefillKeys<Cfg>::type prefill;
  typedef typename DecodeKeys<Cfg>::type decode;
};
template <class Cfg> struct MlaKeys<Cfg, true> { typedef ListedKeys prefill, decode; };

struct MlaRows {
  int first;      // the block's first row (of the sequence's q_len * NUM_Q_HEADS)
  int count;      // q_len * NUM_Q_HEADS
  int q_len;      // query tokens of the sequence
  int seq_len;    // keys of the sequence (including the query tokens)
  long long q_row0;  // the sequence's first query token in q, out and lse
};

// The entries [k_begin, k_end) of a sparse decode block of partition `part` (split: partition_tokens
// of them a partition, the merge counting SPARSE_TOPK keys); false for a partition past the last
// (block-uniform: the block writes nothing).
template <class Cfg>
__device__ __forceinline__ bool sparse_key_range(int part, int partition_tokens, int max_partitions, bool split,
                                                 int& k_begin, int& k_end) {
  constexpr int N = Cfg::SPARSE_TOPK;
  static_assert(N > 0, "the sparse bodies need SPARSE_TOPK");
  k_begin = 0, k_end = N;
  if (split) {
    if (part >= split_partitions(N, partition_tokens, max_partitions)) return false;
    clip_to_partition(part, partition_tokens, max_partitions, k_begin, k_end);
  }
  return true;
}

}  // namespace kgen
