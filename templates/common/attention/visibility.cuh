// Which keys a query row sees: the one visibility rule of the attention bodies.
//
// A row whose query sits at position pos of its sequence, whose keys [0, end) exist, sees key k when
//   k < end                            the tail (a decode spec without tail masking promises whole
//                                      blocks: its end is the sequence rounded up to a block)
//   and, CAUSAL, k <= pos              the causal mask
//   and, WINDOW > 0, k > pos - WINDOW  the sliding window: the WINDOW keys up to pos
// Decode's one query is its sequence's last key, so causality is its tail: KeyRule<false, W>.
//
//   KeyRange                   keys [begin, end): a block's, a batch's
//   KeyRule::sees              the mask of one (key, row)
//   KeyRule::rows_keys         the keys some row of a block sees (rows at positions [pos_first, pos_last])
//   KeyRule::tile_unseen       a tile no row of a block sees (it is skipped)
//   KeyRule::full_tiles        the tiles every row of a block sees whole (they need no mask)
//   decode_key_range           a decode block's keys, narrowed to its KV partition (softmax.cuh)
//
// A prefill block's rows are packed (row r of its chunk: query token r / G, head r % G; the chunk's
// first token at position pos0), and its keys come in tiles of KT (both prefill bodies start here):
//
//   PrefillRows::span(off, n)  rows [off, off + n) of the block (a warp's, a warpgroup's): how many
//                              are real, their first and last position (a RowSpan)
//   RowSpan::sees_some         a masked tile some real row of the span sees (else it is skipped)
//   prefill_key_tiles          the block's keys [lo, hi), narrowed to its KV partition, as KeyTiles
//   KeyTiles::full             the tiles a span sees whole (they need no mask): KeyRule::full_tiles
//   FullFirst                  an order of the tiles: the full ones first, then the masked ones
//
// Sparse attention: a row's keys are the entries [0, N) of its own index list, entry k naming a
// cache slot or -1 (none). The list is what the row sees, so over entries the rule is KeyRule<false,
// 0> (every entry below end: no causal mask, no window), and an entry that names no slot is masked
// as a key past end is: ListedKeys, whose listed() tests the entry a body reads with the tile.
//
//   ListedKeys                 KeyRule<false, 0> over a row's entries, and listed(slot)
//
// Provided by kgen to both compilers as "kgen/attention/visibility.cuh" (kgen/compile/provided.py);
// needs kgen/softmax.cuh (the split-KV contract) before it.
#pragma once

namespace kgen {

struct KeyRange {
  int begin, end;
  __device__ __forceinline__ bool contains(int k) const { return k >= begin && k < end; }
  // some of the n keys [k0, k0 + n) is in the range
  __device__ __forceinline__ bool meets(int k0, int n) const { return k0 < end && k0 + n > begin; }
};

template <bool CAUSAL, int WINDOW>
struct KeyRule {
  static __device__ __forceinline__ bool sees(int key, int pos, int end) {
    return key < end && (!CAUSAL || key <= pos) && (WINDOW == 0 || key > pos - WINDOW);
  }

  // The keys a row at position pos sees (of the keys [0, end)): sees(key, pos, end) == row_keys(pos, end).contains(key).
  static __device__ __forceinline__ KeyRange row_keys(int pos, int end) {
    return KeyRange{WINDOW > 0 ? max(0, pos - WINDOW + 1) : 0, CAUSAL ? min(pos + 1, end) : end};
  }

  // The keys some row at positions [pos_first, pos_last] sees: the first row's window start to the
  // last row's diagonal.
  static __device__ __forceinline__ KeyRange rows_keys(int pos_first, int pos_last, int end) {
    return KeyRange{WINDOW > 0 ? max(0, pos_first - WINDOW + 1) : 0, CAUSAL ? pos_last + 1 : end};
  }

  // Keys [kv0, kv0 + n) lie past every row's diagonal or before every row's window.
  static __device__ __forceinline__ bool tile_unseen(int kv0, int n, int pos_first, int pos_last) {
    return (CAUSAL && kv0 > pos_last) || (WINDOW > 0 && kv0 + n - 1 <= pos_first - WINDOW);
  }

