// Paged prefill attention: chunks of query tokens against their sequences' paged KV caches
// (docs/prefill-family.md). Needs kgen/platform.cuh, async_copy.cuh, convert.cuh, softmax.cuh
// (SoftmaxState, the logit adjustments, the split-KV contract and merge body) and mma.cuh before it;
// it includes the attention parts it uses (kgen/attention/*.cuh) itself.
//
// Rows. A sequence's query rows are packed as (token, head of the GQA group) pairs, head fastest,
// so the GROUP query heads that share a KV head share every K/V tile, and a short chunk (decode's
// q_len = 1) still fills GROUP rows. Query row j of sequence s sits at absolute position
// p = seq_lens[s] - q_len + j and sees keys 0..p (causal), p-W+1..p (window W) or all keys.
//
// Work. One thread block per (tile of 16 * WARPS packed rows, KV head, z); z = KV partition *
// v_head_dim slices (a v_head_dim over 256 is computed in slices of 256 output columns, so the
// accumulator stays in registers). Each warp owns 16 rows. The block walks its keys in tiles of
// KV_TILE: only keys some row of the block can see are loaded (tiles wholly above the causal
// diagonal or before the window are never visited); a warp whose rows see none of a tile skips
// it. K and V of a tile are gathered through the block table and stored in shared memory in the
// MMA input type (q's type) as *stored*, never scaled: int8 and fp8 (e4m3, e5m2) values convert
// to fp16 and bf16 exactly, so the operands carry no rounding a float64 computation on
// real = stored * scale would not have. Tiles are streamed with cp.async (async_copy.cuh), STAGES
// deep: while tile i is computed, tiles i+1 .. i+STAGES-1 are in flight. A cache in q's type lands
// straight in the operand tiles; a quantized (or wider) one lands as stored in a staging tile and
// one pass converts it into the operand tile (convert.cuh); vLLM's V (head_dim-major: a key's row
// is not contiguous) takes plain loads (see kv_path).
//
// Scales (real = stored * scale), in fp32 outside the products: K's multiplies the logits (per
// tensor or head: folded into the softmax scale; per token: logit column j times k_scale[j],
// before the soft-cap, bias and mask). V's: per tensor or head, the output at the end; per token,
// P[:, j] times v_scale[j] before P is rounded to q's type for P V (for fp16 q, times
// v_scale[j] / v_ref, v_ref the largest over the block's keys, and the output times v_ref at the
// end: P stays within fp16's range). The softmax state (m, l) is that of the real logits: l sums
// unscaled P.
//
// Math. With 16-bit q: S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k16, fp32
// accumulate, operands from ldmatrix; P goes from the S accumulators to A fragments in
// registers). With fp32 q (or a GPU older than sm_80) the same fragments are computed by fp32
// FMAs, which keeps fp32 accuracy. Softmax is online per row (SoftmaxState, softmax.cuh), its max
// reduced over the four lanes that share a row.
//
// Split-KV (Cfg::SPLIT): the call's plan (kgen/plan/split.py) chooses partition_tokens
// and max_partitions at call time. Partition z holds keys [z * P, (z + 1) * P), the last one the
// rest of the sequence (a plan made for shorter lengths stays exact); each block writes its
// normalised partial output and (m, l), and the merge kernel (softmax.cuh's merge_partitions_body,
// shared with decode) combines them per (token, head).
// With one partition the block writes the final output itself and no merge runs.
#pragma once

#include "kgen/attention/traits.cuh"
#include "kgen/attention/visibility.cuh"
#include "kgen/attention/logits.cuh"
#include "kgen/attention/softmax_tile.cuh"
#include "kgen/attention/stage_ring.cuh"
#include "kgen/attention/kv_format.cuh"
#include "kgen/attention/kv_pool.cuh"
#include "kgen/attention/epilogue.cuh"
#include "kgen/attention/mma_tile.cuh"

