// Multi-head latent attention over the mla layout (docs/abi.md section 8, docs/mla.md): one pool of
// latent rows [num_blocks, block_size, HEAD_DIM], K the whole row, V its first V_DIM elements. Each
// latent row is copied once into shared memory and used there for both Q K^T and P V.
//
// Rows. A block attends ROW_TILES * 16 query rows of one sequence: row r of the sequence's rows is
// (query token r / NUM_Q_HEADS, head r % NUM_Q_HEADS), at absolute position seq_len - q_len + token
// (decode: q_len 1, the rows are the heads). Rows past q_len * NUM_Q_HEADS are zero queries whose
// results are dropped. Q is copied into shared memory once (cp.async) and read by ldmatrix.
//
// Warps. ROW_TILES x COL_WARPS warps: warp (r, c) owns row tile r (16 rows) and, of the output,
// columns [c * V_DIM / COL_WARPS, (c + 1) * V_DIM / COL_WARPS). Per tile of TILE_TOKENS = 16 *
// COL_WARPS keys (STAGES deep in flight, cp.async; rows ROW_BYTES apart, an odd number of 16-byte
// units so the eight rows of an ldmatrix fall in different banks):
//   1. S = Q K^T on the tensor cores (m16n8k16, fp32 accumulate): warp (r, c) takes keys
//      [16c, 16c + 16) of the tile for its 16 rows (K by ldmatrix);
//   2. the row tile's maximum over its COL_WARPS warps through shared memory; every warp of the row
//      tile then holds the same running max m and rescales its own output columns by the same factor;
//   3. P = exp(S - m), rounded to q's type, into shared memory (each warp its 16 keys), and each warp
//      adds its keys' unrounded P to its share of the row sum l;
//   4. O[16 rows, the warp's columns] += P[16 rows, TILE_TOKENS keys] V[those keys, the columns]
//      (P by ldmatrix, V by ldmatrix.trans from the same tile rows as K).
// At the end the warps' shares of l are added through shared memory; each warp writes its columns.
// Split-KV (decode and prefill): partition z of the grid attends keys [z P, (z + 1) P) and writes its
// normalised partial and (m, l) through the Epilogue; the merge kernel (attention/epilogue.cuh's
// merge_partitions_body) combines them at V_DIM.
//
// Sparse (SPARSE_TOPK = N > 0): a row's keys are the N entries of its indices row, physical slots
// block_id * BLOCK_SIZE + offset or -1 (LatentRows::row picks the rows; -1 is zero-filled and masked),
// with no block table, causal mask or window; see paged_mla_sparse_decode_body / _prefill_body.
//
// fp8 caches (e4m3, e5m2): the tile lands as stored (RAW_ROW_BYTES a row, with its per-token scales),
// then one pass converts it into the 16-bit operand tile (exact: fp8 values are fp16 and bf16 values;
// attention/kv_format.cuh's KvPair) that both products read. Scales stay outside the products, in fp32: a per-tensor scale multiplies
// the logits and the output; a per-token one logit column j and P[:, j] (for P V) by kv_scale[j],
// while l sums the unscaled P. fp8_ds_mla rows (Cfg::DS_MLA, ds_mla_row.cuh) are staged as their 656
// bytes and the same pass dequantizes them (e4m3 * tile scale, rounded once to bf16; rope copied).
//
// Shared parts (kgen/attention/): the latent rows (LatentRows: which pool row a key is; MlaKeys:
// the causal KeyRule over positions, or a sparse row's ListedKeys over its entries; MlaRows), the
// stage ring (StageRing), the logit and when its scale folds into the exponent (Logits), the
// per-tile softmax update (TileSoftmax), the fp8 pairs (KvPair) and the cache's ScaleMode, and the
// row's end (Epilogue: the output and LSE, or the partial and (m, l)). Every kernel fills a Params
// struct generated from its argument table.
//
// Needs kgen/platform.cuh, async_copy.cuh, convert.cuh, softmax.cuh, mma.cuh and ds_mla_row.cuh before it;
// it includes the attention parts it uses itself.
#pragma once

#include "kgen/attention/traits.cuh"
#include "kgen/attention/visibility.cuh"
#include "kgen/attention/logits.cuh"
#include "kgen/attention/softmax_tile.cuh"
#include "kgen/attention/stage_ring.cuh"
#include "kgen/attention/kv_format.cuh"
#include "kgen/attention/epilogue.cuh"
#include "kgen/attention/latent_rows.cuh"

