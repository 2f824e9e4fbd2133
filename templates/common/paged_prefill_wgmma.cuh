// Paged prefill attention on Hopper (sm_90a): warpgroup MMA (wgmma) with a producer warpgroup and
// 1-2 consumer warpgroups synchronised by mbarriers (docs/prefill-family.md, "The Hopper path").
// Same ABI, rows, masks, scales, split-KV contract and epilogue as paged_prefill.cuh's mma.sync
// body; needs kgen/platform.cuh, async_copy.cuh, convert.cuh, softmax.cuh, mma.cuh (pack2) and
// hopper.cuh before it; it includes the attention parts it uses itself.
//
// Threads: warpgroup 0 is the producer, warpgroups 1..C the consumers, each owning 64 packed rows
// (wgmma's M). Cfg::WARPS = 4 * C consumer warps, so a block holds 16 * WARPS rows as on the mma
// path.
// Shared memory (from a 1024-byte aligned base): Q [ROWS x D], then STAGES stages of K [KT x D]
// and V [KT x DV], all in q's type with the 128-byte swizzle (attention/wgmma_tile.cuh's
// wg_swizzled). Q and K are K-major operands, V an MN-major one.
// Paged K/V: a tile's rows come from different cache blocks, so the producer gathers them with
// 16-byte cp.async per row chunk through the block table, into the swizzled place by hand (zero
// fill past the block's keys), then cp.async.wait_group, fence.proxy.async (the wgmma reads through
// the async proxy) and an arrive on full[s] (count 128: every producer thread). Consumers wait
// full[s], compute, and every consumer thread arrives on empty[s] (count 128 * C) after the tile's
// P V wgmma completed; the producer waits empty[s] before refilling stage s. A consumer warpgroup
// whose rows see none of a tile still waits and arrives, so each phase counts one tile.
// Math per tile and consumer warpgroup, the wgmma tile part's (attention/wgmma_tile.cuh, which also
// states the ordering rules its fences keep): S = Q K^T by D/16 wgmma_ss (m64 nKT k16), online
// softmax on the accumulators (wg_softmax_tile below), P rounded to q's type into A registers,
// O += P V by KT/16 wgmma_rs (m64 nDV k16, V MN-major), each waited on (no overlap of the softmax
// with the next tile's products).
// Registers (Cfg::SETMAXNREG, two consumer warpgroups whose tiles need more than 168 a thread):
// setmaxnreg moves registers from the producer (40) to the consumers (232).
#pragma once

#include "kgen/attention/traits.cuh"
#include "kgen/attention/visibility.cuh"
#include "kgen/attention/logits.cuh"
#include "kgen/attention/softmax_tile.cuh"
#include "kgen/attention/kv_format.cuh"
#include "kgen/attention/kv_pool.cuh"
#include "kgen/attention/epilogue.cuh"
#include "kgen/attention/wgmma_tile.cuh"