namespace kgen {

#if !defined(KGEN_SIMT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define KGEN_PREFILL_HAS_MMA 0  // mma.sync m16n8k16 needs sm_80
#else
#define KGEN_PREFILL_HAS_MMA 1
#endif

// A block's sequence and tile of packed rows (false: a spare block of the grid). blockIdx.x counts
// the tiles of all sequences in order, a sequence's last (causal: heaviest) tile first, so the long
// blocks start early. Shared by the mma.sync and the Hopper bodies.
template <int G, int ROWS>
__device__ __forceinline__ bool block_seq_tile(const int* q_indptr, int num_seqs, int& seq, int& tile) {
  for (int s = 0, first = 0; s < num_seqs; ++s) {
    const int n = ((q_indptr[s + 1] - q_indptr[s]) * G + ROWS - 1) / ROWS;
    if ((int)blockIdx.x < first + n) {
      seq = s;
      tile = n - 1 - ((int)blockIdx.x - first);
      return true;
    }
    first += n;
  }
  return false;
}


template <class Cfg>
struct PrefillShape {
  typedef typename Cfg::q_t T;  // Q, K and V in shared memory: the MMA input type
  static constexpr bool MMA = sizeof(T) == 2 && KGEN_PREFILL_HAS_MMA;
  static constexpr int D = Cfg::HEAD_DIM, DV = Cfg::V_HEAD_DIM, G = Cfg::GROUP;  // q/K and V/out
  static constexpr int WARPS = Cfg::WARPS, THREADS = 32 * WARPS;
  static constexpr int MT = Cfg::M_TILES;                    // m16 row tiles per warp
  static constexpr int WROWS = 16 * MT, ROWS = WROWS * WARPS;  // packed rows per warp, per block
  static constexpr int KT = Cfg::KV_TILE;                    // keys per tile
  static constexpr int N8 = KT / 8;                          // n8 tiles of S
  static constexpr int DK = (D + 15) / 16 * 16;              // QK^T reduction extent (zero padded)
  static constexpr int LD = DK + 16 / (int)sizeof(T);        // smem row stride: +16 bytes spreads ldmatrix rows over banks
  static constexpr int LDV = (DV + 15) / 16 * 16 + 16 / (int)sizeof(T);  // ... of V's rows
  static constexpr int DS = DV > 256 ? 256 : DV;             // output columns per block
  static constexpr int SLICES = (DV + DS - 1) / DS;
  static constexpr int ONT = DS / 8;                         // n8 tiles of the output slice
  static constexpr int VEC = Cfg::VEC, CHUNKS = D / VEC, V_CHUNKS = DV / VEC;
  // A tile's K and V rows are copied by one loop over MAX_CHUNKS chunks a key (K's and V's alike
  // when the dims are equal; else the narrower one skips the chunks past its width).
  static constexpr int MAX_CHUNKS = CHUNKS > V_CHUNKS ? CHUNKS : V_CHUNKS;
  // How K/V tiles reach the operand tiles (kgen/families/attention/prefill.py, kv_path): PATH_COPY,
  // cp.async straight into STAGES operand tiles (a cache in q's type, unscaled); PATH_STAGE, cp.async
  // of the stored bytes into STAGES staging tiles, then one dequantizing pass into the operand tile;
  // PATH_GATHER, plain loads that dequantize on the way (a row chunk not contiguous in memory: vLLM's V).
  typedef typename Cfg::kv_t KV;
  typedef KvFormat<Cfg> F;  // the cache's format (attention/kv_format.cuh)
  static constexpr int PER = F::PER;
  static constexpr int PATH = Cfg::KV_PATH, STAGES = PATH == 2 ? 1 : Cfg::STAGES;
  static constexpr int COPY = VEC / PER * (int)sizeof(KV);  // bytes per cp.async
  static constexpr ScaleMode SCALES = F::SCALES;
  static constexpr bool TOKEN_SCALES = F::TOKEN_SCALES, FP4 = F::FP4;
  static constexpr int GROUPS = F::GROUPS;  // nvfp4: [K | V][key][group] scales in a stage
  static constexpr int Q_BYTES = ROWS * LD * (int)sizeof(T);
  static constexpr int TILE_BYTES = KT * LD * (int)sizeof(T);            // one K operand tile
  static constexpr int V_TILE_BYTES = KT * LDV * (int)sizeof(T);         // one V operand tile
  static constexpr int RAW_BYTES = F::bytes(KT * D);     // one staged K tile, as stored
  static constexpr int V_RAW_BYTES = F::bytes(KT * DV);  // one staged V tile
  static constexpr int SCALE_BYTES = F::scale_bytes(KT);  // a tile's scales
  // A stage: PATH_COPY the two operand tiles; PATH_STAGE K and V as stored, then the scales;
  // PATH_GATHER (one stage) only the scales, written by the plain loads.
  static constexpr int STAGE_BYTES = PATH == 0   ? TILE_BYTES + V_TILE_BYTES
                                     : PATH == 1 ? RAW_BYTES + V_RAW_BYTES + SCALE_BYTES
                                                 : SCALE_BYTES;
  static constexpr int SCALES_AT = PATH == 1 ? RAW_BYTES + V_RAW_BYTES : 0;  // the scales' offset in a stage
  static constexpr int OPERAND_BYTES = PATH == 0 ? 0 : TILE_BYTES + V_TILE_BYTES;  // the converted K and V tiles
  static constexpr int KV_BYTES = OPERAND_BYTES + STAGES * STAGE_BYTES;
  // the fp32 P tiles: reserved when any target of the spec needs them (one geometry for every target)
  static constexpr int SMEM_BYTES = Q_BYTES + KV_BYTES + (Cfg::FMA_SCRATCH ? ROWS * KT * 4 : 0);
  static_assert(MMA || Cfg::FMA_SCRATCH, "the fp32 FMA products need their P tiles");
  static_assert(SMEM_BYTES == Cfg::SMEM_BYTES, "shared memory: kgen's smem_bytes and the template disagree");
  static_assert(PATH == 2 || COPY == 4 || COPY == 8 || COPY == 16, "cp.async copies 4, 8 or 16 bytes");
  static_assert(PATH != 0 || (IsSame<KV, T>::value && COPY == 16), "the copy path needs a cache in q's type");
  static_assert(STAGES >= 1 && STAGES <= 4, "stages");
  static_assert(KT % 16 == 0, "KV_TILE must be a multiple of 16");
  static_assert(D % 8 == 0 && D % VEC == 0 && DV % 8 == 0 && DV % VEC == 0,
                "head_dim and v_head_dim must be multiples of 8 and of the vector width");
  static_assert(!FP4 || (PATH == 1 && D % 16 == 0 && DV == D), "nvfp4 takes the stage path, whole scale groups");
};

// ---- the warp's matrix products, as C fragments of m16n8 tiles (kgen_simt_mma.h has the layout) ----
// A warp owns MT m16 tiles of rows: every K and V fragment ldmatrix loads feeds MT MMAs.
template <class Cfg, bool MMA> struct PrefillMath;

template <class Cfg>
struct PrefillMath<Cfg, true> {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  static constexpr int MT = S::MT;