  // Tiles [a, b) of the ntiles of KT keys from lo (of the block's keys [lo, hi)) are seen whole by
  // every row at positions [pos_first, pos_last]: inside the last row's window, on or below the first
  // row's diagonal, below hi. a <= b; the tiles before a hold the window's edge, those from b on the
  // diagonal and the tail.
  template <int KT>
  static __device__ __forceinline__ void full_tiles(int lo, int hi, int ntiles, int pos_first, int pos_last, int& a,
                                                    int& b) {
    const int full_end = CAUSAL ? min(hi, pos_first + 1) : hi;
    a = WINDOW > 0 ? min(ntiles, (max(0, pos_last - WINDOW + 1 - lo) + KT - 1) / KT) : 0;
    b = full_end > lo ? min(ntiles, (full_end - lo) / KT) : 0;
    b = max(a, b);
  }
};

// A sparse row's rule over the entries of its index list (above).
struct ListedKeys : KeyRule<false, 0> {
  static __device__ __forceinline__ bool listed(int slot) { return slot >= 0; }
};

// The rule of a Cfg's rows: prefill's by its spec; decode's query is the last key (no causal test).
template <class Cfg> struct PrefillKeys { typedef KeyRule<Cfg::CAUSAL, Cfg::SLIDING_WINDOW> type; };
template <class Cfg> struct DecodeKeys { typedef KeyRule<false, Cfg::SLIDING_WINDOW> type; };

// The keys [tok_begin, tok_end) a decode block sees (both decode bodies start from it): its query's
// (at seq_len - 1), clipped to the block's partition. False when the partition lies past the
// sequence: the block writes nothing (uniform across the block, so no barrier is skipped by
// some threads only).
template <class Cfg>
__device__ __forceinline__ bool decode_key_range(int seq_len, int part, int P, int max_partitions, bool split,
                                                 int& tok_begin, int& tok_end) {
  constexpr int B = Cfg::BLOCK_SIZE;
  // without tail masking the promise is that seq_len is a multiple of B: whole blocks are read
  const int end = Cfg::TAIL_MASK ? seq_len : ((seq_len + B - 1) / B) * B;
  const KeyRange keys = DecodeKeys<Cfg>::type::rows_keys(seq_len - 1, seq_len - 1, end);
  tok_begin = keys.begin, tok_end = keys.end;
  if (split) {
    if (part >= split_partitions(seq_len, P, max_partitions)) return false;
    clip_to_partition(part, P, max_partitions, tok_begin, tok_end);
  }
  return true;
}

// Rows of a prefill block at positions [pos_first, pos_last], `rows` of them real (<= 0: none).
template <class Keys>
struct RowSpan {
  int rows, pos_first, pos_last;
  // Some real row of the span may see some of the keys [kv0, kv0 + n) (a masked tile; else skipped).
  __device__ __forceinline__ bool sees_some(int kv0, int n) const {
    return rows > 0 && !Keys::tile_unseen(kv0, n, pos_first, pos_last);
  }
};

// A prefill block: `rows` real rows from packed row r0 of a chunk whose first token is at pos0.
template <class Keys, int G>
struct PrefillRows {
  int pos0, r0, rows;
  // rows [off, off + n) of the block (the first and last real ones' positions)
  __device__ __forceinline__ RowSpan<Keys> span(int off, int n) const {
    return RowSpan<Keys>{rows - off, pos0 + (r0 + off) / G, pos0 + (r0 + min(rows, off + n) - 1) / G};
  }
};

// A block's keys [lo, hi) in n tiles of KT, tile i from key lo + i * KT.
template <class Keys, int KT>
struct KeyTiles {
  int lo, hi, n;
  __device__ __forceinline__ int key0(int i) const { return lo + i * KT; }
  // tiles [a, b) every row of `span` sees whole; those before a (the window's edge) and from b on
  // (the diagonal, the tail) need the mask. Without `any` (a body whose unmasked tiles need every row
  // of the span real, and some is not) none is full: a == b.
  __device__ __forceinline__ void full(const RowSpan<Keys>& span, int& a, int& b, bool any = true) const {
    Keys::template full_tiles<KT>(lo, any ? hi : lo, n, span.pos_first, span.pos_last, a, b);
  }
};

// The keys a prefill block computes: those some row of `block` sees (of the chunk's keys [0, kv_len)),
// narrowed to the block's KV partition `part` when split (P keys each, the last one the rest). False
// when the partition lies past the sequence: the block writes nothing (uniform across the block;
// the merge reads the same count).
template <class Keys, int KT>
__device__ __forceinline__ bool prefill_key_tiles(const RowSpan<Keys>& block, int kv_len, bool split, int part, int P,
                                                  int max_partitions, KeyTiles<Keys, KT>& tiles) {
  const KeyRange keys = Keys::rows_keys(block.pos_first, block.pos_last, kv_len);
  int lo = keys.begin, hi = keys.end;
  if (split) {
    if (part >= split_partitions(kv_len, P, max_partitions)) return false;
    clip_to_partition(part, P, max_partitions, lo, hi);
  }
  tiles = KeyTiles<Keys, KT>{lo, hi, hi > lo ? (hi - lo + KT - 1) / KT : 0};
  return true;
}

// The full tiles [a, b) first (the online softmax takes tiles in any order), then the masked ones
// in key order: at(k) is the tile computed at step k, masked(k) whether it needs the mask.
struct FullFirst {
  int a, nfull;
  static __device__ __forceinline__ FullFirst of(int a, int b) { return FullFirst{b == a ? 0 : a, b - a}; }
  __device__ __forceinline__ int at(int k) const { return k < nfull ? a + k : k - nfull < a ? k - nfull : k; }
  __device__ __forceinline__ bool masked(int k) const { return k >= nfull; }
};

}  // namespace kgen
