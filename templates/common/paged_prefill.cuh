// Paged prefill attention: chunks of query tokens against their sequences' paged KV caches
// (docs/prefill-family.md). Needs paged_decode.cuh (loads, scales, SoftmaxState) and mma.cuh.
//
// Rows. A sequence's query rows are packed as (token, head of the GQA group) pairs, head fastest,
// so the GROUP query heads that share a KV head share every K/V tile, and a short chunk (decode's
// q_len = 1) still fills GROUP rows. Query row j of sequence s sits at absolute position
// p = seq_lens[s] - q_len + j and sees keys 0..p (causal), p-W+1..p (window W) or all keys.
//
// Work. One thread block per (tile of 16 * WARPS packed rows, KV head, z); z = KV partition *
// head_dim slices (a head_dim over 256 is computed in slices of 256 output columns, so the
// accumulator stays in registers). Each warp owns 16 rows. The block walks its keys in tiles of
// KV_TILE: only keys some row of the block can see are loaded (tiles wholly above the causal
// diagonal or before the window are never visited); a warp whose rows see none of a tile skips
// it. K and V of a tile are gathered through the block table, dequantized (real = stored * scale)
// and stored in shared memory in the MMA input type (q's type).
//
// Math. With 16-bit q: S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k16, fp32
// accumulate, operands from ldmatrix; P goes from the S accumulators to A fragments in
// registers). With fp32 q (or a GPU older than sm_80) the same fragments are computed by fp32
// FMAs, which keeps fp32 accuracy. Softmax is online per row (SoftmaxState), its max reduced over
// the four lanes that share a row.
//
// Split-KV (PARTITION_SIZE > 0): each block covers one partition of the keys and writes its
// normalised partial output and (m, l); the merge kernel combines them per (token, head).
#pragma once

namespace kgen {

#if !defined(KGEN_SIMT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define KGEN_PREFILL_HAS_MMA 0  // mma.sync m16n8k16 needs sm_80
#else
#define KGEN_PREFILL_HAS_MMA 1
#endif

template <class Cfg>
struct PrefillShape {
  typedef typename Cfg::q_t T;  // Q, K and V in shared memory: the MMA input type
  static constexpr bool MMA = sizeof(T) == 2 && KGEN_PREFILL_HAS_MMA;
  static constexpr int D = Cfg::HEAD_DIM, G = Cfg::GROUP;
  static constexpr int WARPS = Cfg::WARPS, THREADS = 32 * WARPS;
  static constexpr int ROWS = 16 * WARPS;                    // packed rows per block
  static constexpr int KT = Cfg::KV_TILE;                    // keys per tile
  static constexpr int NT = KT / 8;                          // n8 tiles of S
  static constexpr int DK = (D + 15) / 16 * 16;              // QK^T reduction extent (zero padded)
  static constexpr int LD = DK + 16 / (int)sizeof(T);        // smem row stride: +16 bytes spreads ldmatrix rows over banks
  static constexpr int DS = D > 256 ? 256 : D;               // output columns per block
  static constexpr int SLICES = (D + DS - 1) / DS;
  static constexpr int ONT = DS / 8;                         // n8 tiles of the output slice
  static constexpr int VEC = Cfg::VEC, CHUNKS = D / VEC;
  static_assert(KT % 16 == 0, "KV_TILE must be a multiple of 16");
  static_assert(D % 8 == 0 && D % VEC == 0, "head_dim must be a multiple of 8 and of the vector width");
};

// ---- the warp's matrix products, as C fragments of m16n8 tiles (kgen_simt_mma.h has the layout) ----
template <class Cfg, bool MMA> struct PrefillMath;

template <class Cfg>
struct PrefillMath<Cfg, true> {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;

