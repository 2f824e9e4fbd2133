// Paged decode attention: one query token per sequence against its paged KV cache.
//
// Work decomposition: one thread block per (KV head, sequence, KV partition); the block
// serves the GROUP query heads that share its KV head, so every K/V row is read from
// memory once per group.
//
// Memory: the block walks its tokens in tiles of TILE_TOKENS. All threads copy a tile's K
// and V rows (and per-token scales) into shared memory with cp.async (async_copy.cuh),
// STAGES tiles deep: while tile i is computed, tiles i+1 .. i+STAGES-1 are in flight.
// K rows land as [token][head_dim]; V rows too, except in the vLLM layout, whose V is
// head_dim-major in memory: it is copied along the token axis and lands as
// [head_dim][token] (rows padded against bank conflicts).
//
// Compute: the threads form row groups of LANES lanes that split head_dim (VEC elements a
// lane, CPL chunks) for q . K, and V_HEAD_DIM (VCPL chunks) for P V and the output. A row group
// serves HEADS_PER_THREAD query heads (its "head set") for TOKENS_PER_THREAD consecutive tokens of
// each tile (its "token slot"), so the registers per thread grow with HEADS_PER_THREAD, not with
// the GQA group. Each thread keeps its heads' queries and output accumulators in registers (o:
// OUT = VCPL * VEC elements a head) and an online-softmax state (SoftmaxState, softmax.cuh); what
// it computes on a tile, q . K, the batch's softmax update and P V, is the CUDA-core tile part's
// (SimtHeads, attention/simt_tile.cuh). Token slots are merged through shared memory at the end.
//
// Split-KV (flash-decoding, Cfg::SPLIT): the call's plan (kgen/plan/split.py)
// chooses partition_tokens and max_partitions = gridDim.z at call time. Block z covers keys
// [z * partition_tokens, (z + 1) * partition_tokens), the last one everything to seq_len (so
// a plan made for shorter lengths still gives the right answer), and writes its normalised
// partial output plus (m, l); the merge kernel (softmax.cuh's merge_partitions_body, shared with
// prefill) combines them by log-sum-exp. With one partition the block writes the final output
// itself and no merge runs.
//
// Cfg (rendered per spec, geometry from kgen/families/attention/decode_geometry.py) supplies the types
// and compile-time constants; the copies read the K/V pool through KvPool (attention/kv_pool.cuh). Needs kgen/platform.cuh, async_copy.cuh, convert.cuh and
// softmax.cuh before it (templates/paged_decode.cu.j2 includes them; this body is inlined).
#pragma once

#include "kgen/attention/traits.cuh"
#include "kgen/attention/visibility.cuh"
#include "kgen/attention/logits.cuh"
#include "kgen/attention/softmax_tile.cuh"
#include "kgen/attention/stage_ring.cuh"
#include "kgen/attention/kv_format.cuh"
#include "kgen/attention/kv_pool.cuh"
#include "kgen/attention/simt_tile.cuh"
#include "kgen/attention/epilogue.cuh"