  // s[mt][j] = Q[rows 16mt .. 16mt + 15 of the warp's] . K[keys 8j..8j+7]^T (attention/mma_tile.cuh)
  static __device__ __forceinline__ void qk(float (&s)[MT][S::N8][4], const T* q_w, const T* k_s, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < S::N8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][j][i] = 0.0f;
    // this lane's ldmatrix rows; the loops add constants (immediate offsets, no address math)
    const T* q_l = a_lane_row<S::LD>(q_w, lane);
    qk_tile<T, true, MT, S::N8, S::DK / 16, S::LD>(
        s, [&](int kk, unsigned (&a)[MT][4]) { a_step<MT, S::LD>(a, q_l, 16 * kk); }, k_lane_row<S::LD>(k_s, lane));
  }

  // o[mt][nt] += P[16 rows of m tile mt, KT keys] . V[keys, columns d0 + 8nt ..]; p holds P as S's C fragments.
  static __device__ __forceinline__ void pv(float (&o)[MT][S::ONT][4], const float (&p)[MT][S::N8][4], const T* v_s,
                                            int d0, int dn, float*, int lane) {
    pv_tile<T, true, MT, S::ONT, S::KT / 16, S::LDV>(
        o,
        [&](int kk, unsigned (&a)[MT][4]) {  // P's A fragments of keys 16kk .. 16kk + 15
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) a_from_c<T>(a[mt], p[mt][2 * kk], p[mt][2 * kk + 1]);
        },
        v_lane_row<S::LDV>(v_s, lane) + d0, lane, dn);
  }
};

// The same fragments by fp32 FMAs (fp32 q; GPUs without mma.sync m16n8k16). The reduction runs
// outermost (a rolled loop), the lane's fragment innermost: few values live at once, no spills.
template <class Cfg>
struct PrefillMath<Cfg, false> {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  static constexpr int MT = S::MT;

  static __device__ __forceinline__ void qk(float (&s)[MT][S::N8][4], const T* q_w, const T* k_s, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int j = 0; j < S::N8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][j][i] = 0.0f;
      const T* q0 = q_w + (16 * mt + g) * S::LD;
#pragma unroll 2
      for (int d = 0; d < S::D; ++d) {
        const float a0 = to_float(q0[d]), a1 = to_float(q0[8 * S::LD + d]);
#pragma unroll
        for (int j = 0; j < S::N8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float b = to_float(k_s[(8 * j + 2 * t + e) * S::LD + d]);
            s[mt][j][e] += a0 * b;
            s[mt][j][2 + e] += a1 * b;
          }
      }
    }
  }

  // P goes through the warp's scratch p_w [16 * MT][KT] (fp32): each lane needs whole rows of it.
  static __device__ __forceinline__ void pv(float (&o)[MT][S::ONT][4], const float (&p)[MT][S::N8][4], const T* v_s,
                                            int d0, int dn, float* p_w, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < S::N8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) p_w[(16 * mt + g + (i >= 2 ? 8 : 0)) * S::KT + 8 * j + 2 * t + (i & 1)] = p[mt][j][i];
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float* p0 = p_w + (16 * mt + g) * S::KT;
#pragma unroll 1
      for (int k = 0; k < S::KT; ++k) {
        const float a0 = p0[k], a1 = p0[8 * S::KT + k];
        const T* vr = v_s + k * S::LDV + d0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < S::ONT; ++nt) {
          if (8 * nt >= dn) break;
          const float b0 = to_float(vr[8 * nt]), b1 = to_float(vr[8 * nt + 1]);
          o[mt][nt][0] += a0 * b0;
          o[mt][nt][1] += a0 * b1;
          o[mt][nt][2] += a1 * b0;
          o[mt][nt][3] += a1 * b1;
        }
      }
    }
    __syncwarp();  // every lane has read p_w before the next tile overwrites it
  }
};

// Store N floats as N elements of T at dst (aligned to min(16, N * sizeof(T)) bytes), 16 bytes at a time.
template <class T, int N>
__device__ __forceinline__ void store_vec_from_float(T* dst, const float (&src)[N]) {
  constexpr int BYTES = N * (int)sizeof(T) < 16 ? N * (int)sizeof(T) : 16, PER = BYTES / (int)sizeof(T);
  typedef typename VecStorage<BYTES>::type V;
#pragma unroll
  for (int i = 0; i < N; i += PER) {
    T e[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) e[j] = from_float<T>(src[i + j]);
    V raw;
    memcpy(&raw, e, BYTES);
    *reinterpret_cast<V*>(dst + i) = raw;
  }
}

// VEC elements [d0, d0 + VEC) of one cached row as floats; the row is stored in runs of RUN
// elements run_stride apart (the vLLM K layout; RUN = head_dim for every other layout).
template <class T, int VEC, int RUN>
__device__ __forceinline__ void load_row_chunk(const T* __restrict__ row, int d0, long long run_stride,
                                               float (&dst)[VEC]) {
  if constexpr (RUN % VEC == 0) {
    load_as_float<T, VEC>(row + (long long)(d0 / RUN) * run_stride + d0 % RUN, dst);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const int d = d0 + i;
      dst[i] = to_float(row[(long long)(d / RUN) * run_stride + d % RUN]);
    }
  }
}