namespace kgen {

template <class Cfg>
struct MlaShape {
  typedef typename Cfg::q_t T;  // MMA operand type (the cache stores the same 16-bit type)
  static constexpr int D = Cfg::HEAD_DIM, DV = Cfg::V_DIM, HQ = Cfg::NUM_Q_HEADS;
  static constexpr int R = Cfg::ROW_TILES, C = Cfg::COL_WARPS, WARPS = R * C, THREADS = 32 * WARPS;
  static constexpr int NT = Cfg::TILE_TOKENS, STAGES = Cfg::STAGES;
  static constexpr int ROW = Cfg::ROW_BYTES, PROW = Cfg::P_ROW_BYTES;
  static constexpr int KC = D / 16;              // k16 chunks of Q K^T
  static constexpr int DW = DV / C;              // output columns of a warp
  static constexpr int OT = DW / 8;              // n8 output tiles of a warp
  static constexpr bool KV8 = sizeof(typename Cfg::kv_t) == 1;  // fp8: staged as stored, then converted
  static constexpr ScaleMode SCALES = ScaleModeOf<Cfg>::value;
  static constexpr bool TOKEN_SCALES = SCALES == ScaleMode::per_token_head;
  static constexpr int RAW_ROW = Cfg::RAW_ROW_BYTES;  // a staged fp8 row
  static constexpr int STORED = Cfg::DS_MLA ? DsMlaRow::BYTES : D * (int)sizeof(typename Cfg::kv_t);  // bytes a row
  static constexpr int Q_BYTES = 16 * R * ROW;   // Q [16 R rows][ROW]
  static constexpr int SCALES_AT = NT * (KV8 ? RAW_ROW : ROW);  // a stage's per-token scales, after its rows
  static constexpr int STAGE_BYTES = SCALES_AT + (TOKEN_SCALES ? NT * 4 : 0);  // one key tile as stored
  static constexpr int OP_BYTES = KV8 ? NT * ROW : 0;  // fp8: the converted 16-bit tile
  static constexpr int P_BYTES = 16 * R * PROW;  // P [16 R rows][PROW]
  static constexpr int RED_BYTES = 2 * R * C * 16 * 4;  // row maxima, then row sums: [R][C][16] floats each
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES + OP_BYTES + P_BYTES + RED_BYTES;
  static_assert(SMEM_BYTES == Cfg::SMEM_BYTES, "shared memory: kgen's geometry and the template disagree");
  static_assert(THREADS == Cfg::NUM_THREADS && NT == 16 * C, "warps");
  static_assert(sizeof(T) == 2 && (KV8 || sizeof(typename Cfg::kv_t) == 2), "mla: 16-bit q, 16-bit or fp8 cache");
  static_assert(!KV8 || (RAW_ROW % 16 == 0 && RAW_ROW >= STORED), "staged rows");
  static_assert(SCALES == ScaleMode::none || SCALES == ScaleMode::per_tensor || TOKEN_SCALES, "mla: kv_scale modes");
  static_assert(!Cfg::DS_MLA || (D == DsMlaRow::HEAD_DIM && IsSame<T, __nv_bfloat16>::value && SCALES == ScaleMode::none),
                "fp8_ds_mla: 576-element rows, bf16 q, no kv_scale");
  static_assert(D % 16 == 0 && DV % (16 * C) == 0 && DV < D, "head dims");
  static_assert(ROW % 16 == 0 && ROW >= 2 * D && PROW % 16 == 0 && PROW >= 2 * NT, "rows");
  static_assert(STAGES >= 1 && STAGES <= 4, "stages");
};

// The block's Q rows into shared memory (zeros past the sequence's rows; cp.async, in the first copy
// group).
template <class Cfg>
__device__ __forceinline__ void mla_stage_q(unsigned char* __restrict__ q_s, const typename Cfg::q_t* __restrict__ q,
                                            const MlaRows& rows, long long q_s_row, long long q_s_head) {
  typedef MlaShape<Cfg> S;
  constexpr int D = S::D, HQ = S::HQ;
  for (int i = threadIdx.x; i < 16 * S::R * (D / 8); i += S::THREADS) {
    const int r = i / (D / 8), d0 = (i % (D / 8)) * 8, row = rows.first + r;
    const bool valid = row < rows.count;
    const typename Cfg::q_t* src = q;
    if (valid) src = q + (rows.q_row0 + row / HQ) * q_s_row + (long long)(row % HQ) * q_s_head + d0;
    cp_async<16>(q_s + r * S::ROW + d0 * 2, src, valid ? 16 : 0);
  }
}

// Copy one key tile (keys [tbase, tbase + NT)) into `stage`; keys outside [k_begin, k_end), and a
// sparse row's unused entries, are zero-filled, not read.
template <class Cfg>
__device__ __forceinline__ void mla_issue_tile(unsigned char* __restrict__ stage, int tbase, int k_begin, int k_end,
                                               const LatentRows<Cfg>& pool) {
  typedef MlaShape<Cfg> S;
  constexpr int ES = sizeof(typename Cfg::kv_t), CHUNK = 16 / ES, PER_ROW = S::STORED / 16;
  constexpr int COPIES = S::NT * PER_ROW, ROW = S::KV8 ? S::RAW_ROW : S::ROW;
#pragma unroll 2
  for (int i = threadIdx.x; i < COPIES; i += S::THREADS) {
    const int t = i / PER_ROW, d0 = (i % PER_ROW) * CHUNK, pos = tbase + t;
    bool valid = pos >= k_begin && pos < k_end;
    const typename Cfg::kv_t* src = pool.kv_cache;
    if (valid) {
      const long long row = pool.row(pos, pool.kv_s_block, pool.kv_s_token);
      if constexpr (Cfg::SPARSE_TOPK > 0) valid = row >= 0;
      if (valid) src = pool.kv_cache + row + d0;
    }
    cp_async<16>(stage + t * ROW + d0 * ES, src, valid ? 16 : 0);
  }
  if (S::TOKEN_SCALES) {
    float* ss = reinterpret_cast<float*>(stage + S::SCALES_AT);
    for (int t = threadIdx.x; t < S::NT; t += S::THREADS) {
      const int pos = tbase + t;
      bool valid = pos >= k_begin && pos < k_end;
      const float* src = pool.kv_scale;
      if (valid) {
        const long long row = pool.row(pos, pool.ks_s_block, pool.ks_s_token);
        if constexpr (Cfg::SPARSE_TOPK > 0) valid = row >= 0;
        if (valid) src = pool.kv_scale + row;
      }
      cp_async<4>(ss + t, src, valid ? 4 : 0);
    }
  }
}

// The staged fp8 tile into the 16-bit operand tile `op` (every thread its share, 8 elements at a time).
template <class Cfg>
__device__ __forceinline__ void mla_convert_tile(unsigned char* __restrict__ op, const unsigned char* __restrict__ raw) {
  typedef MlaShape<Cfg> S;
  typedef KvPair<typename Cfg::kv_t, typename S::T> Pair;
  constexpr int PER_ROW = S::D / 8;
  for (int i = threadIdx.x; i < S::NT * PER_ROW; i += S::THREADS) {
    const int t = i / PER_ROW, d0 = (i % PER_ROW) * 8;
    uint4 w;
    if constexpr (Cfg::DS_MLA) {
      w = ds_mla_dequant8(raw + t * S::RAW_ROW, d0);
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(raw + t * S::RAW_ROW + d0);
      w.x = Pair::two((unsigned short)(v.x & 0xFFFFu));
      w.y = Pair::two((unsigned short)(v.x >> 16));
      w.z = Pair::two((unsigned short)(v.y & 0xFFFFu));
      w.w = Pair::two((unsigned short)(v.y >> 16));
    }
    *reinterpret_cast<uint4*>(op + t * S::ROW + d0 * 2) = w;
  }
}

// S = Q K^T for a warp's 16 keys (rows ROW bytes apart from k_w) and its 16 query rows (from q_w), on
// the tensor cores: s[j][i] is row g + 8 (i >> 1), key 8j + 2t + (i & 1).
template <class Cfg>
__device__ __forceinline__ void mla_qk(float (&s)[2][4], const unsigned char* q_w, const unsigned char* k_w, int lane) {
  typedef MlaShape<Cfg> S;
#pragma unroll 4
  for (int kc = 0; kc < S::KC; ++kc) {
    unsigned a[4], b[4];
    ldmatrix<4, false>(a, q_w + (lane % 16) * S::ROW + (kc * 16 + (lane / 16) * 8) * 2);
    ldmatrix<4, false>(b, k_w + (lane % 8 + (lane / 16) * 8) * S::ROW + (kc * 16 + ((lane / 8) % 2) * 8) * 2);
    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_m16n8k16<typename S::T>(s[0], a, b0, s[0]);
    mma_m16n8k16<typename S::T>(s[1], a, b1, s[1]);
  }
}

// O[16 rows, the warp's DW columns] += P[16 rows, NT keys] V[those keys, the columns]: P by ldmatrix
// from p_w, V by ldmatrix.trans from the tile's rows (v_w: the warp's first column of key 0).
template <class Cfg>
__device__ __forceinline__ void mla_pv(float (&o)[MlaShape<Cfg>::OT][4], const unsigned char* p_w,
                                       const unsigned char* v_w, int lane) {
  typedef MlaShape<Cfg> S;
#pragma unroll 1
  for (int kc = 0; kc < S::NT / 16; ++kc) {
    unsigned a[4];
    ldmatrix<4, false>(a, p_w + (lane % 16) * S::PROW + (kc * 16 + (lane / 16) * 8) * 2);
    const unsigned char* v_row = v_w + (16 * kc + lane % 8 + ((lane / 8) % 2) * 8) * S::ROW;
#pragma unroll
    for (int nt = 0; nt < S::OT; nt += 2) {
      unsigned b[4];
      ldmatrix<4, true>(b, v_row + 8 * (nt + lane / 16) * 2);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_m16n8k16<typename S::T>(o[nt], a, b0, o[nt]);
      mma_m16n8k16<typename S::T>(o[nt + 1], a, b1, o[nt + 1]);
    }
  }
}

// The lane's two rows' values (already reduced over the four lanes of a row) reduced over the row
// tile's C warps through shared memory `red` ([R][C][16] floats): the maximum (MAX) or the sum, in
// warp order. Holds a block barrier.
template <class Cfg, bool MAX>
__device__ __forceinline__ void mla_across_warps(float (&v)[2], float* red, int rt, int cw, int g, int t) {
  constexpr int C = MlaShape<Cfg>::C;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
    if (t == 0) red[(rt * C + cw) * 16 + g + 8 * rr] = v[rr];
  __syncthreads();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float x = MAX ? KGEN_NEG_INF : 0.0f;
#pragma unroll
    for (int w = 0; w < C; ++w) {
      const float y = red[(rt * C + w) * 16 + g + 8 * rr];
      x = MAX ? fmaxf(x, y) : x + y;
    }
    v[rr] = x;
  }
}