  // s[j] = Q[16 rows] . K[keys 8j..8j+7]^T
  static __device__ __forceinline__ void qk(float (&s)[S::NT][4], const T* q_w, const T* k_s, int lane) {
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < S::DK / 16; ++kk) {
      unsigned a[4];
      ldmatrix<4, false>(a, q_w + (lane % 16) * S::LD + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int j = 0; j < S::NT; j += 2) {
        unsigned b[4];
        ldmatrix<4, false>(b, k_s + (j * 8 + (lane / 16) * 8 + lane % 8) * S::LD + kk * 16 + ((lane / 8) % 2) * 8);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(s[j], a, b0, s[j]);
        mma_m16n8k16<T>(s[j + 1], a, b1, s[j + 1]);
      }
    }
  }

  // o[nt] += P[16 rows, KT keys] . V[keys, columns d0 + 8nt ..]; p holds P as S's C fragments.
  static __device__ __forceinline__ void pv(float (&o)[S::ONT][4], const float (&p)[S::NT][4], const T* v_s, int d0,
                                            int dn, float*, int lane) {
#pragma unroll
    for (int kk = 0; kk < S::KT / 16; ++kk) {
      const unsigned a[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                             pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                             pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
      const T* v_row = v_s + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S::LD + d0;
#pragma unroll
      for (int nt = 0; nt < S::ONT; nt += 2) {
        if (8 * nt >= dn) break;  // uniform: dn is the slice's width
        if (nt + 1 < S::ONT && 8 * (nt + 1) < dn) {
          unsigned b[4];
          ldmatrix<4, true>(b, v_row + 8 * (nt + lane / 16));
          const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_m16n8k16<T>(o[nt], a, b0, o[nt]);
          mma_m16n8k16<T>(o[nt + 1], a, b1, o[nt + 1]);
        } else {
          unsigned b[2];
          ldmatrix<2, true>(b, v_row + 8 * nt);
          mma_m16n8k16<T>(o[nt], a, b, o[nt]);
        }
      }
    }
  }
};

// The same fragments by fp32 FMAs (fp32 q; GPUs without mma.sync m16n8k16).
template <class Cfg>
struct PrefillMath<Cfg, false> {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;

  static __device__ __forceinline__ void qk(float (&s)[S::NT][4], const T* q_w, const T* k_s, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const T* qr = q_w + (g + (i >= 2 ? 8 : 0)) * S::LD;
        const T* kr = k_s + (8 * j + 2 * t + (i & 1)) * S::LD;
        float acc = 0.0f;
        for (int d = 0; d < S::D; ++d) acc += to_float(qr[d]) * to_float(kr[d]);
        s[j][i] = acc;
      }
  }

  // P goes through the warp's scratch p_w [16][KT] (fp32): each lane needs whole rows of it.
  static __device__ __forceinline__ void pv(float (&o)[S::ONT][4], const float (&p)[S::NT][4], const T* v_s, int d0,
                                            int dn, float* p_w, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) p_w[(g + (i >= 2 ? 8 : 0)) * S::KT + 8 * j + 2 * t + (i & 1)] = p[j][i];
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < S::ONT; ++nt) {
      if (8 * nt >= dn) break;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* pr = p_w + (g + (i >= 2 ? 8 : 0)) * S::KT;
        const T* vc = v_s + d0 + 8 * nt + 2 * t + (i & 1);
        float acc = o[nt][i];
        for (int k = 0; k < S::KT; ++k) acc += pr[k] * to_float(vc[k * S::LD]);
        o[nt][i] = acc;
      }
    }
    __syncwarp();  // every lane has read p_w before the next tile overwrites it
  }
};

template <class A, class B> struct SameType { static constexpr bool value = false; };
template <class A> struct SameType<A, A> { static constexpr bool value = true; };

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

