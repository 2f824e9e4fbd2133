// MLA decode and sparse MLA prefill on Hopper (sm_90a): warpgroup MMA (wgmma) with both operands of
// both products read by the tensor cores from shared memory (docs/mla.md, "The Hopper body"). Same
// kernel ABI, rows, split-KV partials and merge as paged_mla.cuh's mma.sync decode and sparse bodies,
// for a 16-bit cache in q's type without scales. The sparse entries (SPARSE_TOPK > 0) read key j's row
// at the slot entry j of the row's indices names; -1 is zero-filled and masked. Needs kgen/platform.cuh, async_copy.cuh, convert.cuh, softmax.cuh, mma.cuh
// (pack2) and hopper.cuh before it.
//
// Block (x, seq, z): 64 query heads [64 x, 64 x + 64) of sequence seq (wgmma's M; heads past
// NUM_Q_HEADS are zero queries whose results are dropped), over partition z's keys. Two warpgroups,
// 256 threads, all of them both copying and computing (no producer warpgroup):
//   - every thread issues cp.async copies of the next latent tiles (KV_TILE rows of HEAD_DIM) into a
//     ring of STAGES stages, through the block table, zero-filling keys outside [k_begin, k_end);
//   - S = Q K^T: warpgroup w takes keys [w KT/2, (w + 1) KT/2) of the tile for all 64 rows
//     (HEAD_DIM / 16 wgmma m64 n(KT/2) k16, Q and K both K-major in shared memory);
//   - the two warpgroups' row maxima meet in shared memory, so both rescale by the same running max;
//     each writes its half of P = exp(S - m), rounded to q's type, into a shared P tile [64 x KT];
//   - O += P V: warpgroup w owns output columns [w V_DIM/2, (w + 1) V_DIM/2) and runs KT / 16 wgmma
//     m64 n(V_DIM/2) k16 with P (K-major) and V (the same tile's first V_DIM columns, MN-major)
//     from shared memory. Nothing goes through ldmatrix.
// Each warpgroup sums its own keys' P into its share of l; the shares are added at the end.
// Shared memory (from a 1024-byte aligned base), all 16-bit with the 128-byte swizzle (a tile as
// column blocks of 64 elements, one 128-byte row a query or key, chunk bits [4,7) XORed with row
// bits [7,10)): Q [64 x HEAD_DIM], STAGES tiles [KT x HEAD_DIM], P [64 x 64] (KT <= 64 columns
// used), then the row maxima and sums [2][64] floats each.
// Barriers per tile (uniform trip counts: every thread reaches each): the tile landed (and every
// thread is done with the previous tile, so its stage can be refilled), the maxima exchanged, P
// complete. cp.async writes are generic-proxy writes: each thread fences them (fence.proxy.async)
// before the barrier after which wgmma reads them; P's stores likewise.
// Shared parts (kgen/attention/): the stage ring (StageRing, its landed hook the fence above), the
// keys a row sees (the decode KeyRule or a sparse row's ListedKeys), the softmax scale folded into
// the exponent (Logits, TileSoftmax), the wgmma tile (the swizzle, the accumulator layout, both
// products with the ordering rules of wgmma.fence kept: no C7520 serialisation,
// kgen/compile/wgmma_order.py checks the PTX and SASS) and the epilogue (Epilogue's two ends).
// Every kernel fills a Params struct from its argument table.
#pragma once

#include "kgen/attention/traits.cuh"
#include "kgen/attention/visibility.cuh"
#include "kgen/attention/logits.cuh"
#include "kgen/attention/softmax_tile.cuh"
#include "kgen/attention/stage_ring.cuh"
#include "kgen/attention/epilogue.cuh"  // the Epilogue, and the split-KV merge kernel (the source's merge entry)
#include "kgen/attention/wgmma_tile.cuh"