// Gather keys [kv0, kv0 + KT) of one KV head into k_s / v_s (row = key, LD elements per row) with
// plain loads, as stored (PATH_GATHER: a row chunk that is not contiguous in memory), and per-token
// scales into tok_sc (K's KT, then V's KT); keys at or past kv_end are zeros, never read.
template <class Cfg>
__device__ __forceinline__ void prefill_load_kv_tile(
    typename Cfg::q_t* k_s, typename Cfg::q_t* v_s, float* tok_sc, int kv0, int kv_end, const int* __restrict__ table,
    int kv_head, const KvPool<Cfg>& kv) {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  typedef typename Cfg::kv_t KV;
  constexpr int B = Cfg::BLOCK_SIZE, VEC = S::VEC;
  constexpr int MC = S::MAX_CHUNKS;
  const bool k_all = S::CHUNKS == MC, v_all = S::V_CHUNKS == MC;  // (compile-time: no test when the dims are equal)
  for (int idx = threadIdx.x; idx < S::KT * MC; idx += S::THREADS) {
    const int i = idx / MC, c = idx % MC, key = kv0 + i;
    const bool has_k = k_all || c < S::CHUNKS, has_v = v_all || c < S::V_CHUNKS;
    float kf[VEC], vf[VEC];
    if (key < kv_end) {
      const long long phys = table[key / B];
      const int slot = key % B;
      if (has_k)
        load_row_chunk<KV, VEC, Cfg::K_RUN>(kv.k_cache + phys * kv.k_s_block + (long long)kv_head * kv.k_s_head +
                                                slot * kv.k_s_token, c * VEC, kv.k_s_run, kf);
      if (has_v)
        load_row_chunk<KV, VEC, Cfg::V_RUN>(kv.v_cache + phys * kv.v_s_block + (long long)kv_head * kv.v_s_head +
                                                slot * kv.v_s_token, c * VEC, kv.v_s_run, vf);
      if (S::TOKEN_SCALES && c == 0) {
        constexpr ScaleMode TOKEN = ScaleMode::per_token_head;
        tok_sc[i] = kv_scale_at<TOKEN>(kv.k_scale, phys, slot, kv_head, kv.ks_s_block, kv.ks_s_head, kv.ks_s_token);
        tok_sc[S::KT + i] =
            kv_scale_at<TOKEN>(kv.v_scale, phys, slot, kv_head, kv.vs_s_block, kv.vs_s_head, kv.vs_s_token);
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.0f;
      if (S::TOKEN_SCALES && c == 0) tok_sc[i] = tok_sc[S::KT + i] = 0.0f;
    }
    if (has_k) store_vec_from_float<T, VEC>(k_s + i * S::LD + c * VEC, kf);
    if (has_v) store_vec_from_float<T, VEC>(v_s + i * S::LDV + c * VEC, vf);
  }
}

// Issue the cp.async copies of keys [kv0, kv0 + KT) of one KV head into `stage` (PATH_COPY: K and V
// operand tiles, LD elements a row; PATH_STAGE: K and V as stored, D elements a row, then the
// per-token scales, K's KT then V's KT). Keys at or past kv_end are not read: their bytes are
// zero-filled, so they are 0 in shared memory, never the poison of a slot past seq_len.
template <class Cfg>
__device__ __forceinline__ void prefill_issue_tile(
    unsigned char* __restrict__ stage, int kv0, int kv_end, const int* __restrict__ table, int kv_head,
    const KvPool<Cfg>& kv) {
  typedef PrefillShape<Cfg> S;
  typedef typename Cfg::kv_t KV;
  constexpr int B = Cfg::BLOCK_SIZE, VEC = S::VEC, KT = S::KT;
  constexpr bool COPY = S::PATH == 0;
  constexpr int ROW = COPY ? S::LD : S::D, V_ROW = COPY ? S::LDV : S::DV;  // elements per shared-memory row
  constexpr int MC = S::MAX_CHUNKS;
  KV* ks = reinterpret_cast<KV*>(stage);
  KV* vs = reinterpret_cast<KV*>(stage + (COPY ? S::TILE_BYTES : S::RAW_BYTES));
  // TPK threads share a key, chunks c0, c0 + TPK, ..: a thread looks its key's block
  // up and forms its row addresses once; the TPK threads of a key copy adjacent chunks.
  constexpr int TPK = S::THREADS % KT == 0 && MC % (S::THREADS / KT) == 0 ? S::THREADS / KT : 0;
  if constexpr (TPK > 0) {
    const int i = threadIdx.x / TPK, c0 = threadIdx.x % TPK, key = kv0 + i;
    const bool valid = key < kv_end;
    const KV* krow = kv.k_cache;
    const KV* vrow = kv.v_cache;
    if (valid) {
      const long long phys = table[key / B];
      const int slot = key % B;
      krow = kv.k_cache + phys * kv.k_s_block + (long long)kv_head * kv.k_s_head + slot * kv.k_s_token;
      vrow = kv.v_cache + phys * kv.v_s_block + (long long)kv_head * kv.v_s_head + slot * kv.v_s_token;
    }
#pragma unroll
    for (int n = 0; n < MC / (TPK > 0 ? TPK : 1); ++n) {
      const int c = c0 + TPK * n, d0 = c * VEC;
      const bool has_k = S::CHUNKS == MC || c < S::CHUNKS, has_v = S::V_CHUNKS == MC || c < S::V_CHUNKS;
      // (a row in one run, every layout but vLLM's K: the offset is d0, no 64-bit product)
      const KV* ksrc =
          valid ? krow + (Cfg::K_RUN >= S::D ? d0 : run_offset<Cfg::K_RUN>(d0, kv.k_s_run)) / S::PER : kv.k_cache;
      const KV* vsrc =
          valid ? vrow + (Cfg::V_RUN >= S::DV ? d0 : run_offset<Cfg::V_RUN>(d0, kv.v_s_run)) / S::PER : kv.v_cache;
      if (has_k) cp_async<S::COPY>(ks + (i * ROW + d0) / S::PER, ksrc, valid ? S::COPY : 0);
      if (has_v) cp_async<S::COPY>(vs + (i * V_ROW + d0) / S::PER, vsrc, valid ? S::COPY : 0);
    }
  } else for (int idx = threadIdx.x; idx < KT * MC; idx += S::THREADS) {
    const int i = idx / MC, c = idx % MC, d0 = c * VEC, key = kv0 + i;
    const bool has_k = S::CHUNKS == MC || c < S::CHUNKS, has_v = S::V_CHUNKS == MC || c < S::V_CHUNKS;
    const bool valid = key < kv_end;
    const KV* ksrc = kv.k_cache;
    const KV* vsrc = kv.v_cache;
    if (valid) {
      const long long phys = table[key / B];
      const int slot = key % B;
      ksrc = kv.k_cache + phys * kv.k_s_block + (long long)kv_head * kv.k_s_head + slot * kv.k_s_token +
             run_offset<Cfg::K_RUN>(d0, kv.k_s_run) / S::PER;
      vsrc = kv.v_cache + phys * kv.v_s_block + (long long)kv_head * kv.v_s_head + slot * kv.v_s_token +
             run_offset<Cfg::V_RUN>(d0, kv.v_s_run) / S::PER;
    }
    if (has_k) cp_async<S::COPY>(ks + (i * ROW + d0) / S::PER, ksrc, valid ? S::COPY : 0);
    if (has_v) cp_async<S::COPY>(vs + (i * V_ROW + d0) / S::PER, vsrc, valid ? S::COPY : 0);
  }
  // the keys' per-token scales or block-scale rows, zero-filled past kv_end like the values
  // (attention/kv_format.cuh; the copy path has none)
  if constexpr (!COPY)
    S::F::template issue_scales<KT, S::THREADS, true>(
        stage + S::SCALES_AT, kv.k_scale, kv.v_scale, kv.ks_s_block, kv.ks_s_head, kv.ks_s_token, kv.vs_s_block,
        kv.vs_s_head, kv.vs_s_token,
        kv_head, [&](int t) { return kv0 + t < kv_end; },
        [&](int t, long long& phys, int& slot) {
          phys = table[(kv0 + t) / B];
          slot = (kv0 + t) % B;
        });
}

// PATH_STAGE: convert a landed staging tile into the operand tiles (packed conversions), values as
// stored (nvfp4: times the block scales): the per-tensor and per-token scales are applied outside
// the products. Zero-filled keys (values and block scales) stay zeros.
template <class Cfg>
__device__ __forceinline__ void prefill_convert_tile(typename Cfg::q_t* k_s, typename Cfg::q_t* v_s,
                                                     const unsigned char* stage) {
  typedef PrefillShape<Cfg> S;
  typedef typename Cfg::kv_t KV;
  constexpr int VEC = S::VEC, KT = S::KT;
  const KV* ks = reinterpret_cast<const KV*>(stage);
  const KV* vs = reinterpret_cast<const KV*>(stage + S::RAW_BYTES);
  const unsigned char* fs = stage + S::SCALES_AT;  // nvfp4: K's block-scale rows, then V's
  constexpr int MC = S::MAX_CHUNKS;
  for (int idx = threadIdx.x; idx < KT * MC; idx += S::THREADS) {
    const int i = idx / MC, c = idx % MC, d0 = c * VEC;
    float kf[VEC], vf[VEC];
    if (S::CHUNKS == MC || c < S::CHUNKS) {
      kv_staged_chunk<Cfg, VEC, S::D>(ks, fs, i, d0, kf);
      store_vec_from_float<typename Cfg::q_t, VEC>(k_s + i * S::LD + d0, kf);
    }
    if (S::V_CHUNKS == MC || c < S::V_CHUNKS) {
      kv_staged_chunk<Cfg, VEC, S::DV>(vs, fs + KT * S::GROUPS, i, d0, vf);
      store_vec_from_float<typename Cfg::q_t, VEC>(v_s + i * S::LDV + d0, vf);
    }
  }
}

// K's zero padding past head_dim (columns D .. DK of every K operand tile): copies never touch it.
template <class Cfg>
__device__ __forceinline__ void prefill_zero_k_padding(unsigned char* stages, typename Cfg::q_t* k_op) {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  if (S::DK > S::D) {
    constexpr int KT = S::KT, PAD = S::DK - S::D, NK = S::PATH == 0 ? S::STAGES : 1;
    for (int idx = threadIdx.x; idx < NK * KT * PAD; idx += S::THREADS) {
      const int k = idx / (KT * PAD), r = idx % (KT * PAD);
      T* k_tile = S::PATH == 0 ? reinterpret_cast<T*>(stages + k * S::STAGE_BYTES) : k_op;
      k_tile[(r / PAD) * S::LD + S::D + r % PAD] = from_float<T>(0.0f);
    }
  }
}

// Q of the block's rows (packed rows r0 .. r0 + rows of the sequence from token q_begin; zeros past
// the last row and past head_dim), negated where q_neg, into q_s (LD elements a row).
template <class Cfg>
__device__ __forceinline__ void prefill_load_q(typename Cfg::q_t* q_s, const typename Cfg::q_t* __restrict__ q,
                                               long long q_s_tok, long long q_s_head, int q_begin, int r0, int rows,
                                               int kv_head, bool q_neg) {
  typedef PrefillShape<Cfg> S;
  constexpr int G = S::G;
  for (int idx = threadIdx.x; idx < S::ROWS * S::DK; idx += S::THREADS) {
    const int r = idx / S::DK, d = idx % S::DK, pr = r0 + r;
    float x = 0.0f;
    if (r < rows && d < S::D)
      x = to_float(q[(long long)(q_begin + pr / G) * q_s_tok + (long long)(kv_head * G + pr % G) * q_s_head + d]);
    q_s[r * S::LD + d] = from_float<typename S::T>(q_neg ? -x : x);
  }
}

// One tile's online-softmax update of a warp's S (sm[mt][j]: C fragments of its MT m16 tiles of rows
// and the tile's keys kv0 + 8j ..): the logits (PLAIN: raw products, the scale in exp2's FFMA), the
// mask (masked tiles only), the rows' state raised and O rescaled, the weights in place (times V's
// per-token scales) and the rows' sums. row_pos(q): lane row q's position (2 * mt + r: row g + 8r
// of m tile mt).
template <class Cfg, bool PLAIN, class Keys, class RowPos>
__device__ __forceinline__ void prefill_softmax_tile(
    float (&sm)[PrefillShape<Cfg>::MT][PrefillShape<Cfg>::N8][4], SoftmaxState (&st)[2 * PrefillShape<Cfg>::MT],
    float (&o)[PrefillShape<Cfg>::MT][PrefillShape<Cfg>::ONT][4], const TileSoftmax& softmax, RowPos&& row_pos,
    const float (&slope)[Cfg::ALIBI ? 2 * PrefillShape<Cfg>::MT : 1], int kv0, int hi, bool masked,
    const float* tok_sc, float qk_scale, float v_inv_ref, int lane) {
  typedef PrefillShape<Cfg> S;
  constexpr int MT = S::MT, LANE_ROWS = 2 * MT;
  const int t = lane & 3;
  float m_tile[LANE_ROWS];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float(&s)[S::N8][4] = sm[mt];
    m_tile[2 * mt] = m_tile[2 * mt + 1] = KGEN_NEG_INF;
#pragma unroll
    for (int j = 0; j < S::N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = 2 * mt + (i >> 1), col = 8 * j + 2 * t + (i & 1), key = kv0 + col;
        if constexpr (!PLAIN) {
          s[j][i] = Logits<Cfg>::of(s[j][i], S::TOKEN_SCALES ? qk_scale * tok_sc[col] : qk_scale,
                                    slope[Cfg::ALIBI ? rr : 0], key, row_pos(rr));
        }
      }
  }
  if (masked) {  // only the diagonal, window-edge and tail tiles pay for the mask
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < S::N8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int rr = 2 * mt + (i >> 1), key = kv0 + 8 * j + 2 * t + (i & 1);
          if (!Keys::sees(key, row_pos(rr), hi)) sm[mt][j][i] = KGEN_NEG_INF;
        }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < S::N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) m_tile[2 * mt + (i >> 1)] = fmaxf(m_tile[2 * mt + (i >> 1)], sm[mt][j][i]);
  float mb[LANE_ROWS];  // each row's exponent offset (TileSoftmax)