// Dequantisation scale of one (physical block, slot, KV head) for the spec's granularity.
template <int SCALE_MODE>
__device__ __forceinline__ float kv_scale_at(const float* __restrict__ scale, long long phys, int slot,
                                             int kv_head, long long s_block, long long s_head,
                                             long long s_token) {
  if (SCALE_MODE == 0) return 1.0f;                          // float cache
  if (SCALE_MODE == 1) return scale[0];                      // per_tensor
  if (SCALE_MODE == 2) return scale[kv_head];                // per_head
  return scale[phys * s_block + kv_head * s_head + slot * s_token];  // per_token_head
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

// Gather keys [kv0, kv0 + KT) of one KV head into k_s / v_s (row = key, LD elements per row),
// dequantized; keys at or past kv_end (and the zero padding of K past head_dim) are zeros, never read.
// A cache already in q's type, unscaled and with contiguous rows, is copied as raw 16-byte vectors.
template <class Cfg>
__device__ __forceinline__ void prefill_load_kv_tile(
    typename Cfg::q_t* k_s, typename Cfg::q_t* v_s, int kv0, int kv_end, const int* __restrict__ table, int kv_head,
    const typename Cfg::kv_t* __restrict__ k_cache, const typename Cfg::kv_t* __restrict__ v_cache,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, long long k_s_block, long long k_s_head,
    long long k_s_token, long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token,
    long long v_s_run, long long ks_s_block, long long ks_s_head, long long ks_s_token, long long vs_s_block,
    long long vs_s_head, long long vs_s_token) {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  typedef typename Cfg::kv_t KV;
  constexpr int B = Cfg::BLOCK_SIZE, VEC = S::VEC;
  constexpr bool RAW = SameType<KV, T>::value && Cfg::SCALE_MODE == 0 && Cfg::K_RUN % VEC == 0 &&
                       Cfg::V_RUN % VEC == 0 && VEC * (int)sizeof(T) == 16;
  if constexpr (RAW) {
    for (int idx = threadIdx.x; idx < S::KT * S::CHUNKS; idx += S::THREADS) {
      const int i = idx / S::CHUNKS, c = idx % S::CHUNKS, key = kv0 + i;
      uint4 kr = make_uint4(0u, 0u, 0u, 0u), vr = kr;
      if (key < kv_end) {
        const long long phys = table[key / B];
        const int slot = key % B;
        kr = *reinterpret_cast<const uint4*>(k_cache + phys * k_s_block + (long long)kv_head * k_s_head +
                                             slot * k_s_token + c * VEC);
        vr = *reinterpret_cast<const uint4*>(v_cache + phys * v_s_block + (long long)kv_head * v_s_head +
                                             slot * v_s_token + c * VEC);
      }
      *reinterpret_cast<uint4*>(k_s + i * S::LD + c * VEC) = kr;
      *reinterpret_cast<uint4*>(v_s + i * S::LD + c * VEC) = vr;
    }
  } else {
    for (int idx = threadIdx.x; idx < S::KT * S::CHUNKS; idx += S::THREADS) {
      const int i = idx / S::CHUNKS, c = idx % S::CHUNKS, key = kv0 + i;
      T* k_dst = k_s + i * S::LD + c * VEC;
      T* v_dst = v_s + i * S::LD + c * VEC;
      float kf[VEC], vf[VEC];
      if (key < kv_end) {
        const long long phys = table[key / B];
        const int slot = key % B;
        load_row_chunk<KV, VEC, Cfg::K_RUN>(k_cache + phys * k_s_block + (long long)kv_head * k_s_head +
                                                slot * k_s_token, c * VEC, k_s_run, kf);
        load_row_chunk<KV, VEC, Cfg::V_RUN>(v_cache + phys * v_s_block + (long long)kv_head * v_s_head +
                                                slot * v_s_token, c * VEC, v_s_run, vf);
        const float ks = kv_scale_at<Cfg::SCALE_MODE>(k_scale, phys, slot, kv_head, ks_s_block, ks_s_head, ks_s_token);
        const float vs = kv_scale_at<Cfg::SCALE_MODE>(v_scale, phys, slot, kv_head, vs_s_block, vs_s_head, vs_s_token);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          kf[e] *= ks;
          vf[e] *= vs;
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.0f;
      }
      store_vec_from_float<T, VEC>(k_dst, kf);
      store_vec_from_float<T, VEC>(v_dst, vf);
    }
  }
  if (S::DK > S::D)
    for (int idx = threadIdx.x; idx < S::KT * (S::DK - S::D); idx += S::THREADS)
      k_s[(idx / (S::DK - S::D)) * S::LD + S::D + idx % (S::DK - S::D)] = from_float<T>(0.0f);
}

template <class Cfg>
__device__ __forceinline__ void paged_prefill_body(
    typename Cfg::out_t* __restrict__ out, const typename Cfg::q_t* __restrict__ q,
    const typename Cfg::kv_t* __restrict__ k_cache, const typename Cfg::kv_t* __restrict__ v_cache,
    const int* __restrict__ q_indptr, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const float* __restrict__ alibi_slopes,
    float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ lse, int num_seqs,
    int max_blocks_per_seq, int max_partitions, long long q_s_tok, long long q_s_head, long long o_s_tok,
    long long o_s_head, long long k_s_block, long long k_s_head, long long k_s_token, long long k_s_run,
    long long v_s_block, long long v_s_head, long long v_s_token, long long v_s_run, long long ks_s_block,
    long long ks_s_head, long long ks_s_token, long long vs_s_block, long long vs_s_head, long long vs_s_token) {
  typedef PrefillShape<Cfg> S;
  typedef typename S::T T;
  typedef PrefillMath<Cfg, S::MMA> Math;
  constexpr int G = S::G, ROWS = S::ROWS, KT = S::KT, P = Cfg::PARTITION_SIZE, W = Cfg::SLIDING_WINDOW;
  constexpr bool CAUSAL = Cfg::CAUSAL;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int kv_head = blockIdx.y;
  const int slice = blockIdx.z % S::SLICES, part = blockIdx.z / S::SLICES;

  // This block's sequence and tile of packed rows: blockIdx.x counts the tiles of all sequences in
  // order, a sequence's last (causal: heaviest) tile first, so the long blocks start early.
  int seq = -1, tile = 0;
  for (int s = 0, first = 0; s < num_seqs; ++s) {
    const int n = ((q_indptr[s + 1] - q_indptr[s]) * G + ROWS - 1) / ROWS;
    if ((int)blockIdx.x < first + n) {
      seq = s;
      tile = n - 1 - ((int)blockIdx.x - first);
      break;
    }
    first += n;
  }
  if (seq < 0) return;  // uniform across the block: the grid has spare tiles
  const int q_begin = q_indptr[seq], q_len = q_indptr[seq + 1] - q_begin, kv_len = seq_lens[seq];
  const int r0 = tile * ROWS, rows = min(ROWS, q_len * G - r0);
  const int pos0 = kv_len - q_len;  // absolute position of the chunk's first token
  // Keys some row of the block sees: [lo, hi).
  int lo = W > 0 ? max(0, pos0 + r0 / G - W + 1) : 0;
  int hi = CAUSAL ? pos0 + (r0 + rows - 1) / G + 1 : kv_len;
  if (P > 0) {
    if (part >= (kv_len + P - 1) / P) return;  // uniform; the merge reads ceil(kv_len / P) partitions
    lo = max(lo, part * P);
    hi = min(hi, (part + 1) * P);
  }

  KGEN_DYNAMIC_SMEM(T, q_s);
  T* k_s = q_s + ROWS * S::LD;
  T* v_s = k_s + KT * S::LD;
  float* p_w = reinterpret_cast<float*>(v_s + KT * S::LD) + warp * 16 * KT;  // fp32 math only

  // Q of the block's rows (zeros past the last row and past head_dim).
  for (int idx = tid; idx < ROWS * S::DK; idx += S::THREADS) {
    const int r = idx / S::DK, d = idx % S::DK, pr = r0 + r;
    float x = 0.0f;
    if (r < rows && d < S::D)
      x = to_float(q[(long long)(q_begin + pr / G) * q_s_tok + (long long)(kv_head * G + pr % G) * q_s_head + d]);
    q_s[r * S::LD + d] = from_float<T>(x);
  }

  // This lane's two rows (g and g + 8 of the warp's 16).
  bool row_ok[2];
  int row_tok[2], row_head[2], row_pos[2];
  float slope[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = warp * 16 + g + 8 * rr, pr = r0 + r;
    row_ok[rr] = r < rows;
    row_tok[rr] = q_begin + pr / G;
    row_head[rr] = kv_head * G + pr % G;
    row_pos[rr] = pos0 + pr / G;
    slope[rr] = Cfg::ALIBI && row_ok[rr] ? alibi_slopes[row_head[rr]] : 0.0f;
  }
  const int warp_rows = rows - warp * 16;  // <= 0: an idle warp
  const int warp_pos_first = pos0 + (r0 + warp * 16) / G;
  const int warp_pos_last = pos0 + (r0 + min(rows, warp * 16 + 16) - 1) / G;
  const int d0 = slice * S::DS;
  const int dn = S::SLICES == 1 ? S::DS : min(S::DS, S::D - d0);

  SoftmaxState st[2] = {SoftmaxState::empty(), SoftmaxState::empty()};
  float o[S::ONT][4];
#pragma unroll
  for (int nt = 0; nt < S::ONT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[nt][i] = 0.0f;

  const int* table = block_tables + (long long)seq * max_blocks_per_seq;
  for (int kv0 = lo; kv0 < hi; kv0 += KT) {
    __syncthreads();  // Q is stored; every warp is done with the previous tile
    prefill_load_kv_tile<Cfg>(k_s, v_s, kv0, hi, table, kv_head, k_cache, v_cache, k_scale, v_scale, k_s_block,
                              k_s_head, k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run, ks_s_block,
                              ks_s_head, ks_s_token, vs_s_block, vs_s_head, vs_s_token);
    __syncthreads();
    // Warp-uniform: a warp whose rows see none of this tile's keys skips it.
    if (warp_rows <= 0 || (CAUSAL && kv0 > warp_pos_last) || (W > 0 && kv0 + KT - 1 <= warp_pos_first - W)) continue;
    float s[S::NT][4];
    Math::qk(s, q_s + warp * 16 * S::LD, k_s, lane);
    float m_tile[2] = {KGEN_NEG_INF, KGEN_NEG_INF};
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = i >> 1, key = kv0 + 8 * j + 2 * t + (i & 1);
        float x = s[j][i] * Cfg::SOFTMAX_SCALE;
        if (Cfg::SOFT_CAP > 0.0f) x = Cfg::SOFT_CAP * tanhf(x / Cfg::SOFT_CAP);
        if (Cfg::ALIBI) x += slope[rr] * (float)(key - row_pos[rr]);
        const bool seen = row_ok[rr] && key < hi && (!CAUSAL || key <= row_pos[rr]) && (W == 0 || key > row_pos[rr] - W);
        s[j][i] = seen ? x : KGEN_NEG_INF;
        m_tile[rr] = fmaxf(m_tile[rr], s[j][i]);
      }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      // the four lanes of a group hold the row's columns
      m_tile[rr] = fmaxf(m_tile[rr], __shfl_xor_sync(0xffffffffu, m_tile[rr], 1, 32));
      m_tile[rr] = fmaxf(m_tile[rr], __shfl_xor_sync(0xffffffffu, m_tile[rr], 2, 32));
      const float f = st[rr].merge(SoftmaxState{m_tile[rr], 0.0f}).self;
#pragma unroll
      for (int nt = 0; nt < S::ONT; ++nt) {
        o[nt][2 * rr] *= f;
        o[nt][2 * rr + 1] *= f;
      }
    }
    float l_tile[2] = {0.0f, 0.0f};  // this lane's share of the row sums; the lanes' shares add up at the end
#pragma unroll
    for (int j = 0; j < S::NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = i >> 1;
        s[j][i] = s[j][i] == KGEN_NEG_INF ? 0.0f : __expf(s[j][i] - st[rr].m);
        l_tile[rr] += s[j][i];
      }
    st[0].l += l_tile[0];
    st[1].l += l_tile[1];
    Math::pv(o, s, v_s, d0, dn, p_w, lane);
  }

#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    st[rr].l += __shfl_xor_sync(0xffffffffu, st[rr].l, 1, 32);
    st[rr].l += __shfl_xor_sync(0xffffffffu, st[rr].l, 2, 32);
  }
  const float inv[2] = {st[0].inv_sum(), st[1].inv_sum()};
