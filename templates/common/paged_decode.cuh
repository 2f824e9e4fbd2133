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
// lane, CPL chunks) for q . K, and V_HEAD_DIM (VCPL chunks) for P V and the output. A row group serves HEADS_PER_THREAD query heads (its "head set") for
// TOKENS_PER_THREAD consecutive tokens of each tile (its "token slot"), so the registers
// per thread grow with HEADS_PER_THREAD, not with the GQA group. Each thread keeps its
// heads' queries and output accumulators in registers (o: OUT = VCPL * VEC elements a head)
// and an online-softmax state (SoftmaxState, softmax.cuh). Token slots are merged through
// shared memory at the end.
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
// and compile-time constants. Needs kgen/platform.cuh, async_copy.cuh, convert.cuh and
// softmax.cuh before it (templates/paged_decode.cu.j2 includes them; this body is inlined).
#pragma once

#include "kgen/attention/traits.cuh"
#include "kgen/attention/visibility.cuh"
#include "kgen/attention/logits.cuh"
#include "kgen/attention/softmax_tile.cuh"
#include "kgen/attention/stage_ring.cuh"
#include "kgen/attention/kv_format.cuh"
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

// Sum over the LANES lanes of a row group (xor butterfly: every lane ends with the same value).
template <int LANES>
__device__ __forceinline__ float token_group_sum(float v) {
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset, 32);
  return v;
}

// The sums over the LANES lanes of a row group of all N = H x J values of v (N a power of two),
// by a "transpose reduce": at each butterfly step a lane keeps half of its values and sends its
// partner the other half, so the sums cost about N - 1 shuffles, not N x log2(LANES). Afterwards
// lane l holds the HELD sums [(l / SPREAD) x HELD, + HELD) of the values in v's order (N < LANES:
// one, the same in SPREAD neighbouring lanes; the lowest steps a plain butterfly).
template <int LANES, int N>
struct RowGroupSums {
  static_assert((N & (N - 1)) == 0, "a power of two of values");
  static constexpr int HELD = N > LANES ? N / LANES : 1;    // sums a lane holds
  static constexpr int SPREAD = N < LANES ? LANES / N : 1;  // lanes holding the same ones

  template <int H, int J>
  static __device__ __forceinline__ void reduce(const float (&v)[H][J], float (&held)[HELD]) {
    static_assert(H * J == N, "values");
    const unsigned lane = threadIdx.x % LANES;
    float w[N];
#pragma unroll
    for (int x = 0; x < N; ++x) w[x] = v[x / J][x % J];
#pragma unroll
    for (int offset = LANES / 2, n = N; offset > 0; offset >>= 1) {
      if (n > 1) {
        const bool upper = lane & offset;  // keeps the upper half
#pragma unroll
        for (int i = 0; i < n / 2; ++i) {
          const float send = upper ? w[i] : w[i + n / 2];
          const float keep = upper ? w[i + n / 2] : w[i];
          w[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset, 32);
        }
        n /= 2;
      } else {
        w[0] += __shfl_xor_sync(0xffffffffu, w[0], offset, 32);
      }
    }
#pragma unroll
    for (int i = 0; i < HELD; ++i) held[i] = w[i];
  }

  // Every lane gets all N values back from the lanes holding them.
  template <int H, int J>
  static __device__ __forceinline__ void gather(const float (&held)[HELD], float (&v)[H][J]) {
#pragma unroll
    for (int x = 0; x < N; ++x) v[x / J][x % J] = __shfl_sync(0xffffffffu, held[x % HELD], (x / HELD) * SPREAD, LANES);
  }
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

  const int* __restrict__ table;
  const kv_t* __restrict__ k_cache;
  const kv_t* __restrict__ v_cache;
  typename Cfg::scale_arg_t k_scale;  // const float* (nvfp4: kgen::Fp4Scales)
  typename Cfg::scale_arg_t v_scale;
  long long k_s_block, k_s_head, k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run;
  long long ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head, vs_s_token;
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
        const kv_t* ksrc = k_cache;
        const kv_t* vsrc = v_cache;
        if (valid) {
          const long long phys = ONE_BLOCK ? phys0 : table[first + t / B];
          ksrc = k_cache + phys * k_s_block + kv_head * k_s_head + slot * k_s_token +
                 run_offset<Cfg::K_RUN>(d0, k_s_run) / S::PER;
          vsrc = v_cache + phys * v_s_block + kv_head * v_s_head + slot * v_s_token + d0 / S::PER;
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
          const kv_t* vsrc = v_cache;
          if (valid) {
            const long long phys = ONE_BLOCK ? phys0 : table[first + t / B];
            vsrc = v_cache + phys * v_s_block + kv_head * v_s_head + slot * v_s_token + d0 / S::PER;
          }
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
          const kv_t* vsrc = v_cache;
          if (valid) vsrc = v_cache + table[(unsigned)pos / B] * v_s_block + kv_head * v_s_head + d * v_s_run + (unsigned)pos % B;
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
        stage + S::K_BYTES + S::V_BYTES, k_scale, v_scale, ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head,
        vs_s_token, kv_head, [&](int t) { return t >= lo && t < hi; },
        [&](int t, long long& phys, int& slot) {
          phys = ONE_BLOCK ? phys0 : table[first + t / B];
          slot = slot0 + t % B;
        });
  }
};