#pragma unroll
  for (int rr = 0; rr < LANE_ROWS; ++rr)  // the four lanes of a group hold the row's columns
    scale_row(o[rr / 2], rr % 2, softmax.raise(st[rr], quad_max(m_tile[rr]), mb[rr]));
  float l_tile[LANE_ROWS];  // this lane's share of the row sums; the lanes' shares add up at the end
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float(&s)[S::N8][4] = sm[mt];
    l_tile[2 * mt] = l_tile[2 * mt + 1] = 0.0f;
#pragma unroll
    for (int j = 0; j < S::N8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = 2 * mt + (i >> 1);
        s[j][i] = softmax.weight(s[j][i], mb[rr]);  // exp(logit - m); a masked -inf gives 0
        l_tile[rr] += s[j][i];
      }
    if constexpr (S::TOKEN_SCALES) {  // P V sees P times V's scales; l above is that of the real logits
#pragma unroll
      for (int j = 0; j < S::N8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[j][i] *= tok_sc[S::KT + 8 * j + 2 * t + (i & 1)] * v_inv_ref;
    }
  }
#pragma unroll
  for (int rr = 0; rr < LANE_ROWS; ++rr) st[rr].l += l_tile[rr];
}

// Write the warp's rows out (attention/epilogue.cuh): the final output or the partition's partial
// (columns d0 .. d0 + dn of the slice) and, from slice 0, each row's state. row_at(q): lane row q's
// packed index in the sequence; rows: the block's rows from r0.
template <class Cfg, class RowAt>
__device__ __forceinline__ void prefill_write_rows(const Epilogue<Cfg>& ep, SoftmaxState (&st)[2 * PrefillShape<Cfg>::MT],
                                                   const float (&o)[PrefillShape<Cfg>::MT][PrefillShape<Cfg>::ONT][4],
                                                   RowAt&& row_at, int rows, int r0, int q_begin, int kv_head, int d0,
                                                   int dn, int slice, float v_out, int lane) {
  typedef PrefillShape<Cfg> S;
  constexpr int G = S::G, MT = S::MT, LANE_ROWS = 2 * MT;
  const int t = lane & 3;
#pragma unroll
  for (int rr = 0; rr < LANE_ROWS; ++rr) {
    st[rr].l = quad_sum(st[rr].l);
  }
  bool row_ok[LANE_ROWS];
  int row_tok[LANE_ROWS], row_head[LANE_ROWS];
#pragma unroll
  for (int rr = 0; rr < LANE_ROWS; ++rr) {
    const int pr = row_at(rr);
    row_ok[rr] = pr - r0 < rows;
    row_tok[rr] = q_begin + pr / G;
    row_head[rr] = kv_head * G + pr % G;
  }
  float sink[LANE_ROWS];  // single pass: each row's sink once, at the end (a partial holds none)
#pragma unroll
  for (int rr = 0; rr < LANE_ROWS; ++rr) sink[rr] = row_ok[rr] ? ep.sink(st[rr], row_head[rr]) : 1.0f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float inv[2] = {st[2 * mt].inv_sum() * sink[2 * mt] * v_out,  // V's scale too
                          st[2 * mt + 1].inv_sum() * sink[2 * mt + 1] * v_out};
#pragma unroll
    for (int nt = 0; nt < S::ONT; ++nt) {
      if (8 * nt >= dn) break;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = 2 * mt + (i >> 1), d = d0 + 8 * nt + 2 * t + (i & 1);
        if (row_ok[rr]) ep.element(row_tok[rr], row_head[rr], d, o[mt][nt][i] * inv[i >> 1]);
      }
    }
  }
  if (slice == 0 && t == 0) {
#pragma unroll
    for (int rr = 0; rr < LANE_ROWS; ++rr)
      if (row_ok[rr]) ep.state(st[rr], row_tok[rr], row_head[rr]);
  }
}