namespace kgen {

template <class Cfg>
struct MlaWgmmaShape {
  typedef typename Cfg::q_t T;
  static constexpr int D = Cfg::HEAD_DIM, DV = Cfg::V_DIM, HQ = Cfg::NUM_Q_HEADS;
  static constexpr int THREADS = 256, ROWS = 64, KT = Cfg::KV_TILE, STAGES = Cfg::STAGES;
  static constexpr int HALF_KEYS = KT / 2, HALF_COLS = DV / 2;  // each warpgroup's share of S and of O
  // fp8_ds_mla (Cfg::DS_MLA): a stage holds KT rows as stored (656 bytes each), and one pass a tile
  // dequantizes them into the 16-bit operand tile [KT x D] the products read (OP_BYTES after the stages).
  static constexpr bool DS = Cfg::DS_MLA;
  static constexpr int STORED = DS ? DsMlaRow::BYTES : D * 2;  // bytes of a row as stored (and staged)
  static constexpr int Q_BYTES = ROWS * D * 2, OPERAND_BYTES = KT * D * 2, P_BYTES = ROWS * 128;
  static constexpr int TILE_BYTES = DS ? KT * STORED : OPERAND_BYTES;  // one stage
  static constexpr int OP_BYTES = DS ? OPERAND_BYTES : 0;
  static constexpr int RED_BYTES = 2 * 2 * ROWS * 4;  // row maxima and row sums of both warpgroups
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + STAGES * TILE_BYTES + OP_BYTES + P_BYTES + RED_BYTES;  // + slack
  static constexpr int CHUNKS = STORED / 16;     // 16-byte copies of a key row as stored
  static constexpr int Q_CHUNKS = D / 8;         // 16-byte copies of a query row
  static constexpr int TPR = THREADS / KT;       // threads copying one key row
  static constexpr bool CAUSAL = Cfg::CAUSAL;    // moot in decode: the query is the last key
  static_assert(sizeof(T) == 2 && ((sizeof(typename Cfg::kv_t) == 2 && !DS) ||
                                   (DS && D == DsMlaRow::HEAD_DIM && IsSame<T, __nv_bfloat16>::value)) &&
                    ScaleModeOf<Cfg>::value == ScaleMode::none,
                "the Hopper MLA body reads a 16-bit cache in q's type, unscaled, or fp8_ds_mla rows with bf16 q");
  static_assert(D % 64 == 0 && DV % 128 == 0 && DV <= D && HALF_COLS <= 256, "head dims: 128-byte column blocks");
  static_assert(KT == 32 || KT == 64, "KV_TILE: 32 or 64 keys (one P column block)");
  static_assert(DS || CHUNKS % TPR == 0, "a key row's copies split evenly over its threads");
  static_assert(STAGES >= 1 && STAGES <= 4, "stages");
  static_assert(Cfg::NUM_THREADS == THREADS, "two warpgroups");
  static_assert(Logits<Cfg>::LINEAR && Cfg::SOFTMAX_SCALE > 0.0f, "the scale folds into the exponent");
  static_assert(SMEM_BYTES == Cfg::SMEM_BYTES, "shared memory: kgen's geometry and the template disagree");
};

// The output side, attention/epilogue.cuh's Epilogue: out's width is V_DIM (MlaWgOut gives it the
// name the part reads), and an MLA kernel has no sinks (its Params none either: the aggregate, not of()).
template <class Cfg>
struct MlaWgOut : Cfg {
  static constexpr int V_HEAD_DIM = Cfg::V_DIM;
};
template <class Cfg, class Params>
__device__ __forceinline__ Epilogue<MlaWgOut<Cfg>> mla_wg_epilogue(const Params& p, long long o_s_row, int part,
                                                                   bool split) {
  return Epilogue<MlaWgOut<Cfg>>{p.out, p.part_o, p.part_ml, p.lse, nullptr, o_s_row, p.o_s_head, p.max_partitions,
                                 part, split};
}

// Copy keys [tbase, tbase + KT) into `stage` (swizzled); keys outside [k_begin, k_end), and a
// sparse row's unused entries (-1), are zero-filled from a valid address, not read. Key pos is the
// sequence's position pos through its block table, or (SPARSE_TOPK > 0) entry pos of the row's
// indices, a physical slot block_id * BLOCK_SIZE + offset. Thread tid copies chunks tid % TPR,
// + TPR, .. of key row tid / TPR: one block-table or indices read a tile.
template <class Cfg>
__device__ __forceinline__ void mla_wg_issue_tile(unsigned char* __restrict__ stage, int tbase, int k_begin, int k_end,
                                                  const int* __restrict__ table, const int* __restrict__ indices,
                                                  const typename Cfg::kv_t* __restrict__ kv_cache,
                                                  long long kv_s_block, long long kv_s_token) {
  typedef MlaWgmmaShape<Cfg> S;
  constexpr int B = Cfg::BLOCK_SIZE;
  const int r = threadIdx.x / S::TPR, c0 = threadIdx.x % S::TPR, pos = tbase + r;
  bool valid = pos >= k_begin && pos < k_end;
  const typename Cfg::kv_t* src = kv_cache;
  if constexpr (Cfg::SPARSE_TOPK > 0) {
    const int slot = valid ? indices[pos] : -1;
    valid = ListedKeys::listed(slot);
    if (valid) src = kv_cache + (long long)((unsigned)slot / B) * kv_s_block + (long long)((unsigned)slot % B) * kv_s_token;
  } else {
    if (valid) src = kv_cache + (long long)table[(unsigned)pos / B] * kv_s_block +
                     (long long)((unsigned)pos % B) * kv_s_token;
  }
  if constexpr (S::DS) {  // as stored, row after row (656 bytes: 41 copies over TPR threads)
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(src);
#pragma unroll
    for (int j = 0; j < (S::CHUNKS + S::TPR - 1) / S::TPR; ++j) {
      const int c = c0 + j * S::TPR;
      if (c < S::CHUNKS) cp_async<16>(stage + r * S::STORED + 16 * c, bytes + 16 * c, valid ? 16 : 0);
    }
  } else {
#pragma unroll
    for (int j = 0; j < S::CHUNKS / S::TPR; ++j) {
      const int c = c0 + j * S::TPR;
      cp_async<16>(stage + wg_swizzled<S::KT>(r, 8 * c), src + 8 * c, valid ? 16 : 0);
    }
  }
}

// fp8_ds_mla: dequantize a landed stage of stored rows into the swizzled bf16 operand tile
// (ds_mla_row.cuh: e4m3 * tile scale, one rounding; rope copied). A zero-filled row reads as zeros.
template <class Cfg>
__device__ __forceinline__ void mla_wg_dequant_tile(unsigned char* __restrict__ op, const unsigned char* __restrict__ stage) {
  typedef MlaWgmmaShape<Cfg> S;
  constexpr int PER_ROW = S::D / 8;
  for (int i = threadIdx.x; i < S::KT * PER_ROW; i += S::THREADS) {
    const int r = i / PER_ROW, c = i % PER_ROW;
    *reinterpret_cast<uint4*>(op + wg_swizzled<S::KT>(r, 8 * c)) = ds_mla_dequant8(stage + r * S::STORED, 8 * c);
  }
}

// Q of the block's heads [head0, head0 + 64) of query row seq into the swizzled Q tile as cp.async
// copies (zeros past NUM_Q_HEADS).
template <class Cfg>
__device__ __forceinline__ void mla_wg_load_q(unsigned char* q_s, const typename Cfg::q_t* __restrict__ q, int seq,
                                              int head0, long long q_s_seq, long long q_s_head) {
  typedef MlaWgmmaShape<Cfg> S;
  typedef typename S::T T;
  constexpr int HQ = S::HQ;
  for (int i = threadIdx.x; i < S::ROWS * S::Q_CHUNKS; i += S::THREADS) {
    const int r = i / S::Q_CHUNKS, c = i % S::Q_CHUNKS, h = head0 + r;
    const bool valid = h < HQ;
    const T* src = q;
    if (valid) src = q + (long long)seq * q_s_seq + (long long)h * q_s_head + 8 * c;
    cp_async<16>(q_s + wg_swizzled<S::ROWS>(r, 8 * c), src, valid ? 16 : 0);
  }
}

// A thread's two rows finished, once its copies are done: l over the four lanes of a row and both
// warpgroups (red_l: [2][64] floats), then its output columns through the epilogue.
template <class Cfg, int NO>
__device__ __forceinline__ void mla_wg_finish(const Epilogue<MlaWgOut<Cfg>>& ep, SoftmaxState (&st)[2],
                                              const float (&o)[NO], float* red_l, int seq, int head0, int row0,
                                              int wg, int t) {
  typedef MlaWgmmaShape<Cfg> S;
  constexpr int HQ = S::HQ;
  const int col_off = wg * S::HALF_COLS;
  // The row sums: the four lanes of a row, then the two warpgroups' shares through shared memory.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    st[rr].l = quad_sum(st[rr].l);
    if (t == 0) red_l[wg * S::ROWS + row0 + 8 * rr] = st[rr].l;
  }
  __syncthreads();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) st[rr].l = red_l[row0 + 8 * rr] + red_l[S::ROWS + row0 + 8 * rr];

  // The warpgroup's columns of its rows (attention/epilogue.cuh): the output, or this partition's
  // partial; the rows' state (the same in both warpgroups) once, from warpgroup 0.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int h = head0 + row0 + 8 * rr;
    if (h >= HQ) continue;
    const float inv = st[rr].inv_sum();
    if (ep.split) {
#pragma unroll
      for (int e = 0; e < NO; ++e)
        if (wg_row(e) == rr) ep.partial_element(seq, h, col_off + wg_col(e, t), o[e] * inv);
      if (wg == 0 && t == 0) ep.partial_state(st[rr], seq, h);
    } else {
#pragma unroll
      for (int e = 0; e < NO; ++e)
        if (wg_row(e) == rr) ep.output_element(seq, h, col_off + wg_col(e, t), o[e] * inv);
      if (wg == 0 && t == 0) ep.output_lse(st[rr], seq, h);
    }
  }
}