template <class Cfg, class Params>
__device__ __forceinline__ void paged_decode_body(const Params& p) {
  // The parameters (Params: generated from the kernel's argument table): the output side is the
  // epilogue's (attention/epilogue.cuh), the rest bound here under the names the body uses; ABI 1's
  // positional signature is templates/abi1/'s, which fills a Params and calls this.
  const auto* __restrict__ q = p.q;
  const auto* __restrict__ k_cache = p.k_cache;
  const auto* __restrict__ v_cache = p.v_cache;
  const typename Cfg::scale_arg_t k_scale = p.k_scale, v_scale = p.v_scale;
  const long long q_s_seq = p.q_s_seq, q_s_head = p.q_s_head;
  const long long k_s_block = p.k_s_block, k_s_head = p.k_s_head, k_s_token = p.k_s_token, k_s_run = p.k_s_run;
  const long long v_s_block = p.v_s_block, v_s_head = p.v_s_head, v_s_token = p.v_s_token, v_s_run = p.v_s_run;
  const long long ks_s_block = p.ks_s_block, ks_s_head = p.ks_s_head, ks_s_token = p.ks_s_token;
  const long long vs_s_block = p.vs_s_block, vs_s_head = p.vs_s_head, vs_s_token = p.vs_s_token;
  typedef DecodeShape<Cfg> S;
  typedef typename Cfg::kv_t kv_t;
  constexpr int D = S::D, DV = S::DV, G = S::G, VEC = S::VEC, LANES = S::LANES, CPL = S::CPL, OUT = S::OUT;
  constexpr int HPT = S::HPT, NT = S::NT, TPT = S::TPT, SUB = S::SUB, STAGES = S::STAGES, THREADS = S::THREADS;
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_seq, blockIdx.z);  // the output side, partition blockIdx.z
  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = (unsigned)tid % LANES;               // lane within the row group
  const unsigned group = (unsigned)tid / LANES;         // row group
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
  const int* table = p.block_tables + (long long)seq * p.max_blocks_per_seq;
  const TileCopier<Cfg> copier{table, k_cache, v_cache, k_scale, v_scale, k_s_block, k_s_head, k_s_token,
                               k_s_run, v_s_block, v_s_head, v_s_token, v_s_run, ks_s_block, ks_s_head,
                               ks_s_token, vs_s_block, vs_s_head, vs_s_token, kv_head};
  auto issue = [&](int tile, int stage) {  // tile `tile` into pipeline stage `stage`
    copier.issue(smem + stage * S::STAGE_BYTES, tile0 + tile * NT, tok_begin, tok_end);
  };
  // The first STAGES - 1 tiles are requested before anything else is done (attention/stage_ring.cuh).
  StageRing<STAGES>::start(ntiles, [&](int t) { issue(t, t); });

  // This thread's heads (a head past the group repeats the last one; its results are dropped),
  // their queries in registers (dims (c * LANES + lane) * VEC + i), slopes, states, outputs.
  float qr[HPT][S::QK];
  float slope[HPT];
  SoftmaxState st[HPT];
  const TileSoftmax softmax = TileSoftmax::of(1.0f);  // the logits are scaled (attention/softmax_tile.cuh)
  float o[HPT][OUT];
#pragma unroll
  for (int h = 0; h < HPT; ++h) {
    const int g = min(hset * HPT + h, G - 1);
    const typename Cfg::q_t* qh = q + seq * q_s_seq + (long long)(q_head0 + g) * q_s_head;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int chunk = c * LANES + lane;
#pragma unroll
      for (int i = 0; i < VEC; ++i) qr[h][c * VEC + i] = chunk < S::CHUNKS ? to_float(qh[chunk * VEC + i]) : 0.0f;
    }
    slope[h] = Cfg::ALIBI ? p.alibi_slopes[q_head0 + g] : 0.0f;
    st[h] = SoftmaxState::empty();