// Step k's K and V operand tiles (the block's barriers included): gathered into k_op / v_op
// (PATH_GATHER, step k's tile at kv0), or its stage waited for and the next tiles' copies issued
// (attention/stage_ring.cuh), then read in place (PATH_COPY: k_s / v_s point into the stage) or
// converted into k_op / v_op (PATH_STAGE).
template <class Cfg, class Issue>
__device__ __forceinline__ void prefill_tile_operands(int k, int ntiles, Issue& issue, unsigned char* stages, int kv0,
                                                      int hi, const int* table, int kv_head, const KvPool<Cfg>& kv,
                                                      typename Cfg::q_t* k_op, typename Cfg::q_t* v_op,
                                                      const typename Cfg::q_t*& k_s, const typename Cfg::q_t*& v_s) {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  if constexpr (S::PATH == 2) {
    __syncthreads();  // Q is stored; every warp is done with the previous tile
    prefill_load_kv_tile<Cfg>(k_op, v_op, reinterpret_cast<float*>(stages), kv0, hi, table, kv_head, kv);
    __syncthreads();
  } else {
    StageRing<S::STAGES>::next(k, ntiles, issue);  // (its barrier: Q is stored too)
    const unsigned char* stage = stages + (k % S::STAGES) * S::STAGE_BYTES;
    if constexpr (S::PATH == 0) {
      k_s = reinterpret_cast<const T*>(stage);
      v_s = reinterpret_cast<const T*>(stage + S::TILE_BYTES);
    } else {
      prefill_convert_tile<Cfg>(k_op, v_op, stage);
      __syncthreads();  // the operand tiles are written
    }
  }
}