namespace kgen {

template <class Cfg>
struct DecodeShape {
  typedef typename Cfg::kv_t kv_t;
  static constexpr int D = Cfg::HEAD_DIM;    // q and K
  static constexpr int DV = Cfg::V_HEAD_DIM;  // V and out
  static constexpr int G = Cfg::GROUP;
  static constexpr int THREADS = Cfg::NUM_THREADS;
  typedef KvFormat<Cfg> F;  // the cache's format (attention/kv_format.cuh)
  static constexpr int ES = F::ES, PER = F::PER;
  static constexpr int VEC = Cfg::VEC;
  static constexpr int CHUNKS = D / VEC, V_CHUNKS = DV / VEC;
  static constexpr int LANES = Cfg::LANES;  // lanes of a row group
  static constexpr int CPL = Cfg::CPL;      // chunks of head_dim per lane
  static constexpr int VCPL = Cfg::VCPL;    // chunks of v_head_dim per lane
  static constexpr int QK = CPL * VEC;      // query elements per lane and head
  static constexpr int OUT = VCPL * VEC;    // output elements per lane and head
  static constexpr int HPT = Cfg::HEADS_PER_THREAD;
  static constexpr int HEAD_SETS = (G + HPT - 1) / HPT;
  static constexpr int SLOTS = Cfg::TOKEN_SLOTS;
  static constexpr int NT = Cfg::TILE_TOKENS;
  static constexpr int TPT = NT / SLOTS;  // tokens per thread and tile
  static constexpr int SUB = Cfg::BATCH_TOKENS;  // ... computed in batches of SUB
  static constexpr int STAGES = Cfg::STAGES;
  static constexpr bool V_BY_TOKEN = Cfg::V_RUN == 1;  // vLLM V: head_dim-major, tokens contiguous
  static constexpr int V_ROW = Cfg::V_ROW;               // elements per smem V row (vLLM)
  static constexpr int K_COPY = Cfg::K_COPY;  // bytes per K copy (and V copy unless V_BY_TOKEN)
  static constexpr int V_COPY = Cfg::V_COPY;  // bytes per V copy
  static constexpr ScaleMode SCALES = F::SCALES;
  static constexpr bool TOKEN_SCALES = F::TOKEN_SCALES, FP4 = F::FP4;
  static constexpr int GROUPS = F::GROUPS;  // nvfp4: [K | V][token][group] scales in a stage
  static constexpr int K_BYTES = F::bytes(NT * D);
  static constexpr int V_BYTES = F::bytes(V_BY_TOKEN ? DV * V_ROW : NT * DV);
  static constexpr int S_BYTES = F::scale_bytes(NT);
  static constexpr int STAGE_BYTES = K_BYTES + V_BYTES + S_BYTES;
  static constexpr int SCRATCH_BYTES = SLOTS * G * (DV + 2) * 4;  // the token slots' (o, m, l)
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES > SCRATCH_BYTES ? STAGES * STAGE_BYTES : SCRATCH_BYTES;
  static_assert(SMEM_BYTES == Cfg::SMEM_BYTES, "shared memory: kgen's geometry and the template disagree");
  static_assert(D % VEC == 0 && DV % VEC == 0 && LANES <= 32 && (LANES & (LANES - 1)) == 0 &&
                LANES * CPL >= CHUNKS && LANES * VCPL >= V_CHUNKS, "lanes");
  static_assert(THREADS % 32 == 0 && THREADS % LANES == 0, "threads must be whole warps of whole row groups");
  static_assert(HEAD_SETS * SLOTS <= THREADS / LANES && NT % SLOTS == 0, "row groups");
  static_assert(STAGES >= 1 && TPT % SUB == 0, "stages, batches");
};

// The cp.async copies of a tile (its tokens [tbase, tbase + NT)) into a pipeline stage.
// Everything that does not change from tile to tile is computed once, when the block starts:
// each thread's copies sit at fixed tokens of a tile and fixed head_dim offsets, so their
// offsets inside a cache block (KV head, slot, head_dim run) and their shared-memory
// destinations are constants; per tile only the block-table entry and the tile's offset in it
// are added. Tiles are aligned to NT and NT, B are powers of two, so a tile lies inside one cache
// block (B >= NT: one table entry a tile, read once) or covers whole blocks (B < NT: a copy's
// block is the tile's first plus a constant). Tokens outside [tok_begin, tok_end) are not read:
// their bytes are zero-filled, so a masked token's K and V are 0 in shared memory, never the
// poison of an unread slot (and no table entry past the sequence is followed).
template <class Cfg>
struct TileCopier {
  typedef DecodeShape<Cfg> S;
  typedef typename Cfg::kv_t kv_t;
  static constexpr int D = S::D, DV = S::DV, NT = S::NT, THREADS = S::THREADS, B = Cfg::BLOCK_SIZE, ES = S::ES;
  static constexpr bool ONE_BLOCK = B >= NT;  // every tile inside one cache block
  // K rows (and V rows, same mapping, when V is token-major and as wide): copy c = tid + k * THREADS is
  // piece c % PER_ROW of token c / PER_ROW; it lands at element c * KE of the stage. V rows of
  // their own width (v_head_dim) take a second loop of the same shape (V_PER_ROW pieces a token).
  static constexpr int KE = S::K_COPY / ES * S::PER;  // elements per copy
  static constexpr int PER_ROW = D / KE, V_PER_ROW = DV / KE;
  static constexpr int COPIES = NT * PER_ROW, V_COPIES = NT * V_PER_ROW;
  static constexpr int ITERS = (COPIES + THREADS - 1) / THREADS;
  static constexpr bool V_WITH_K = !S::V_BY_TOKEN && DV == D;  // V's copies ride along K's