// Which of a thread's NS / 2 keys of a sparse row's tile (entries from tbase, the warpgroup's from
// key_off on) name a slot: bit 2 j + b for key tbase + key_off + 8 j + 2 t + b (the accumulator's columns).
template <int NS>
__device__ __forceinline__ unsigned mla_wg_named(const int* __restrict__ indices, KeyRange seen, int tbase, int key_off,
                                                 int t) {
  unsigned named = 0;
#pragma unroll
  for (int k = 0; k < NS / 2; ++k) {
    const int pos = tbase + key_off + 8 * (k >> 1) + 2 * t + (k & 1);
    named |= (unsigned)(seen.contains(pos) && ListedKeys::listed(indices[pos])) << k;
  }
  return named;
}

// One block's attention: heads [head0, head0 + 64) of query row `row` (decode: a sequence; sparse
// prefill: a query token) over keys [k_begin, k_end) of `table` (a block-table row) or of `indices`
// (a sparse row's SPARSE_TOPK entries: ListedKeys); ep: where the rows go (the output and LSE, or
// with ep.split partition ep.part's partial and (m, l)).
// Keys: which keys the rows see (no causal mask here: decode's query is the last key, and a sparse
// row's list is what it sees), within [k_begin, k_end).
template <class Cfg, class Keys>
__device__ __forceinline__ void mla_wg_attend(const Epilogue<MlaWgOut<Cfg>>& ep, const typename Cfg::q_t* __restrict__ q,
                                              const typename Cfg::kv_t* __restrict__ kv_cache,
                                              const int* __restrict__ table, const int* __restrict__ indices, int row,
                                              int head0, int k_begin, int k_end, long long q_s_seq, long long q_s_head,
                                              long long kv_s_block, long long kv_s_token) {
  typedef MlaWgmmaShape<Cfg> S;
  typedef typename S::T T;
  constexpr int D = S::D, HQ = S::HQ, KT = S::KT, STAGES = S::STAGES, NS = S::HALF_KEYS / 2, NO = S::HALF_COLS / 2;
  constexpr bool SPARSE = Cfg::SPARSE_TOPK > 0;
  // The warpgroup index broadcast from lane 0: ptxas then knows it is warp-uniform, and so is every
  // branch derived from it (a wgmma in possibly divergent code is serialised: advisory C7520).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int seq = row;

  KGEN_DYNAMIC_SMEM(unsigned char, smem_raw);
  unsigned char* base = smem_align_1024(smem_raw);  // the 1024 bytes of slack in SMEM_BYTES
  unsigned char* q_s = base;
  unsigned char* tiles = base + S::Q_BYTES;
  unsigned char* op_s = tiles + STAGES * S::TILE_BYTES;  // fp8_ds_mla: the dequantized tile (OP_BYTES)
  unsigned char* p_s = op_s + S::OP_BYTES;
  float* red_m = reinterpret_cast<float*>(p_s + S::P_BYTES);  // [2][64]: each warpgroup's tile maxima
  float* red_l = red_m + 2 * S::ROWS;                          // [2][64]: each warpgroup's row sums

  mla_wg_load_q<Cfg>(q_s, q, seq, head0, q_s_seq, q_s_head);  // in the first copy group
  const int tile0 = k_begin / KT * KT;
  const int ntiles = k_end > k_begin ? (k_end - tile0 + KT - 1) / KT : 0;
  auto issue = [&](int tile) {
    mla_wg_issue_tile<Cfg>(tiles + (tile % STAGES) * S::TILE_BYTES, tile0 + tile * KT, k_begin, k_end, table,
                           indices, kv_cache, kv_s_block, kv_s_token);
  };
  StageRing<STAGES>::start(ntiles, issue);  // attention/stage_ring.cuh

  // The thread's two rows (of the warpgroup's 64, the wgmma accumulator layout) and its keys and
  // output columns: warpgroup wg's half of each tile's keys and of the output.
  const int row0 = 16 * ((tid % 128) / 32) + g;
  const int key_off = wg * S::HALF_KEYS, col_off = wg * S::HALF_COLS;
  SoftmaxState st[2] = {SoftmaxState::empty(), SoftmaxState::empty()};  // l: this warpgroup's keys only
  float o[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) o[i] = 0.0f;
  float sacc[NS];

  // Descriptors made once: Q and K K-major (8-row groups 1024 bytes apart), P K-major, V MN-major
  // (the next 64 columns KT * 128 bytes on, the next 8 keys 1024 bytes on).
  const unsigned long long dq = wgmma_desc(q_s, 16, 1024, 128);
  unsigned char* operand = S::DS ? op_s : tiles;  // K and V: the stage itself, or the dequantized tile
  const unsigned long long dk0 = wgmma_desc(operand + key_off * 128, 16, 1024, 128);
  const unsigned long long dv0 = wgmma_desc(operand + (col_off / 64) * (KT * 128), KT * 128, 1024, 128);
  const unsigned long long dp = wgmma_desc(p_s, 16, 1024, 128);
  // Raw products: the positive softmax scale folds into the exponent (attention/softmax_tile.cuh).
  const TileSoftmax softmax = TileSoftmax::of(Cfg::SOFTMAX_SCALE);
  // The keys the block's rows see (its rows share a query position: one range for all).
  const KeyRange keys = Keys::row_keys(k_end - 1, k_end), seen{max(k_begin, keys.begin), keys.end};

  for (int tile = 0; tile < ntiles; ++tile) {
    // Every thread's copies of `tile` (and Q) landed and fenced for the tensor cores' (async-proxy)
    // reads; everybody is done with tile - 1.
    StageRing<STAGES>::next(tile, ntiles, issue, [] { fence_proxy_async_shared(); });
    const int s = tile % STAGES, tbase = tile0 + tile * KT;
    const int op_off = S::DS ? 0 : s * S::TILE_BYTES;  // fp8_ds_mla: one operand tile, rewritten a tile
    const unsigned long long dk = wg_desc_plus(dk0, op_off), dv = wg_desc_plus(dv0, op_off);
    if constexpr (S::DS) {
      // Everybody is done with the previous tile's operands (each warpgroup waited on its P V before
      // the barrier above), so the tile may be rewritten; its generic stores fenced for the wgmma.
      mla_wg_dequant_tile<Cfg>(op_s, tiles + s * S::TILE_BYTES);
      fence_proxy_async_shared();
      __syncthreads();
    }

    // A sparse row's keys that name a slot, read before the products so the loads overlap them.
    unsigned named = 0;
    if constexpr (SPARSE) named = mla_wg_named<NS>(indices, seen, tbase, key_off, t);

    // 1. S = Q K^T for the warpgroup's keys (attention/wgmma_tile.cuh: each product waited on)
    wg_qk<T, S::HALF_KEYS, D, S::ROWS, KT>(sacc, dq, dk);

    // 2. mask the keys the rows do not see; the rows' maxima over both warpgroups
    float m_tile[2] = {KGEN_NEG_INF, KGEN_NEG_INF};
#pragma unroll
    for (int e = 0; e < NS; ++e) {
      const int rr = wg_row(e), pos = tbase + key_off + wg_col(e, t);
      sacc[e] = seen.contains(pos) ? sacc[e] : KGEN_NEG_INF;
      if constexpr (SPARSE) sacc[e] = (named >> (2 * (e >> 2) + (e & 1))) & 1u ? sacc[e] : KGEN_NEG_INF;
      m_tile[rr] = fmaxf(m_tile[rr], sacc[e]);
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {  // the four lanes of a group hold the row's keys
      const float m = quad_max(m_tile[rr]);
      if (t == 0) red_m[wg * S::ROWS + row0 + 8 * rr] = m;
    }
    __syncthreads();
    float mb[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = row0 + 8 * rr;
      const float m = fmaxf(red_m[row], red_m[S::ROWS + row]);  // of raw products
      scale_row(o, rr, softmax.raise(st[rr], m, mb[rr]));  // the same m and factor in both warpgroups
    }

    // 3. P = exp(logit - m) (a masked -inf gives 0) into the shared P tile as T; l adds the unrounded values
    wg_weigh(softmax, sacc, mb, st);
    wg_store_p<T, S::ROWS>(p_s, sacc, row0, key_off, t);
    fence_proxy_async_shared();  // P's generic stores before the wgmma's reads
    __syncthreads();             // both halves of P are in place

    // 4. O += P V for the warpgroup's output columns; once it returns, P V has read P and the stage:
    // both may be rewritten after the next barrier
    wg_pv_ss<T, S::HALF_COLS, KT>(o, dp, dv);
  }

  cp_async_wait_all();
  mla_wg_finish(ep, st, o, red_l, seq, head0, row0, wg, t);
}

// The entries. Each kernel fills a Params struct generated from its argument table (a single-pass
// kernel's lacks part_o, part_ml, max_partitions and partition_tokens: constants there,
// kgen/families/attention/mla.py) and passes it here. kv_scale is not read: an unscaled cache.

// Decode: one query token per sequence; block (x, seq, z) takes heads [64 x, 64 x + 64), over the
// keys its query sees in partition z (attention/visibility.cuh's decode_key_range).
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_decode_wgmma_body(const Params& p) {
  const int seq = blockIdx.y, part = blockIdx.z;
  const bool split = Cfg::SPLIT && p.max_partitions > 1;
  int k_begin, k_end;
  if (!decode_key_range<Cfg>(p.seq_lens[seq], part, p.partition_tokens, p.max_partitions, split, k_begin, k_end))
    return;  // block-uniform
  mla_wg_attend<Cfg, typename DecodeKeys<Cfg>::type>(
      mla_wg_epilogue<Cfg>(p, p.o_s_seq, part, split), p.q, p.kv_cache,
      p.block_tables + (long long)seq * p.max_blocks_per_seq, nullptr, seq, 64 * (int)blockIdx.x, k_begin, k_end,
      p.q_s_seq, p.q_s_head, p.kv_s_block, p.kv_s_token);
}

// Sparse decode (SPARSE_TOPK = N): block (x, seq, z) takes heads [64 x, 64 x + 64) of sequence seq
// over the N entries of its indices row, with split-KV entries [z P, (z + 1) P) (the merge counts
// N). seq_lens is not read: the indices bound every row.
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_sparse_decode_wgmma_body(const Params& p) {
  constexpr int N = Cfg::SPARSE_TOPK;
  static_assert(N > 0, "the sparse body needs SPARSE_TOPK");
  const int seq = blockIdx.y, part = blockIdx.z;
  const bool split = Cfg::SPLIT && p.max_partitions > 1;
  int k_begin = 0, k_end = N;
  if (split) {
    if (part >= split_partitions(N, p.partition_tokens, p.max_partitions)) return;  // block-uniform
    clip_to_partition(part, p.partition_tokens, p.max_partitions, k_begin, k_end);
  }
  mla_wg_attend<Cfg, ListedKeys>(mla_wg_epilogue<Cfg>(p, p.o_s_seq, part, split), p.q, p.kv_cache, nullptr,
                                 p.indices + (long long)seq * N, seq, 64 * (int)blockIdx.x, k_begin, k_end, p.q_s_seq,
                                 p.q_s_head, p.kv_s_block, p.kv_s_token);
}

// Sparse prefill: every query token is independent (its indices row names what it sees), so block
// (token, y) takes heads [64 y, 64 y + 64) of query token `token` over the N entries of its indices
// row. q_indptr, seq_lens and num_seqs are not read.
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_sparse_prefill_wgmma_body(const Params& p) {
  constexpr int N = Cfg::SPARSE_TOPK;
  static_assert(N > 0, "the sparse body needs SPARSE_TOPK");
  const int token = blockIdx.x;
  mla_wg_attend<Cfg, ListedKeys>(mla_wg_epilogue<Cfg>(p, p.o_s_tok, 0, false), p.q, p.kv_cache, nullptr,
                                 p.indices + (long long)token * N, token, 64 * (int)blockIdx.y, 0, N, p.q_s_tok,
                                 p.q_s_head, p.kv_s_block, p.kv_s_token);
}

}  // namespace kgen