// A sparse row: whether each of the lane's four key columns (keys k0 + 8j + c, of the block's [k_begin,
// k_end)) names a slot, loaded before the products; a dense row's all do.
template <class Cfg>
__device__ __forceinline__ void mla_named_keys(bool (&named)[2][2], const LatentRows<Cfg>& pool, int k0, int k_begin,
                                               int k_end) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int pos = k0 + 8 * j + c;
      named[j][c] = Cfg::SPARSE_TOPK == 0 || (pos >= k_begin && pos < k_end && ListedKeys::listed(pool.indices[pos]));
    }
}

// The warp's columns of the lane's two rows (g and g + 8 of row tile rt) through the epilogue
// (attention/epilogue.cuh), normalised here: 1 / l (l: the rows' sums), then V's per-tensor scale
// v_out. Rows past the sequence's are dropped.
template <class Cfg>
__device__ __forceinline__ void mla_write_rows(const Epilogue<Cfg>& ep, SoftmaxState (&st)[2], const float (&l)[2],
                                               const float (&o)[MlaShape<Cfg>::OT][4], const MlaRows& rows, int rt,
                                               int cw, int g, int t, float v_out) {
  typedef MlaShape<Cfg> S;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = rows.first + 16 * rt + g + 8 * rr;
    if (row >= rows.count) continue;
    const long long qrow = rows.q_row0 + row / S::HQ;
    const int h = row % S::HQ;
    st[rr].l = l[rr];
    const float inv = st[rr].inv_sum() * v_out;
    ep.template fragment<2 * S::OT>(
        st[rr], qrow, h, [&](int i) { return cw * S::DW + 8 * (i >> 1) + 2 * t + (i & 1); },
        [&](int i) { return o[i >> 1][2 * rr + (i & 1)] * inv; }, cw == 0 && t == 0);
  }
}