  const int* __restrict__ table;  // the sequence's block-table row
  KvPool<Cfg> pool;               // attention/kv_pool.cuh
  int kv_head;

  // The tile's tokens [tbase, tbase + NT) into `stage`.
  __device__ __forceinline__ void issue(unsigned char* __restrict__ stage, int tbase, int tok_begin,
                                        int tok_end) const {
    const unsigned tid = threadIdx.x;  // unsigned: index math by shifts and masks
    kv_t* ks = reinterpret_cast<kv_t*>(stage);
    kv_t* vs = reinterpret_cast<kv_t*>(stage + S::K_BYTES);
    const int lo = tok_begin - tbase, hi = tok_end - tbase;  // the tile's valid tokens: [lo, hi)
    // B >= NT: the tile's one block and its first slot there (the table entry is valid: every
    // tile issued holds a token of [tok_begin, tok_end)). B < NT: the tile's first block.
    const unsigned first = (unsigned)tbase / B;
    const long long phys0 = ONE_BLOCK ? table[first] : 0;
    const int slot0 = ONE_BLOCK ? (unsigned)tbase % B : 0;
#pragma unroll
    for (int k = 0; k < ITERS; ++k) {
      const unsigned c = tid + k * THREADS;
      if (COPIES % THREADS == 0 || c < COPIES) {
        const int t = c / PER_ROW, d0 = (c % PER_ROW) * KE, slot = slot0 + t % B;
        const bool valid = t >= lo && t < hi;
        const kv_t* ksrc = pool.k_cache;
        const kv_t* vsrc = pool.v_cache;
        if (valid) {
          const long long phys = ONE_BLOCK ? phys0 : table[first + t / B];
          ksrc = pool.k_row(phys, kv_head, slot, d0);
          vsrc = pool.v_row(phys, kv_head, slot, d0);
        }
        cp_async<S::K_COPY>(ks + c * KE / S::PER, ksrc, valid ? S::K_COPY : 0);
        if (V_WITH_K) cp_async<S::K_COPY>(vs + c * KE / S::PER, vsrc, valid ? S::K_COPY : 0);
      }
    }

    // Token-major V rows of their own width: V_PER_ROW pieces a token.
    if (!S::V_BY_TOKEN && !V_WITH_K) {
#pragma unroll
      for (int k = 0; k < (V_COPIES + THREADS - 1) / THREADS; ++k) {
        const unsigned c = tid + k * THREADS;
        if (V_COPIES % THREADS == 0 || c < V_COPIES) {
          const int t = c / V_PER_ROW, d0 = (c % V_PER_ROW) * KE, slot = slot0 + t % B;
          const bool valid = t >= lo && t < hi;
          const kv_t* vsrc = pool.v_cache;
          if (valid) vsrc = pool.v_row(ONE_BLOCK ? phys0 : table[first + t / B], kv_head, slot, d0);
          cp_async<S::K_COPY>(vs + c * KE / S::PER, vsrc, valid ? S::K_COPY : 0);
        }
      }
    }

    // vLLM V: V_COPY-byte pieces along the token axis of one head_dim row (VE tokens of one
    // cache block); a piece that runs past tok_end reads only the tokens before it.
    if constexpr (S::V_BY_TOKEN) {
      constexpr int VE = S::V_COPY / ES;
      constexpr int PER_D = NT / VE;
      constexpr int VCOPIES = DV * PER_D;
#pragma unroll
      for (int k = 0; k < (VCOPIES + THREADS - 1) / THREADS; ++k) {
        const unsigned c = tid + k * THREADS;
        if (VCOPIES % THREADS == 0 || c < VCOPIES) {
          const int d = c / PER_D, t0 = (c % PER_D) * VE, pos = tbase + t0;
          const int n = min(VE, tok_end - pos);
          const bool valid = n > 0 && pos + VE > tok_begin;
          const kv_t* vsrc = pool.v_cache;
          if (valid) vsrc = pool.v_column(table[(unsigned)pos / B], kv_head, d, (unsigned)pos % B);
          kv_t* dst = vs + d * S::V_ROW + t0;
          if constexpr (S::V_COPY >= 4) {
            cp_async<(S::V_COPY >= 4 ? S::V_COPY : 4)>(dst, vsrc, valid ? n * ES : 0);
          } else {  // pieces under 4 bytes (tiny blocks): a plain copy, landed at issue
            unsigned char* db = reinterpret_cast<unsigned char*>(dst);
            const unsigned char* sb = reinterpret_cast<const unsigned char*>(vsrc);
#pragma unroll
            for (int b = 0; b < S::V_COPY; ++b) db[b] = valid && b < n * ES ? sb[b] : (unsigned char)0;
          }
        }
      }
    }

    // The tile's per-token scales or nvfp4 block-scale rows (attention/kv_format.cuh; masked tokens'
    // zero-filled).
    S::F::template issue_scales<NT, THREADS, true>(
        stage + S::K_BYTES + S::V_BYTES, pool.k_scale, pool.v_scale, pool.ks_s_block, pool.ks_s_head,
        pool.ks_s_token, pool.vs_s_block, pool.vs_s_head, pool.vs_s_token, kv_head, [&](int t) { return t >= lo && t < hi; },
        [&](int t, long long& phys, int& slot) {
          phys = ONE_BLOCK ? phys0 : table[first + t / B];
          slot = slot0 + t % B;
        });
  }
};

template <class Cfg, class Params>
__device__ __forceinline__ void paged_decode_body(const Params& p) {
  // The parameters (Params: generated from the kernel's argument table): the output side is the
  // epilogue's (attention/epilogue.cuh), the K/V pool the copier's (attention/kv_pool.cuh), q bound
  // here; ABI 1's positional signature is templates/abi1/'s, which fills a Params and calls this.
  const auto* __restrict__ q = p.q;
  const long long q_s_seq = p.q_s_seq, q_s_head = p.q_s_head;
  typedef DecodeShape<Cfg> S;
  typedef typename Cfg::kv_t kv_t;
  constexpr int DV = S::DV, G = S::G, NT = S::NT, TPT = S::TPT, SUB = S::SUB, STAGES = S::STAGES;
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_seq, blockIdx.z);  // the output side, partition blockIdx.z
  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = (unsigned)tid % S::LANES;             // lane within the row group
  const unsigned group = (unsigned)tid / S::LANES;      // row group
  const int hset = group % S::HEAD_SETS;                // its query heads: hset * HPT ...
  const bool counted = group / S::HEAD_SETS < S::SLOTS;  // row groups past the last slot only follow along
  const int slot = counted ? group / S::HEAD_SETS : S::SLOTS - 1;
  const int q_head0 = kv_head * G;