namespace kgen {

template <class Cfg>
struct WgmmaPrefillShape {
  typedef typename Cfg::q_t T;
  static constexpr int D = Cfg::HEAD_DIM, DV = Cfg::V_HEAD_DIM, G = Cfg::GROUP;
  static constexpr int CONSUMERS = Cfg::WARPS / 4, THREADS = 128 * (1 + CONSUMERS);
  static constexpr int ROWS = 64 * CONSUMERS, KT = Cfg::KV_TILE, STAGES = Cfg::STAGES;
  typedef KvFormat<Cfg> F;  // the cache's format (attention/kv_format.cuh): q's type, no scales
  static constexpr int Q_BYTES = ROWS * D * 2, K_BYTES = F::bytes(KT * D), V_BYTES = F::bytes(KT * DV);
  static constexpr int STAGE_BYTES = K_BYTES + V_BYTES;
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + STAGES * STAGE_BYTES;  // + the alignment slack
  static_assert(sizeof(T) == 2, "wgmma takes fp16 or bf16 operands");
  static_assert(IsSame<typename Cfg::kv_t, T>::value && F::SCALES == ScaleMode::none && Cfg::KV_PATH == 0,
                "the Hopper path copies an unscaled cache in q's type");
  static_assert(Cfg::WARPS == 4 || Cfg::WARPS == 8, "one or two consumer warpgroups");
  static_assert(D % 64 == 0 && DV % 64 == 0 && D <= 256 && DV <= 256, "head dims in 128-byte column blocks, N <= 256");
  static_assert(KT % 16 == 0 && KT >= 16 && KT <= 256, "KV_TILE is wgmma's N for S");
  static_assert(STAGES >= 1 && STAGES <= 4, "stages");
  static_assert(!Cfg::SETMAXNREG || CONSUMERS == 2, "the register split is for 384 threads (168 each at launch)");
  static_assert(SMEM_BYTES == Cfg::SMEM_BYTES, "shared memory: kgen's smem_bytes and the template disagree");
};

template <bool B> struct BoolTag { static constexpr bool value = B; };

// The online softmax of one S tile in a consumer thread's registers (s: the m64nKT accumulators,
// the m16n8 C-fragment layout per warp, [KT/8][4]): logits, masks (MASKED), the running (m, l) of
// its two rows, O rescaled, and P = exp(logit - m) left in s. Without soft-cap and ALiBi (LINEAR)
// the softmax scale folds into the exponent: one FFMA and one MUFU.EX2 a logit, the max taken on
// the raw products (the scale is positive). exp2 of -inf is 0, so masked logits need no test;
// a row with no key seen yet (m = -inf) subtracts 0 instead.
template <class Cfg, bool MASKED, int NS, int NO>  // NS = KT / 2, NO = DV / 2 registers
__device__ __forceinline__ void wg_softmax_tile(float (&s)[NS], float (&o)[NO], SoftmaxState (&st)[2], int kv0,
                                                int hi, int t, const bool (&row_ok)[2], const int (&row_pos)[2],
                                                const float (&slope)[2]) {
  constexpr bool LINEAR = Logits<Cfg>::LINEAR;
  constexpr int W = Cfg::SLIDING_WINDOW;
  const float scale = Cfg::SOFTMAX_SCALE;
  const TileSoftmax softmax = TileSoftmax::of(LINEAR ? Logits<Cfg>::raw_scale(scale) : 1.0f);
  float m_tile[2] = {KGEN_NEG_INF, KGEN_NEG_INF};
  KeyRange seen[2];  // the keys each row sees (none: a padding row)
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
    seen[rr] = row_ok[rr] ? PrefillKeys<Cfg>::type::row_keys(row_pos[rr], hi) : KeyRange{0, 0};
#pragma unroll
  for (int e = 0; e < NS; ++e) {
    const int rr = wg_row(e), key = kv0 + wg_col(e, t);
    float x = LINEAR ? s[e] : Logits<Cfg>::of(s[e], scale, slope[rr], key, row_pos[rr]);
    if (MASKED) {
      x = seen[rr].contains(key) ? x : KGEN_NEG_INF;
    }
    s[e] = x;
    m_tile[rr] = fmaxf(m_tile[rr], x);
  }
  float mb[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)  // the four lanes of a group hold the row's columns
    scale_row(o, rr, softmax.raise(st[rr], quad_max(m_tile[rr]), mb[rr]));
  wg_weigh(softmax, s, mb, st);
}

// The producer warpgroup: K/V tiles [lo, hi) of the block, KT keys a tile, gathered through the
// block-table row `table` into the ring of STAGES stages (full/empty: the mbarriers above).
template <class Cfg, class Params>
__device__ __forceinline__ void wg_prefill_produce(const Params& p, unsigned char* stages, unsigned long long* full,
                                                   unsigned long long* empty, const int* table, int tid, int kv_head,
                                                   int lo, int hi, int ntiles) {
  typedef WgmmaPrefillShape<Cfg> S;
  typedef typename S::T T;
  constexpr int KT = S::KT, D = S::D, DV = S::DV, STAGES = S::STAGES;
  const KvPool<Cfg> kv = KvPool<Cfg>::of(p);  // attention/kv_pool.cuh
  // Thread tid copies chunks CH * (tid % TPR) .. + CH - 1 (16 bytes each; TPR threads a row of
  // C = D / 8 chunks) of rows tid / TPR, tid / TPR + 128 / TPR, .. of a tile, K's and V's alike
  // when D = DV: one block-table read per key, its address math shared by 2 * CH copies, the
  // head's offsets hoisted out of the tile loop. Other widths: one chunk at a time.
  constexpr int KC = D / 8, VC = DV / 8, CH = KC >= 4 ? 4 : KC, TPR = KC / CH;
  constexpr bool PAIRED = KC == VC && KC % CH == 0 && 128 % TPR == 0;
  const int c0 = (tid % TPR) * CH, r_first = tid / TPR;
  const T* k_head = kv.k_cache + (long long)kv_head * kv.k_s_head + c0 * 8;
  const T* v_head = kv.v_cache + (long long)kv_head * kv.v_s_head + c0 * 8;
  for (int i = 0; i < ntiles; ++i) {
    const int s = i % STAGES, kv0 = lo + i * KT;
    if (i >= STAGES) mbar_wait(&empty[s], (i / STAGES - 1) & 1);  // the consumers are done with tile i - STAGES
    unsigned char* ks = stages + s * S::STAGE_BYTES;
    unsigned char* vs = ks + S::K_BYTES;
    if constexpr (PAIRED) {
      for (int r = r_first; r < KT; r += 128 / TPR) {
        // keys at or past hi: zero-filled copies from the block's last key (a valid address, no
        // branch); unsigned: keys and block ids are not negative (cheaper division and products)
        const int key = kv0 + r;
        const int bytes = key < hi ? 16 : 0;
        const unsigned kc = (unsigned)min(key, hi - 1);
        const unsigned long long phys = (unsigned)table[kc / Cfg::BLOCK_SIZE], slot = kc % Cfg::BLOCK_SIZE;
        const unsigned long long k_s_block = kv.k_s_block, k_s_token = kv.k_s_token;
        const unsigned long long v_s_block = kv.v_s_block, v_s_token = kv.v_s_token;
        const T* ksrc = k_head + (long long)(phys * k_s_block + slot * k_s_token);
        const T* vsrc = v_head + (long long)(phys * v_s_block + slot * v_s_token);
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          const int off = wg_swizzled<KT>(r, (c0 + j) * 8);
          cp_async<16>(ks + off, ksrc + 8 * j, bytes);
          cp_async<16>(vs + off, vsrc + 8 * j, bytes);
        }
      }
    } else {
      for (int idx = tid; idx < KT * (KC + VC); idx += 128) {
        const bool is_v = idx >= KT * KC;
        const int j = is_v ? idx - KT * KC : idx, c = is_v ? VC : KC, key_i = j / c, d0 = (j % c) * 8;
        const int key = kv0 + key_i;
        const bool valid = key < hi;
        const T* src = is_v ? kv.v_cache : kv.k_cache;
        if (valid) {
          const long long phys = table[key / Cfg::BLOCK_SIZE];
          const int slot = key % Cfg::BLOCK_SIZE;
          src = is_v ? kv.v_cache + phys * kv.v_s_block + (long long)kv_head * kv.v_s_head + slot * kv.v_s_token + d0
                     : kv.k_cache + phys * kv.k_s_block + (long long)kv_head * kv.k_s_head + slot * kv.k_s_token + d0;
        }
        unsigned char* dst = is_v ? vs + wg_swizzled<KT>(key_i, d0) : ks + wg_swizzled<KT>(key_i, d0);
        cp_async<16>(dst, src, valid ? 16 : 0);
      }
    }
    cp_async_commit();
    if (i >= STAGES - 1) {  // tile i - STAGES + 1 has landed: announce it
      cp_async_wait<STAGES - 1>();
      fence_proxy_async_shared();
      mbar_arrive(&full[(i - STAGES + 1) % STAGES]);
    }
  }
  cp_async_wait<0>();
  fence_proxy_async_shared();
  for (int i = max(0, ntiles - STAGES + 1); i < ntiles; ++i) mbar_arrive(&full[i % STAGES]);
}