// The attention of the block's 16 * ROW_TILES rows over keys [k_begin, k_end) of one sequence (a
// block-table row) or of one sparse row (its SPARSE_TOPK entries), read from `pool` (LatentRows),
// each row masked by Keys (MlaKeys), written through `ep` (the output and LSE, or when split the
// partition's partial and (m, l)).
template <class Cfg, class Keys>
__device__ __forceinline__ void mla_attend(const Epilogue<Cfg>& ep, const LatentRows<Cfg>& pool,
                                           const typename Cfg::q_t* __restrict__ q, long long q_s_row,
                                           long long q_s_head, const MlaRows rows, int k_begin, int k_end) {
  typedef MlaShape<Cfg> S;
  typedef typename S::T T;
  constexpr int HQ = S::HQ, NT = S::NT, STAGES = S::STAGES, C = S::C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int rt = warp / C, cw = warp % C;  // the warp's row tile and column group

  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  unsigned char* q_s = smem;
  unsigned char* tiles = smem + S::Q_BYTES;
  unsigned char* op_s = tiles + STAGES * S::STAGE_BYTES;  // fp8: the converted tile
  unsigned char* p_s = op_s + S::OP_BYTES;
  float* red_m = reinterpret_cast<float*>(p_s + S::P_BYTES);
  float* red_l = red_m + S::R * C * 16;

  mla_stage_q<Cfg>(q_s, q, rows, q_s_row, q_s_head);
  const int tile0 = k_begin / NT * NT;
  const int ntiles = k_end > k_begin ? (k_end - tile0 + NT - 1) / NT : 0;
  auto issue = [&](int tile) {
    mla_issue_tile<Cfg>(tiles + (tile % STAGES) * S::STAGE_BYTES, tile0 + tile * NT, k_begin, k_end, pool);
  };
  StageRing<STAGES>::start(ntiles, issue);  // attention/stage_ring.cuh

  // The positions of the lane's two rows (g and g + 8 of the warp's tile), whose keys Keys::sees
  // (within the block's [k_begin, k_end)). A row past the sequence's is a zero query whose logits
  // are 0 and whose results are dropped: it needs no mask of its own.
  int qpos[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) qpos[rr] = rows.seq_len - rows.q_len + (rows.first + 16 * rt + g + 8 * rr) / HQ;
  const unsigned char* q_w = q_s + 16 * rt * S::ROW;
  unsigned char* p_w = p_s + 16 * rt * S::PROW;

  // A per-tensor scale outside the products: K's into the logits, V's onto the output.
  const float k_tensor = S::SCALES == ScaleMode::per_tensor ? pool.kv_scale[0] : 1.0f;
  const float qk_scale = Cfg::SOFTMAX_SCALE * k_tensor, v_out = k_tensor;
  // FOLD: the logit is the product (times its per-token scale) times a positive compile-time scale
  // (attention/logits.cuh's LINEAR): the row's max is taken on the raw products and the scale goes
  // into the exponent's FFMA (attention/softmax_tile.cuh).
  constexpr bool FOLD = Logits<Cfg>::LINEAR && Cfg::SOFTMAX_SCALE > 0.0f && S::SCALES != ScaleMode::per_tensor;
  const TileSoftmax softmax = TileSoftmax::of(FOLD ? Cfg::SOFTMAX_SCALE : 1.0f);
  SoftmaxState st[2] = {SoftmaxState::empty(), SoftmaxState::empty()};  // l: this lane's keys only
  float o[S::OT][4] = {};

  // The loop bound is uniform across the block, so every thread reaches every barrier.
  for (int tile = 0; tile < ntiles; ++tile) {
    StageRing<STAGES>::next(tile, ntiles, issue);  // (and Q); every warp is done with tile - 1, its P and maxima
    const unsigned char* raw = tiles + (tile % STAGES) * S::STAGE_BYTES;
    const float* ss = reinterpret_cast<const float*>(raw + S::SCALES_AT);  // per-token scales of the tile
    if constexpr (S::KV8) {
      mla_convert_tile<Cfg>(op_s, raw);
      __syncthreads();  // the converted tile is complete
    }
    const unsigned char* stage = S::KV8 ? op_s : raw;
    const int tbase = tile0 + tile * NT;
    bool named[2][2];
    mla_named_keys<Cfg>(named, pool, tbase + 16 * cw + 2 * t, k_begin, k_end);

    // 1. S = Q K^T for the warp's 16 keys: s[j][i] is row g + 8 (i >> 1), key 16 cw + 8j + 2t + (i & 1).
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    mla_qk<Cfg>(s, q_w, stage + 16 * cw * S::ROW, lane);
    // 2. logits (raw products when FOLD), mask, and the row tile's maximum over its warps
    float m[2] = {KGEN_NEG_INF, KGEN_NEG_INF}, mb[2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = i >> 1, col = 16 * cw + 8 * j + 2 * t + (i & 1), pos = tbase + col;
        const float x = FOLD ? (S::TOKEN_SCALES ? s[j][i] * ss[col] : s[j][i])
                             : Logits<Cfg>::of(s[j][i], S::TOKEN_SCALES ? qk_scale * ss[col] : qk_scale, 0.0f, pos, 0);
        s[j][i] = pos >= k_begin && Keys::sees(pos, qpos[rr], k_end) && named[j][i & 1] ? x : KGEN_NEG_INF;
        m[rr] = fmaxf(m[rr], s[j][i]);
      }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) m[rr] = quad_max(m[rr]);  // the four lanes of a group hold the row's keys
    mla_across_warps<Cfg, true>(m, red_m, rt, cw, g, t);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)  // the same m and factor in every warp of the row tile
      scale_row(o, rr, softmax.raise(st[rr], m[rr], mb[rr]));
    // 3. P = exp(logit - m) into shared memory as T; l adds the unrounded values
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[j][i] = softmax.weight(s[j][i], mb[i >> 1]);  // a masked -inf gives 0
        st[i >> 1].l += s[j][i];
        if (S::TOKEN_SCALES) s[j][i] *= ss[16 * cw + 8 * j + 2 * t + (i & 1)];  // P V sees P times V's scales
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        *reinterpret_cast<unsigned*>(p_w + (g + 8 * rr) * S::PROW + (16 * cw + 8 * j + 2 * t) * 2) =
            pack2<T>(s[j][2 * rr], s[j][2 * rr + 1]);
    }
    __syncthreads();
    // 4. O += P V over the tile's keys, for the warp's output columns
    mla_pv<Cfg>(o, p_w, stage + cw * S::DW * 2, lane);
  }

  // The row sums: the four lanes of a row, then the row tile's warps through shared memory.
  cp_async_wait_all();
  float l[2] = {quad_sum(st[0].l), quad_sum(st[1].l)};
  mla_across_warps<Cfg, false>(l, red_l, rt, cw, g, t);

  mla_write_rows<Cfg>(ep, st, l, o, rows, rt, cw, g, t, v_out);
}