  const int seq_len = p.seq_lens[seq];
  int tok_begin, tok_end;
  if (!decode_key_range<Cfg>(seq_len, ep.part, p.partition_tokens, p.max_partitions, ep.split, tok_begin, tok_end))
    return;
  const int tile0 = tok_begin / NT * NT;  // tiles are aligned to NT tokens
  const int ntiles = tok_end > tok_begin ? (tok_end - tile0 + NT - 1) / NT : 0;

  __shared__ __align__(16) unsigned char smem[S::SMEM_BYTES];
  const TileCopier<Cfg> copier{p.block_tables + (long long)seq * p.max_blocks_per_seq, KvPool<Cfg>::of(p), kv_head};
  auto issue = [&](int tile, int stage) {  // tile `tile` into pipeline stage `stage`
    copier.issue(smem + stage * S::STAGE_BYTES, tile0 + tile * NT, tok_begin, tok_end);
  };
  // The first STAGES - 1 tiles are requested before anything else is done (attention/stage_ring.cuh).
  StageRing<STAGES>::start(ntiles, [&](int t) { issue(t, t); });

  // This thread's heads: queries, slopes, online-softmax states and outputs in registers
  // (attention/simt_tile.cuh).
  SimtHeads<Cfg, S> heads;
  heads.start(lane, hset,
              [&](int g) { return q + seq * q_s_seq + (long long)(q_head0 + g) * q_s_head; },
              [&](int g) { return Cfg::ALIBI ? p.alibi_slopes[q_head0 + g] : 0.0f; });
  const TileSoftmax softmax = TileSoftmax::of(1.0f);  // the logits are scaled (attention/softmax_tile.cuh)
  // Per-tensor / per-head dequantisation scales (per-token ones and nvfp4's block scales come with each tile).
  const typename S::F::Scales kv_sc = S::F::tensor_scales(copier.pool.k_scale, copier.pool.v_scale, kv_head);
  const float k_sc = kv_sc.k, v_sc = kv_sc.v;
  float l_part = 0.0f;  // this lane's share of its head's sum of weights (SimtHeads::DIST)