#pragma unroll
  for (int nt = 0; nt < S::ONT; ++nt) {
    if (8 * nt >= dn) break;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = i >> 1, d = d0 + 8 * nt + 2 * t + (i & 1);
      if (!row_ok[rr]) continue;
      const float x = o[nt][i] * inv[rr];
      if (P > 0)
        part_o[(((long long)row_tok[rr] * Cfg::NUM_Q_HEADS + row_head[rr]) * max_partitions + part) * S::D + d] = x;
      else
        out[(long long)row_tok[rr] * o_s_tok + (long long)row_head[rr] * o_s_head + d] =
            from_float<typename Cfg::out_t>(x);
    }
  }
  if (slice == 0 && t == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      if (!row_ok[rr]) continue;
      const long long row = (long long)row_tok[rr] * Cfg::NUM_Q_HEADS + row_head[rr];
      if (P > 0) {
        part_ml[(row * max_partitions + part) * 2] = st[rr].m;
        part_ml[(row * max_partitions + part) * 2 + 1] = st[rr].l;
      } else if (lse != nullptr) {
        lse[row] = st[rr].lse();
      }
    }
  }
}

// Log-sum-exp merge of the KV partitions of one (query token, query head).
template <class Cfg>
__device__ __forceinline__ void paged_prefill_merge_body(typename Cfg::out_t* __restrict__ out,
                                                         const float* __restrict__ part_o,
                                                         const float* __restrict__ part_ml, float* __restrict__ lse,
                                                         const int* __restrict__ q_indptr,
                                                         const int* __restrict__ seq_lens, int num_seqs,
                                                         int max_partitions, long long o_s_tok, long long o_s_head) {
  constexpr int D = Cfg::HEAD_DIM, P = Cfg::PARTITION_SIZE;
  const int h = blockIdx.x, tok = blockIdx.y;
  int lo = 0, hi = num_seqs;  // the token's sequence: the last s with q_indptr[s] <= tok
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (q_indptr[mid] <= tok) lo = mid; else hi = mid;
  }
  const int num_parts = (seq_lens[lo] + P - 1) / P;
  const long long row = ((long long)tok * Cfg::NUM_Q_HEADS + h) * max_partitions;
  const float* ml = part_ml + row * 2;
  SoftmaxState tot = SoftmaxState::empty();
  for (int p = 0; p < num_parts; ++p) tot.merge(SoftmaxState{ml[2 * p], ml[2 * p + 1]});
  const float inv = tot.inv_sum();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < num_parts; ++p) {
      const float wp = ml[2 * p + 1] * SoftmaxState::rescale(ml[2 * p], tot.m);
      if (wp != 0.0f) acc += part_o[(row + p) * D + d] * wp;  // an empty partition's output is never read
    }
    out[(long long)tok * o_s_tok + (long long)h * o_s_head + d] = from_float<typename Cfg::out_t>(acc * inv);
  }
  if (threadIdx.x == 0 && lse != nullptr) lse[(long long)tok * Cfg::NUM_Q_HEADS + h] = tot.lse();
}

}  // namespace kgen