// The entries. Each kernel fills a Params struct generated from its argument table (a single-pass
// kernel's lacks part_o, part_ml, max_partitions, partition_tokens and sinks: constants there,
// kgen/families/attention/mla.py) and passes it here; the output side is the Epilogue's (split:
// Cfg::SPLIT and more than one partition).

// Decode: one query token per sequence; block (x, seq, z) takes rows [16 ROW_TILES x, ..) = heads,
// over the keys its query sees in partition z (attention/visibility.cuh's decode_key_range).
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_decode_body(const Params& p) {
  const int seq = blockIdx.y, part = blockIdx.z;
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_seq, part);
  const int seq_len = p.seq_lens[seq];
  int k_begin, k_end;
  if (!decode_key_range<Cfg>(seq_len, part, p.partition_tokens, p.max_partitions, ep.split, k_begin, k_end)) return;
  const MlaRows rows{16 * Cfg::ROW_TILES * (int)blockIdx.x, Cfg::NUM_Q_HEADS, 1, seq_len, seq};
  mla_attend<Cfg, typename MlaKeys<Cfg>::decode>(
      ep, LatentRows<Cfg>::of(p, p.block_tables + (long long)seq * p.max_blocks_per_seq, nullptr), p.q, p.q_s_seq,
      p.q_s_head, rows, k_begin, k_end);
}