template <class Cfg, class Params>
__device__ __forceinline__ void paged_prefill_body(const Params& p) {
  // The parameters (Params: generated from the kernel's argument table): the output side is the
  // epilogue's (attention/epilogue.cuh, below), the K/V pool the KvPool's (attention/kv_pool.cuh);
  // ABI 1's positional signature is templates/abi1/'s, which fills a Params and calls this.
  const KvPool<Cfg> kv = KvPool<Cfg>::of(p);
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  typedef PrefillMath<Cfg, S::MMA> Math;
  constexpr int G = S::G, ROWS = S::ROWS, KT = S::KT, STAGES = S::STAGES;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int kv_head = blockIdx.y;
  const int slice = blockIdx.z % S::SLICES;
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_tok, blockIdx.z / S::SLICES);  // partition blockIdx.z / SLICES

  int seq, tile;
  if (!block_seq_tile<G, ROWS>(p.q_indptr, p.num_seqs, seq, tile)) return;  // uniform: the grid has spare tiles
  const int q_begin = p.q_indptr[seq], q_len = p.q_indptr[seq + 1] - q_begin, kv_len = p.seq_lens[seq];
  const int r0 = tile * ROWS, rows = min(ROWS, q_len * G - r0);
  const int pos0 = kv_len - q_len;  // absolute position of the chunk's first token
  // The block's keys and their tiles (attention/visibility.cuh): the full ones, which no row of the
  // block masks, first, then the masked ones (the window's edge, the causal diagonal, the tail).
  typedef typename PrefillKeys<Cfg>::type Keys;
  const PrefillRows<Keys, G> block{pos0, r0, rows};
  KeyTiles<Keys, KT> tiles;
  if (!prefill_key_tiles(block.span(0, ROWS), kv_len, ep.split, ep.part, p.partition_tokens, p.max_partitions, tiles))
    return;  // uniform: the partition lies past the sequence
  const int lo = tiles.lo, hi = tiles.hi, ntiles = tiles.n;
  int t_a, t_b;
  tiles.full(block.span(0, ROWS), t_a, t_b);
  const FullFirst order = FullFirst::of(t_a, t_b);

  // Shared memory: Q | operand K, V (stage and gather paths) | STAGES stages | fp32 P per warp.
  KGEN_DYNAMIC_SMEM(T, q_s);
  unsigned char* smem = reinterpret_cast<unsigned char*>(q_s);
  T* k_op = reinterpret_cast<T*>(smem + S::Q_BYTES);
  T* v_op = k_op + KT * S::LD;
  unsigned char* stages = smem + S::Q_BYTES + S::OPERAND_BYTES;
  float* p_w = reinterpret_cast<float*>(smem + S::Q_BYTES + S::KV_BYTES) + warp * S::WROWS * KT;  // fp32 math only
  const int* table = p.block_tables + (long long)seq * p.max_blocks_per_seq;
  const KvPool<Cfg> head = kv.head(kv_head);  // the KV head's rows, offset once
  auto issue = [&](int i) {  // the copies of step i's tile
    prefill_issue_tile<Cfg>(stages + (i % STAGES) * S::STAGE_BYTES, tiles.key0(order.at(i)), hi, table, kv_head, head);
  };
  // The first STAGES - 1 tiles are requested before anything else is done (Q's loads overlap them;
  // attention/stage_ring.cuh).
  if constexpr (S::PATH != 2) StageRing<STAGES>::start(ntiles, issue);
  prefill_zero_k_padding<Cfg>(stages, k_op);
  // The scales outside the products (attention/kv_format.cuh): per tensor / per head, K's folds into
  // the softmax scale and V's multiplies the output (nvfp4: the tensor scales; the block scales are
  // in the tiles); per token, each tile's come with it (K's and V's KT floats in the stage), and
  // for fp16 q V's are taken relative to their largest over the block's keys (v_reference; bf16 and
  // fp32 have fp32's range: no v_ref).
  const typename S::F::Scales kv_sc = S::F::tensor_scales(kv.k_scale, kv.v_scale, kv_head);
  float qk_scale = Cfg::SOFTMAX_SCALE * kv_sc.k, v_out = kv_sc.v, v_inv_ref = 1.0f;
  if constexpr (S::TOKEN_SCALES && IsSame<T, __half>::value) {
    S::F::template v_reference<S::THREADS>(kv.v_scale, table, lo, hi, kv_head, kv.vs_s_block, kv.vs_s_head,
                                           kv.vs_s_token, reinterpret_cast<float*>(smem), v_out, v_inv_ref);  // Q's first bytes
    __syncthreads();  // everybody has read them before Q overwrites them
  }
  // A negative scale's sign goes into Q (negating is exact), so qk_scale > 0: a row's largest raw
  // product is then its largest logit, and exp2 can take the scale in one FFMA (PLAIN below).
  const bool q_neg = qk_scale < 0.0f;
  qk_scale = fabsf(qk_scale);

  prefill_load_q<Cfg>(q_s, p.q, p.q_s_tok, p.q_s_head, q_begin, r0, rows, kv_head, q_neg);

  // This lane's rows: g and g + 8 of each of the warp's MT m16 tiles (index 2 * mt + rr).
  constexpr int MT = S::MT, LANE_ROWS = 2 * MT;
  // row q's packed index in the sequence, and its position (recomputed where needed: fewer live registers)
  auto row_at = [&](int q) { return r0 + warp * S::WROWS + 16 * (q / 2) + g + 8 * (q % 2); };
  auto row_pos = [&](int q) { return pos0 + row_at(q) / G; };
  float slope[Cfg::ALIBI ? LANE_ROWS : 1];