  // The loop bound is uniform across the block, so every lane reaches every shuffle and barrier.
  // cur: the stage computed (tile % STAGES); prev: the one computed before, refilled this time.
  int cur = 0, prev = STAGES - 1;
  for (int tile = 0; tile < ntiles; ++tile) {
    StageRing<STAGES>::next(tile, ntiles, [&](int t) { issue(t, prev); });  // (STAGES 1: prev is 0)

    const unsigned char* stage = smem + cur * S::STAGE_BYTES;
    prev = cur;
    cur = cur + 1 == STAGES ? 0 : cur + 1;
    const kv_t* ks = reinterpret_cast<const kv_t*>(stage);
    const kv_t* vs = reinterpret_cast<const kv_t*>(stage + S::K_BYTES);
    const float* ss = reinterpret_cast<const float*>(stage + S::K_BYTES + S::V_BYTES);
    const unsigned char* fs = stage + S::K_BYTES + S::V_BYTES;  // nvfp4: K's block scales, then V's
    const int t0 = slot * TPT;                 // this slot's first token in the tile
    const int pos0 = tile0 + tile * NT + t0;   // ... and its position

    // The slot's tokens in batches of SUB (registers hold SUB logits a head, whatever the tile).
#pragma unroll 1
    for (int batch = 0; batch < TPT / SUB; ++batch) {
      const int t1 = t0 + batch * SUB, pos1 = pos0 + batch * SUB;
      float s[S::HPT][SUB];
      heads.dots(ks, fs, t1, s);  // Q . K, this lane's share
      // Token j of the batch: its logit from its dot product (attention/logits.cuh; -inf when
      // masked: the batch's tokens in [tok_begin, tok_end) are seen_j), its weight exp(s - m)
      // (attention/softmax_tile.cuh: 0 when masked), and that weight times its V scale.
      const KeyRange seen_j{tok_begin - pos1, tok_end - pos1};
      auto logit = [&](float dot, int j, float sl) {
        const float ksj = S::TOKEN_SCALES ? ss[t1 + j] : k_sc;
        const float x = Logits<Cfg>::of(dot, ksj * Cfg::SOFTMAX_SCALE, sl, pos1 + j, seq_len - 1);
        return seen_j.contains(j) ? x : KGEN_NEG_INF;
      };
      auto v_weight = [&](float p, int j) { return p * (S::TOKEN_SCALES ? ss[NT + t1 + j] : v_sc); };
      heads.softmax(softmax, s, logit, v_weight, l_part);
      heads.accumulate(s, vs, fs, t1);  // o += weights @ V
    }
  }
  heads.finish(l_part);

  // Merge the token slots through shared memory (the tile buffers are free once every
  // copy has landed and every thread is past the loop): [slot][g][d] outputs, then
  // [slot][g] (m, l).
  cp_async_wait_all();
  __syncthreads();
  float* o_s = reinterpret_cast<float*>(smem);
  float* ml_s = o_s + S::SLOTS * G * DV;
  if (counted) heads.store(o_s, ml_s, slot, hset);
  __syncthreads();

  // Write out: the final output, or this partition's normalised partial and its (m, l).
  merge_slots<S>(o_s, ml_s, ep, seq, q_head0);
}

// The merge kernel: the partitions of one (sequence blockIdx.y, query head blockIdx.x) (softmax.cuh).
template <class Cfg, class Params>
__device__ __forceinline__ void paged_decode_merge_body(const Params& p) {
  const int seq = blockIdx.y;
  merge_partitions_body<Cfg>(p.out, p.part_o, p.part_ml, p.lse, seq, p.seq_lens[seq], p.max_partitions,
                             p.partition_tokens, p.o_s_seq, p.o_s_head, p.sinks);
}

}  // namespace kgen