// Prefill: the chunk of q_len = q_indptr[s+1] - q_indptr[s] query tokens of each sequence, packed by
// sequence; block (x, s, z) takes rows [16 ROW_TILES x, ..) of sequence s's q_len * NUM_Q_HEADS (token,
// head) rows (token-major: the 16 rows of a tile share few tokens, so its keys end near the
// same position), over the keys some row sees (KeyRule: 0 .. the last row's position when causal, else
// all seq_len keys); with split-KV only those of partition z (decode's split: split_partitions of
// the sequence's seq_len, so the merge, paged_prefill_merge_body, reads the same count; a partition
// past the block's last key writes an empty state).
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_prefill_body(const Params& p) {
  const int seq = blockIdx.y, part = blockIdx.z;
  const int q0 = p.q_indptr[seq], q_len = p.q_indptr[seq + 1] - q0, seq_len = p.seq_lens[seq];
  const int first = 16 * Cfg::ROW_TILES * (int)blockIdx.x, count = q_len * Cfg::NUM_Q_HEADS;
  if (first >= count) return;  // block-uniform: this sequence has fewer row tiles than the grid
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_tok, part);
  const int last_row = min(first + 16 * Cfg::ROW_TILES, count) - 1, pos0 = seq_len - q_len;
  typedef typename MlaKeys<Cfg>::prefill Keys;
  const KeyRange keys = Keys::rows_keys(pos0 + first / Cfg::NUM_Q_HEADS, pos0 + last_row / Cfg::NUM_Q_HEADS, seq_len);
  int k_begin = keys.begin, k_end = keys.end;
  if (ep.split) {
    if (part >= split_partitions(seq_len, p.partition_tokens, p.max_partitions)) return;  // uniform
    clip_to_partition(part, p.partition_tokens, p.max_partitions, k_begin, k_end);
  }
  const MlaRows rows{first, count, q_len, seq_len, q0};
  mla_attend<Cfg, Keys>(ep, LatentRows<Cfg>::of(p, p.block_tables + (long long)seq * p.max_blocks_per_seq, nullptr),
                        p.q, p.q_s_tok, p.q_s_head, rows, k_begin, k_end);
}