#pragma unroll
    for (int i = 0; i < OUT; ++i) o[h][i] = 0.0f;
  }
  // Per-tensor / per-head dequantisation scales (per-token ones and nvfp4's block scales come with each tile).
  const typename S::F::Scales kv_sc = S::F::tensor_scales(k_scale, v_scale, kv_head);
  const float k_sc = kv_sc.k, v_sc = kv_sc.v;

  // Where a batch's logits are a power of two (DIST), the transpose reduce (RowGroupSums) leaves
  // each lane HELD logits of one head, hl: tokens [jb, jb + HELD) of each batch; it computes the
  // softmax of those only, HEAD_LANES lanes sharing a head's. l_part: this lane's share of head
  // hl's sum of weights (its tokens), summed over those lanes after the loop.
  constexpr bool DIST = ((HPT * SUB) & (HPT * SUB - 1)) == 0 && HPT <= LANES;
  typedef RowGroupSums<LANES, (DIST ? HPT * SUB : 1)> Sums;
  constexpr int HEAD_LANES = SUB / Sums::HELD * Sums::SPREAD;
  const int xb = lane / Sums::SPREAD * Sums::HELD;
  const int hl = xb / SUB, jb = xb % SUB;
  float l_part = 0.0f;

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
      // Logits of the slot's tokens: partial dot products, then a sum over the row group.
      float s[HPT][SUB];