// Q of the block's rows [r0, r0 + rows) of sequence rows from q_begin into the swizzled Q tile, by
// every thread (zeros past the last row).
template <class Cfg, class Params>
__device__ __forceinline__ void wg_prefill_load_q(const Params& p, unsigned char* q_s, int q_begin, int r0, int rows,
                                                  int kv_head) {
  typedef WgmmaPrefillShape<Cfg> S;
  typedef typename S::T T;
  constexpr int G = S::G, ROWS = S::ROWS, D = S::D;
  const auto* __restrict__ q = p.q;
  const long long q_s_tok = p.q_s_tok, q_s_head = p.q_s_head;
  for (int idx = threadIdx.x; idx < ROWS * D; idx += S::THREADS) {
    const int r = idx / D, d = idx % D, pr = r0 + r;
    T x = from_float<T>(0.0f);
    if (r < rows) x = q[(long long)(q_begin + pr / G) * q_s_tok + (long long)(kv_head * G + pr % G) * q_s_head + d];
    *reinterpret_cast<T*>(q_s + wg_swizzled<ROWS>(r, d)) = x;
  }
}

// A consumer thread's two rows finished (attention/epilogue.cuh): l over the four lanes of a row, the
// sink once (single pass), the elements and the state.
template <class Cfg, int NO>
__device__ __forceinline__ void wg_prefill_finish(const Epilogue<Cfg>& ep, SoftmaxState (&st)[2], const float (&o)[NO],
                                                  const bool (&row_ok)[2], const int (&row_tok)[2],
                                                  const int (&row_head)[2], int t) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) st[rr].l = quad_sum(st[rr].l);
  float sink[2];  // single pass: each row's sink once, at the end (a partial holds none)
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) sink[rr] = row_ok[rr] ? ep.sink(st[rr], row_head[rr]) : 1.0f;
  const float inv[2] = {st[0].inv_sum() * sink[0], st[1].inv_sum() * sink[1]};