#pragma unroll
  for (int q = 0; q < (Cfg::ALIBI ? LANE_ROWS : 1); ++q)
    slope[q] = Cfg::ALIBI && row_at(q) - r0 < rows ? p.alibi_slopes[kv_head * G + row_at(q) % G] : 0.0f;
  const RowSpan<Keys> warp_rows = block.span(warp * S::WROWS, S::WROWS);  // rows <= 0: an idle warp
  const int d0 = slice * S::DS;
  const int dn = S::SLICES == 1 ? S::DS : min(S::DS, S::DV - d0);
  // PLAIN: the logit is the product times qk_scale (attention/logits.cuh's LINEAR, and no per-token
  // scale): the scores stay raw, their max is scaled once per row and exp2 takes the scale in its
  // FFMA (attention/softmax_tile.cuh).
  constexpr bool PLAIN = Logits<Cfg>::LINEAR && !S::TOKEN_SCALES;
  const TileSoftmax softmax = TileSoftmax::of(PLAIN ? Logits<Cfg>::raw_scale(qk_scale) : 1.0f);

  SoftmaxState st[LANE_ROWS];
#pragma unroll
  for (int q = 0; q < LANE_ROWS; ++q) st[q] = SoftmaxState::empty();
  float o[MT][S::ONT][4] = {};

  // Step k: wait for its tile (issued STAGES - 1 steps ago), refill the buffers of step k - 1,
  // then the warp's products and softmax. The loop bound is uniform across the block, so every
  // thread reaches every barrier.
  for (int k = 0; k < ntiles; ++k) {
    const bool masked = order.masked(k);  // block-uniform: the tile may hold keys some row must not see
    const int kv0 = tiles.key0(order.at(k));
    const T* k_s = k_op;
    const T* v_s = v_op;
    const float* tok_sc = reinterpret_cast<const float*>(stages + (k % STAGES) * S::STAGE_BYTES + S::SCALES_AT);
    prefill_tile_operands<Cfg>(k, ntiles, issue, stages, kv0, hi, table, kv_head, kv, k_op, v_op, k_s, v_s);
    // Warp-uniform: an idle warp, or (masked tiles) one whose rows see none of this tile's keys, skips it.
    if (warp_rows.rows <= 0 || (masked && !warp_rows.sees_some(kv0, KT))) continue;
    float sm[MT][S::N8][4];
    Math::qk(sm, q_s + warp * S::WROWS * S::LD, k_s, lane);
    prefill_softmax_tile<Cfg, PLAIN, Keys>(sm, st, o, softmax, row_pos, slope, kv0, hi, masked, tok_sc, qk_scale,
                                            v_inv_ref, lane);
    Math::pv(o, sm, v_s, d0, dn, p_w, lane);
  }

  prefill_write_rows<Cfg>(ep, st, o, row_at, rows, r0, q_begin, kv_head, d0, dn, slice, v_out, lane);
}

}  // namespace kgen