#pragma unroll
      for (int j = 0; j < SUB; ++j) {
#pragma unroll
        for (int h = 0; h < HPT; ++h) s[h][j] = 0.0f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int chunk = c * LANES + lane;
          if (S::CHUNKS % LANES == 0 || chunk < S::CHUNKS) {
            float kf[VEC];
            kv_staged_chunk<Cfg, VEC, D>(ks, fs, t1 + j, chunk * VEC, kf);
#pragma unroll
            for (int h = 0; h < HPT; ++h)
#pragma unroll
              for (int i = 0; i < VEC; ++i) s[h][j] += qr[h][c * VEC + i] * kf[i];
          }
        }
      }
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
      if constexpr (DIST) {
        // The logits summed over the row group by a transpose reduce, which leaves each lane
        // HELD of them (all of one head, hl): the online softmax is computed on those only, the
        // head's tile max over the lanes holding its logits, the weights gathered back at the end.
        float w[Sums::HELD];
        Sums::reduce(s, w);
        float m_loc = KGEN_NEG_INF, sl = slope[0];
#pragma unroll
        for (int h = 1; h < HPT; ++h) sl = h == hl ? slope[h] : sl;
#pragma unroll
        for (int i = 0; i < Sums::HELD; ++i) {
          w[i] = logit(w[i], jb + i, sl);
          m_loc = fmaxf(m_loc, w[i]);
        }
#pragma unroll
        for (int offset = Sums::SPREAD; offset < HEAD_LANES; offset <<= 1)
          m_loc = fmaxf(m_loc, __shfl_xor_sync(0xffffffffu, m_loc, offset, 32));
        // Every lane raises every head's max (one rescale of o per batch); this lane's head's
        // factor and max for its own weights.
        float f_l = 1.0f, mb = 0.0f;
#pragma unroll
        for (int h = 0; h < HPT; ++h) {
          const float m_tile = HPT == 1 ? m_loc : __shfl_sync(0xffffffffu, m_loc, h * HEAD_LANES, LANES);
          float mb_h;
          const float f = softmax.raise(st[h], m_tile, mb_h);
#pragma unroll
          for (int i = 0; i < OUT; ++i) o[h][i] *= f;
          if (HPT == 1 || h == hl) f_l = f, mb = mb_h;
        }
        l_part *= f_l;
#pragma unroll
        for (int i = 0; i < Sums::HELD; ++i) {
          const float p = softmax.weight(w[i], mb);
          l_part += p;
          w[i] = v_weight(p, jb + i);
        }
        Sums::gather(w, s);
      } else {
#pragma unroll
        for (int h = 0; h < HPT; ++h)
#pragma unroll
          for (int j = 0; j < SUB; ++j) s[h][j] = token_group_sum<LANES>(s[h][j]);

        // Online softmax over the batch: one rescale of o per batch; s becomes each token's weight.
#pragma unroll
        for (int h = 0; h < HPT; ++h) {
          float m_tile = KGEN_NEG_INF;
#pragma unroll
          for (int j = 0; j < SUB; ++j) {
            s[h][j] = logit(s[h][j], j, slope[h]);
            m_tile = fmaxf(m_tile, s[h][j]);
          }
          float mb;
          const float f = softmax.raise(st[h], m_tile, mb);
#pragma unroll
          for (int i = 0; i < OUT; ++i) o[h][i] *= f;
#pragma unroll
          for (int j = 0; j < SUB; ++j) {
            const float p = softmax.weight(s[h][j], mb);
            st[h].l += p;
            s[h][j] = v_weight(p, j);
          }
        }
      }

      // o += weights @ V.
      if constexpr (!S::V_BY_TOKEN) {
#pragma unroll
        for (int j = 0; j < SUB; ++j) {
#pragma unroll
          for (int c = 0; c < S::VCPL; ++c) {
            const int chunk = c * LANES + lane;
            if (S::V_CHUNKS % LANES == 0 || chunk < S::V_CHUNKS) {
              float vf[VEC];
              kv_staged_chunk<Cfg, VEC, DV>(vs, fs + NT * S::GROUPS, t1 + j, chunk * VEC, vf);
#pragma unroll
              for (int h = 0; h < HPT; ++h)
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[h][c * VEC + i] += s[h][j] * vf[i];
            }
          }
        }
      } else {  // V is [head_dim][token]: this lane's dims are i * LANES + lane
#pragma unroll
        for (int i = 0; i < OUT; ++i) {
          const int d = i * LANES + lane;
          if (DV % LANES == 0 || d < DV) {
            float vf[SUB];
            load_as_float<kv_t, SUB>(vs + d * S::V_ROW + t1, vf);
#pragma unroll
            for (int h = 0; h < HPT; ++h)
#pragma unroll
              for (int j = 0; j < SUB; ++j) o[h][i] += s[h][j] * vf[j];
          }
        }
      }
    }
  }

  if constexpr (DIST) {  // each head's l: the sum of its lanes' shares (each held by SPREAD lanes)
#pragma unroll
    for (int offset = Sums::SPREAD; offset < HEAD_LANES; offset <<= 1)
      l_part += __shfl_xor_sync(0xffffffffu, l_part, offset, 32);
#pragma unroll
    for (int h = 0; h < HPT; ++h) st[h].l = HPT == 1 ? l_part : __shfl_sync(0xffffffffu, l_part, h * HEAD_LANES, LANES);
  }

  // Merge the token slots through shared memory (the tile buffers are free once every
  // copy has landed and every thread is past the loop): [slot][g][d] outputs, then
  // [slot][g] (m, l).
  cp_async_wait_all();
  __syncthreads();
  float* o_s = reinterpret_cast<float*>(smem);
  float* ml_s = o_s + S::SLOTS * G * DV;
  if (counted) {
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
      const int g = hset * HPT + h;
      if (HPT * S::HEAD_SETS == G || g < G) {
#pragma unroll
        for (int i = 0; i < OUT; ++i) {
          const int d = S::V_BY_TOKEN ? i * LANES + lane : ((i / VEC) * LANES + lane) * VEC + i % VEC;
          if (d < DV) o_s[(slot * G + g) * DV + d] = o[h][i];
        }
        if (lane == 0) {
          ml_s[(slot * G + g) * 2] = st[h].m;
          ml_s[(slot * G + g) * 2 + 1] = st[h].l;
        }
      }
    }
  }
  __syncthreads();

  // Write out: the final output, or this partition's normalised partial and its (m, l).
  for (int i = tid; i < G * DV; i += THREADS) {
    const int g = i / DV, d = i % DV;
    SoftmaxState blk = SoftmaxState::empty();
    float acc = 0.0f;
#pragma unroll
    for (int z = 0; z < S::SLOTS; ++z) {
      const SoftmaxFactors f = blk.merge(SoftmaxState{ml_s[(z * G + g) * 2], ml_s[(z * G + g) * 2 + 1]});
      acc = acc * f.self + o_s[(z * G + g) * DV + d] * f.other;
    }
    const int h = q_head0 + g;
    ep.finish(blk, seq, h, d, acc);  // (single pass: the sink once, at the end)
  }
}

// The merge kernel: the partitions of one (sequence blockIdx.y, query head blockIdx.x) (softmax.cuh).
template <class Cfg, class Params>
__device__ __forceinline__ void paged_decode_merge_body(const Params& p) {
  const int seq = blockIdx.y;
  merge_partitions_body<Cfg>(p.out, p.part_o, p.part_ml, p.lse, seq, p.seq_lens[seq], p.max_partitions,
                             p.partition_tokens, p.o_s_seq, p.o_s_head, p.sinks);
}

}  // namespace kgen