#pragma unroll
  for (int nt = 0; nt < NO / 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int rr = e >> 1, d = 8 * nt + 2 * t + (e & 1);
      if (row_ok[rr]) ep.element(row_tok[rr], row_head[rr], d, o[4 * nt + e] * inv[rr]);
    }
  if (t == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
      if (row_ok[rr]) ep.state(st[rr], row_tok[rr], row_head[rr]);
  }
}

template <class Cfg, class Params>
__device__ __forceinline__ void paged_prefill_wgmma_body(const Params& p) {
  // The parameters (Params: generated from the kernel's argument table): the output side is the
  // epilogue's (attention/epilogue.cuh), the rest bound here under the names the body uses; ABI 1's
  // positional signature is templates/abi1/'s, which fills a Params and calls this.
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_tok, blockIdx.z);  // DV <= 256: blockIdx.z is the partition
  typedef WgmmaPrefillShape<Cfg> S;
  typedef typename S::T T;
  constexpr int G = S::G, ROWS = S::ROWS, KT = S::KT, D = S::D, DV = S::DV, STAGES = S::STAGES;
  // The warpgroup index broadcast from lane 0: ptxas then knows it is warp-uniform, and so is every
  // branch and loop bound derived from it, which keeps the consumers' wgmma in uniform control flow
  // (a wgmma ptxas must assume divergent is serialised: advisory C7520).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kv_head = blockIdx.y;

  int seq, tile;
  if (!block_seq_tile<G, ROWS>(p.q_indptr, p.num_seqs, seq, tile)) return;  // uniform: the grid has spare tiles
  const int q_begin = p.q_indptr[seq], q_len = p.q_indptr[seq + 1] - q_begin, kv_len = p.seq_lens[seq];
  const int r0 = tile * ROWS, rows = min(ROWS, q_len * G - r0);
  const int pos0 = kv_len - q_len;
  typedef typename PrefillKeys<Cfg>::type Keys;  // the block's keys and their tiles: attention/visibility.cuh
  const PrefillRows<Keys, G> block{pos0, r0, rows};
  KeyTiles<Keys, KT> tiles;
  if (!prefill_key_tiles(block.span(0, ROWS), kv_len, ep.split, ep.part, p.partition_tokens, p.max_partitions, tiles))
    return;  // uniform: the partition lies past the sequence
  const int lo = tiles.lo, hi = tiles.hi, ntiles = tiles.n;

  KGEN_DYNAMIC_SMEM(unsigned char, smem_raw);
  unsigned char* base = smem_align_1024(smem_raw);  // the 1024 bytes of slack in SMEM_BYTES
  unsigned char* q_s = base;
  unsigned char* stages = base + S::Q_BYTES;
  __shared__ unsigned long long full[STAGES], empty[STAGES];
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 128);                    // every producer thread, after its copies landed
      mbar_init(&empty[s], 128 * S::CONSUMERS);  // every consumer thread, after its P V completed
    }
    fence_mbarrier_init();
  }
  wg_prefill_load_q<Cfg>(p, q_s, q_begin, r0, rows, kv_head);  // by every thread
  fence_proxy_async_shared();  // Q's generic stores before the wgmma's async-proxy reads
  __syncthreads();             // the only block-wide barrier: the roles part here

  const int* table = p.block_tables + (long long)seq * p.max_blocks_per_seq;
  if (wg == 0) {  // ---- producer: gathers K/V tiles through the block table ----
    if constexpr (Cfg::SETMAXNREG) setmaxnreg_dec<40>();  // its registers go to the consumers
    wg_prefill_produce<Cfg>(p, stages, full, empty, table, tid, kv_head, lo, hi, ntiles);
    return;
  }

  // ---- consumer warpgroup cw: rows 64 cw .. 64 cw + 63 of the block ----
  // 128 x 40 + 256 x 232 = 384 x 168, the kernel's registers at launch (ptxas allocates all of
  // __launch_bounds__(384)'s 168 where the consumers need more: tests/families/attention/test_prefill_wgmma.py)
  if constexpr (Cfg::SETMAXNREG) setmaxnreg_inc<232>();
  const int cw = wg - 1, rb = 64 * cw, warp = (tid % 128) / 32;
  bool row_ok[2];
  int row_tok[2], row_head[2], row_pos[2];
  float slope[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = rb + warp * 16 + g + 8 * rr, pr = r0 + r;
    row_ok[rr] = r < rows;
    row_tok[rr] = q_begin + pr / G;
    row_head[rr] = kv_head * G + pr % G;
    row_pos[rr] = pos0 + pr / G;
    slope[rr] = Cfg::ALIBI && row_ok[rr] ? p.alibi_slopes[row_head[rr]] : 0.0f;
  }
  const RowSpan<Keys> wg_rows = block.span(rb, 64);  // rows <= 0: idle (it still takes part in the barriers)

  SoftmaxState st[2] = {SoftmaxState::empty(), SoftmaxState::empty()};
  float o[DV / 2];