// Sparse decode (SPARSE_TOPK = N): one query token per sequence, attending the N entries of its
// indices row (ListedKeys: no block table, no mask but the unused entries); block (x, seq, z) takes
// rows [16 ROW_TILES x, ..) = heads, and with split-KV the entries [z P, (z + 1) P). seq_lens is not
// read: the indices bound every row.
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_sparse_decode_body(const Params& p) {
  constexpr int N = Cfg::SPARSE_TOPK;
  const int seq = blockIdx.y, part = blockIdx.z;
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_seq, part);
  int k_begin, k_end;
  if (!sparse_key_range<Cfg>(part, p.partition_tokens, p.max_partitions, ep.split, k_begin, k_end)) return;
  const MlaRows rows{16 * Cfg::ROW_TILES * (int)blockIdx.x, Cfg::NUM_Q_HEADS, 1, N, seq};
  mla_attend<Cfg, ListedKeys>(ep, LatentRows<Cfg>::of(p, nullptr, p.indices + (long long)seq * N), p.q, p.q_s_seq,
                              p.q_s_head, rows, k_begin, k_end);
}

// Sparse prefill: every query token is a row of its own (no causal mask: its indices row names what
// it sees), so block (token, y) takes heads [16 ROW_TILES y, ..) of query token `token` over the N
// entries of its indices row (tokens on grid x: a prompt may have more than grid y's 65,535).
// q_indptr, seq_lens and num_seqs are not read: the indices bound every row. Single pass (the
// Params' max_partitions is the constant 1: the Epilogue writes the output).
template <class Cfg, class Params>
__device__ __forceinline__ void paged_mla_sparse_prefill_body(const Params& p) {
  constexpr int N = Cfg::SPARSE_TOPK;
  static_assert(N > 0, "the sparse body needs SPARSE_TOPK");
  const int token = blockIdx.x;
  const MlaRows rows{16 * Cfg::ROW_TILES * (int)blockIdx.y, Cfg::NUM_Q_HEADS, 1, N, token};
  mla_attend<Cfg, ListedKeys>(Epilogue<Cfg>::of(p, p.o_s_tok, 0), LatentRows<Cfg>::of(p, nullptr, p.indices + (long long)token * N),
                              p.q, p.q_s_tok, p.q_s_head, rows, 0, N);
}

}  // namespace kgen