#pragma unroll
  for (int i = 0; i < DV / 2; ++i) o[i] = 0.0f;
  float sacc[KT / 2];

  // The operands' descriptors, made once: a tile's and a k-step's are these plus byte offsets.
  const unsigned long long dq = wgmma_desc(q_s + rb * 128, 16, 1024, 128);         // Q, K-major
  const unsigned long long dk0 = wgmma_desc(stages, 16, 1024, 128);                // K of stage 0, K-major
  const unsigned long long dv0 = wgmma_desc(stages + S::K_BYTES, KT * 128, 1024, 128);  // V, MN-major
  // Tile i of the block: wait for it, compute (where the warpgroup's rows see some of it), release it.
  auto step = [&](int i, auto masked_tag) {
    constexpr bool MASKED = decltype(masked_tag)::value;
    const int s = i % STAGES, kv0 = lo + i * KT;
    mbar_wait(&full[s], (i / STAGES) & 1);  // tile i has landed
    const unsigned long long dk = wg_desc_plus(dk0, s * S::STAGE_BYTES), dv = wg_desc_plus(dv0, s * S::STAGE_BYTES);
    const bool sees = !MASKED || wg_rows.sees_some(kv0, KT);
    if (sees) {  // warpgroup-uniform (attention/wgmma_tile.cuh: each product waited on)
      wg_qk<T, KT, D, ROWS, KT>(sacc, dq, dk);
      wg_softmax_tile<Cfg, MASKED>(sacc, o, st, kv0, hi, t, row_ok, row_pos, slope);
      wg_pv_rs<T, DV, KT>(o, sacc, dv);
    }
    mbar_arrive(&empty[s]);  // the tile's P V has read V: the stage may be refilled
  };
  // Tiles [i_a, i_b) need no mask for any row of the warpgroup (all 64 rows real, every key below hi,
  // on or below every row's diagonal, inside every row's window): they run the unmasked softmax in a
  // loop of their own; the tiles before (window edge) and after (diagonal, tail) are masked.
  int i_a, i_b;
  tiles.full(wg_rows, i_a, i_b, wg_rows.rows >= 64);
  for (int i = 0; i < i_a; ++i) step(i, BoolTag<true>());
  for (int i = i_a; i < i_b; ++i) step(i, BoolTag<false>());
  for (int i = i_b; i < ntiles; ++i) step(i, BoolTag<true>());

  wg_prefill_finish(ep, st, o, row_ok, row_tok, row_head, t);
}

}  // namespace kgen
