// Paged decode on the tensor cores, for grouped query heads (docs/decode-family.md, "Tensor cores
// for grouped query heads"). The same kernel, launch grid and merge kernel as the CUDA-core body
// (paged_decode.cuh, whose merge body this one shares); only the block's work differs.
//
// Rows. The block's GROUP query heads (those of its KV head) are the 16 rows of mma.sync
// m16n8k16 (fp32 accumulate); rows at or past GROUP are zero queries whose results are dropped.
// The MMA operand type is q's (fp16 or bf16). Q's A fragments are built once, from global memory,
// and kept in registers for the whole kernel.
//
// Tokens. The block walks its tokens in tiles of TILE_TOKENS = 16 * WARPS, STAGES deep in flight
// (cp.async, K and V rows landing as stored, ROW_BYTES a row: padded to an odd number of 16-byte
// units, so the eight rows of an ldmatrix fall in different banks). Warp w takes tokens
// [16w, 16w + 16) of every tile: S = Q K^T is 16 heads x 16 tokens (two n8 tiles), P V one k16
// step. Each warp keeps its own online-softmax state (two rows a lane: heads g and g + 8) and its
// 16 x v_head_dim fp32 output; the warps' (o, m, l) are merged through shared memory at the end.
// K rows are head_dim wide (ROW_BYTES), V rows v_head_dim (V_ROW_BYTES).
//
// Fragments. A 16-bit cache (q's type) goes to the MMA as stored: K by ldmatrix, V by
// ldmatrix.trans. An 8-bit cache (fp8 e4m3/e5m2, int8) is converted in registers, each element
// once, with packed conversions (fp8x2 -> half2, int8 by the byte-permute magic number): its
// values are exact in fp16 and bf16, so the operands carry no rounding.
//   K: ldmatrix on 8-bit rows gives lane (g, t) bytes 4t..4t+3 of token g's 16-byte chunk, i.e.
//      head_dim elements 4t..4t+3 of the chunk; converted, (4t, 4t+1) is the B register of
//      reduction index k = 2t, 2t+1 and (4t+2, 4t+3) that of k = 2t+8, 2t+9. The reduction index
//      of Q K^T may be permuted as long as Q's A fragments use the same permutation, so Q's
//      columns are taken in that order (qk_column below).
//   V: ldmatrix.trans on 8-bit rows, each row read as eight 16-bit elements, gives lane (g, t) the
//      byte pairs (2g, 2g+1) of tokens 2t and 2t+1; one byte permute makes (token 2t, token 2t+1)
//      of column 2g and of column 2g+1: the B registers of two n8 output tiles, one holding the even
//      columns of the 16-byte chunk, the other the odd ones (the output columns are permuted, and
//      written back where they belong). This costs one ldmatrix per four MMAs and one permute and
//      one packed conversion per register; a converting pass into a 16-bit V tile followed by
//      ldmatrix.trans would convert as many elements but add a shared-memory store and reload
//      of every element and a barrier per tile, so the register route is the cheaper one.
//
// Scales (real = stored * scale), in fp32 outside the products, as prefill does: per tensor or head,
// K's folds into the softmax scale and V's multiplies the output; per token, logit column j times
// k_scale[j] before the soft-cap, bias and mask, and P[:, j] times v_scale[j] before P is rounded
// to q's type (fp16 q: times v_scale[j] / v_ref, v_ref the largest V scale of the block's keys, and
// the output times v_ref, so P stays within fp16's range). l sums the unscaled P.
//
// Needs kgen/platform.cuh, async_copy.cuh, convert.cuh, softmax.cuh and mma.cuh, and paged_decode.cuh
// (which includes the attention parts), before it; it includes the MMA tile part itself.
#pragma once

#include "kgen/attention/mma_tile.cuh"

namespace kgen {

template <class Cfg>
struct DecodeMmaShape {
  typedef typename Cfg::q_t T;   // MMA operand type
  typedef typename Cfg::kv_t KV;
  static constexpr int D = Cfg::HEAD_DIM, DV = Cfg::V_HEAD_DIM, G = Cfg::GROUP;  // q/K and V/out
  static constexpr int WARPS = Cfg::WARPS, THREADS = 32 * WARPS;
  static constexpr int NT = Cfg::TILE_TOKENS;  // tokens per tile, 16 a warp
  static constexpr int STAGES = Cfg::STAGES;
  typedef KvFormat<Cfg> F;  // the cache's format (attention/kv_format.cuh)
  static constexpr int ES = F::ES, PER = F::PER;
  static constexpr ScaleMode SCALES = F::SCALES;
  static constexpr bool FP4 = F::FP4;  // nvfp4: converted in registers, with block scales
  static constexpr bool BYTES8 = ES == 1 && !FP4;  // an 8-bit cache: converted in registers
  static constexpr int GROUPS = F::GROUPS;     // nvfp4 block scales per row
  // nvfp4 with fp16 operands: they are e2m1 x e4m3 x 2^-7 (fp4_half_pairs), the 2^7 restored outside
  static constexpr bool FP4_HALF = FP4 && IsSame<T, __half>::value;
  static constexpr float FP4_UNIT = FP4_HALF ? 128.0f : 1.0f;
  static constexpr int ROW = Cfg::ROW_BYTES;   // bytes per shared-memory K row
  static constexpr int VROW = Cfg::V_ROW_BYTES;  // bytes per shared-memory V row
  static constexpr int KC = D / 16;            // k16 chunks of Q K^T
  static constexpr int ONT = DV / 8;           // n8 tiles of the output
  static constexpr int LANE_ROWS = G <= 8 ? 1 : 2;   // rows a lane holds: g, and g + 8 when the group passes 8
  static constexpr bool UPPER = LANE_ROWS == 2;       // rows g + 8 kept (attention/mma_tile.cuh)
  static constexpr bool TOKEN_SCALES = F::TOKEN_SCALES;
  static constexpr bool V_REF = TOKEN_SCALES && IsSame<T, __half>::value;
  static constexpr int K_BYTES = NT * ROW;     // one K tile
  static constexpr int V_BYTES = NT * VROW;    // one V tile, after it
  static constexpr int STAGE_BYTES = K_BYTES + V_BYTES + F::scale_bytes(NT);
  static constexpr int MERGE_BYTES = G * DV * 4 + WARPS * G * 8;  // o [G][DV], then (m, l) [warp][G]
  static constexpr int RED_BYTES = V_REF ? 128 : 0;
  static constexpr int BODY_BYTES = STAGES * STAGE_BYTES > MERGE_BYTES ? STAGES * STAGE_BYTES : MERGE_BYTES;
  static constexpr int SMEM_BYTES = BODY_BYTES + RED_BYTES;
  static_assert(SMEM_BYTES == Cfg::SMEM_BYTES, "shared memory: kgen's geometry and the template disagree");
  static_assert(NT == 16 * WARPS && THREADS == Cfg::NUM_THREADS && WARPS <= 32, "warps");
  static_assert(D % 16 == 0 && DV % 16 == 0 && G <= 16 && ES <= 2 && sizeof(T) == 2, "tensor-core decode combo");
  static_assert(ROW % 16 == 0 && ROW >= F::bytes(D) && VROW % 16 == 0 && VROW >= F::bytes(DV) &&
                (!FP4 || (D % 32 == 0 && DV == D)), "rows");
  static_assert(STAGES >= 1 && STAGES <= 4, "stages");
};

// Head_dim element of reduction index k (0..15) of a k16 chunk of Q K^T: as is for a 16-bit cache;
// for an 8-bit one, the order in which ldmatrix and the packed conversions deliver K (above).
template <bool BYTES8>
__device__ __forceinline__ int qk_column(int k) {
  if (!BYTES8) return k;
  return k < 8 ? 4 * (k / 2) + k % 2 : 4 * ((k - 8) / 2) + 2 + k % 2;
}

// nvfp4: one ldmatrix gives lane (g, t) bytes 4t .. 4t + 3 of a token's 16-byte span, elements
// 8t .. 8t + 7 of 32; chunk 2c2 of the span takes the first four of them (k = 2t, 2t + 1, 2t + 8,
// 2t + 9), chunk 2c2 + 1 the last four. Head_dim column of reduction index k of chunk c:
__device__ __forceinline__ int fp4_qk_column(int c, int k) {
  return 32 * (c / 2) + 8 * ((k % 8) / 2) + 4 * (c % 2) + 2 * (k / 8) + k % 2;
}

// Issue the cp.async copies of one tile (tokens [tbase, tbase + NT)) into `stage`: K rows, V rows
// (ROW bytes apart), then the per-token scales (K's NT, V's NT). Tokens outside
// [tok_begin, tok_end) are not read: their bytes are zero-filled.
template <class Cfg>
__device__ __forceinline__ void decode_mma_issue_tile(
    unsigned char* __restrict__ stage, int tbase, int tok_begin, int tok_end, int kv_head,
    const int* __restrict__ table, const typename Cfg::kv_t* __restrict__ k_cache,
    const typename Cfg::kv_t* __restrict__ v_cache, typename Cfg::scale_arg_t k_scale,
    typename Cfg::scale_arg_t v_scale, long long k_s_block, long long k_s_head, long long k_s_token,
    long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token, long long ks_s_block,
    long long ks_s_head, long long ks_s_token, long long vs_s_block, long long vs_s_head, long long vs_s_token) {
  typedef DecodeMmaShape<Cfg> S;
  typedef typename Cfg::kv_t KV;
  constexpr int B = Cfg::BLOCK_SIZE, NT = S::NT, T = S::THREADS;
  constexpr int CHUNK = 16 / S::ES * S::PER;  // elements per 16-byte copy
  constexpr int PER_ROW = S::D / CHUNK, V_PER_ROW = S::DV / CHUNK;
  constexpr int COPIES = NT * PER_ROW, V_COPIES = NT * V_PER_ROW;
  constexpr bool V_WITH_K = S::DV == S::D;  // V's copies ride along K's (else a loop of their own)
  const unsigned tid = threadIdx.x;
#pragma unroll 2  // (fully unrolled, ptxas keeps every copy's address live: 24 registers more at D 128)
  for (int k = 0; k < (COPIES + T - 1) / T; ++k) {
    const unsigned c = tid + k * T;
    if (COPIES % T == 0 || c < COPIES) {
      const int t = c / PER_ROW, d0 = (c % PER_ROW) * CHUNK, pos = tbase + t;
      const bool valid = pos >= tok_begin && pos < tok_end;
      const KV* ksrc = k_cache;
      const KV* vsrc = v_cache;
      if (valid) {
        const long long phys = table[(unsigned)pos / B];
        const int slot = (unsigned)pos % B;
        ksrc = k_cache + phys * k_s_block + kv_head * k_s_head + slot * k_s_token +
               run_offset<Cfg::K_RUN>(d0, k_s_run) / S::PER;
        vsrc = v_cache + phys * v_s_block + kv_head * v_s_head + slot * v_s_token + d0 / S::PER;
      }
      cp_async<16>(stage + t * S::ROW + d0 / S::PER * S::ES, ksrc, valid ? 16 : 0);
      if (V_WITH_K) cp_async<16>(stage + S::K_BYTES + t * S::VROW + d0 / S::PER * S::ES, vsrc, valid ? 16 : 0);
    }
  }
  if (!V_WITH_K) {
#pragma unroll 2
    for (int k = 0; k < (V_COPIES + T - 1) / T; ++k) {
      const unsigned c = tid + k * T;
      if (V_COPIES % T == 0 || c < V_COPIES) {
        const int t = c / V_PER_ROW, d0 = (c % V_PER_ROW) * CHUNK, pos = tbase + t;
        const bool valid = pos >= tok_begin && pos < tok_end;
        const KV* vsrc = v_cache;
        if (valid) vsrc = v_cache + table[(unsigned)pos / B] * v_s_block + kv_head * v_s_head + ((unsigned)pos % B) * v_s_token + d0 / S::PER;
        cp_async<16>(stage + S::K_BYTES + t * S::VROW + d0 / S::PER * S::ES, vsrc, valid ? 16 : 0);
      }
    }
  }
  // the per-token scales or nvfp4 block-scale rows after the rows (attention/kv_format.cuh)
  S::F::template issue_scales<NT, T, false>(
      stage + S::K_BYTES + S::V_BYTES, k_scale, v_scale, ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head,
      vs_s_token, kv_head, [&](int t) { return tbase + t >= tok_begin && tbase + t < tok_end; },
      [&](int t, long long& phys, int& slot) {
        phys = table[(unsigned)(tbase + t) / B];
        slot = (unsigned)(tbase + t) % B;
      });
}

// s[j] += Q . K[tokens 8j .. 8j + 7]^T over head_dim, for the warp's 16 tokens of a tile (k_w: the
// first one's row).
template <class Cfg>
__device__ __forceinline__ void decode_mma_qk(float (&s)[1][2][4], const unsigned (&qf)[DecodeMmaShape<Cfg>::KC][1][4],
                                              const unsigned char* k_w, const unsigned char* ks_w, int lane) {
  typedef DecodeMmaShape<Cfg> S;
  typedef typename S::T T;
  if constexpr (S::FP4) {  // a 16-byte span (32 elements, two k16 chunks) of tokens g and g + 8 a time
    const int g = lane >> 2, t = lane & 3;
    // The lane's scales: elements 8t .. 8t + 7 lie in group 2 c2 + t / 2 of token g (and g + 8). A
    // pointer to them, so that ptxas folds each load's constant into its address; written as one
    // index a load, it kept those sums in registers across the loop (docs/decode-family.md).
    const unsigned char* ks_l = ks_w + g * S::GROUPS + (t >> 1);
#pragma unroll
    for (int c2 = 0; c2 < S::KC / 2; ++c2) {
      unsigned r[2];
      ldmatrix<2, false>(r, k_w + (lane % 16) * S::ROW + c2 * 16);
      const unsigned char s0 = ks_l[2 * c2], s1 = ks_l[8 * S::GROUPS + 2 * c2];
      __half2 f0, f1;  // fp16 operands: the two tokens' factors, each in both halves
      if constexpr (S::FP4_HALF) {
        const __half2 f = fp4_half_factors(s0, s1);
        f0 = __low2half2(f), f1 = __high2half2(f);
      }
      unsigned e0[4], e1[4];
      fp4_word_pairs<T>(r[0], s0, f0, e0);
      fp4_word_pairs<T>(r[1], s1, f1, e1);
      const unsigned a0[2] = {e0[0], e0[1]}, a1[2] = {e1[0], e1[1]}, b0[2] = {e0[2], e0[3]}, b1[2] = {e1[2], e1[3]};
      mma_tile<T, S::UPPER>(s[0][0], qf[2 * c2][0], a0);
      mma_tile<T, S::UPPER>(s[0][1], qf[2 * c2][0], a1);
      mma_tile<T, S::UPPER>(s[0][0], qf[2 * c2 + 1][0], b0);
      mma_tile<T, S::UPPER>(s[0][1], qf[2 * c2 + 1][0], b1);
    }
    return;
  }
  if constexpr (!S::BYTES8) {  // 16-bit K as stored (attention/mma_tile.cuh)
    qk_tile<T, S::UPPER, 1, 2, S::KC, S::ROW / 2>(
        s,
        [&](int c, unsigned (&a)[1][4]) {  // Q's, kept in registers
#pragma unroll
          for (int i = 0; i < 4; ++i) a[0][i] = qf[c][0][i];
        },
        k_lane_row<S::ROW / 2>(reinterpret_cast<const T*>(k_w), lane));
  } else {
    typedef KvPair<typename Cfg::kv_t, T> P;
#pragma unroll
    for (int c = 0; c < S::KC; ++c) {
      unsigned r[2];  // tokens 0-7 and 8-15 of the chunk: lane (g, t) gets bytes 4t .. 4t + 3 of token g
      ldmatrix<2, false>(r, k_w + (lane % 16) * S::ROW + c * 16);
      const unsigned b0[2] = {P::two((unsigned short)(r[0] & 0xFFFFu)), P::two((unsigned short)(r[0] >> 16))};
      const unsigned b1[2] = {P::two((unsigned short)(r[1] & 0xFFFFu)), P::two((unsigned short)(r[1] >> 16))};
      mma_tile<T, S::UPPER>(s[0][0], qf[c][0], b0);
      mma_tile<T, S::UPPER>(s[0][1], qf[c][0], b1);
    }
  }
}

// Output column of accumulator o[nt][i] (i & 1: the second of the lane's two columns).
template <bool BYTES8, bool FP4 = false>
__device__ __forceinline__ int pv_column(int nt, int i, int t) {
  const int n = 2 * t + (i & 1);
  // nvfp4 V: n8 tiles come in eights per 64 columns: half h (32 columns) and nibble j of each
  // byte pair, tile column n at 4n + j.
  if (FP4) return 64 * (nt / 8) + 32 * ((nt % 8) / 4) + 4 * n + nt % 4;
  if (!BYTES8) return 8 * nt + n;
  // 8-bit V: n8 tiles come in fours per 32 columns: even and odd columns of the first 16, then
  // of the next 16.
  const int k = nt % 4;
  return 32 * (nt / 4) + 16 * (k / 2) + 2 * n + k % 2;
}

// o += P[16 heads x the warp's 16 tokens] V[those tokens, v_head_dim] (v_w: the first token's row).
template <class Cfg>
__device__ __forceinline__ void decode_mma_pv(float (&acc)[1][DecodeMmaShape<Cfg>::ONT][4], const unsigned (&pa)[1][4],
                                              const unsigned char* v_w, const unsigned char* vs_w, int lane) {
  typedef DecodeMmaShape<Cfg> S;
  typedef typename S::T T;
  float(&o)[S::ONT][4] = acc[0];
  const unsigned(&a)[4] = pa[0];
  if constexpr (S::FP4) {
    // ldmatrix.trans of 16-bit elements: lane (g, t) gets bytes 2g, 2g + 1 (columns 4g .. 4g + 3 of
    // the 32-column span) of tokens 2t and 2t + 1 (matrix 0; 2t + 8, 2t + 9: matrix 1); nibble j of
    // them is column 4g + j, the n8 tile j of the span (pv_column). The group of 4g .. 4g + 3 is one.
    const int g = lane >> 2, t = lane & 3;
    const unsigned char* v_row = v_w + (lane % 8 + ((lane / 8) % 2) * 8) * S::VROW + 16 * (lane / 16);
    // The lane's scales: group 4q + 2h + g / 4 of tokens 2t, 2t + 1, 2t + 8 and 2t + 9, through one
    // pointer as K's (decode_mma_qk's ks_l)
    const unsigned char* vs_l = vs_w + 2 * t * S::GROUPS + (g >> 2);
#pragma unroll
    for (int q = 0; q < (S::DV + 63) / 64; ++q) {
      const int halves = S::DV % 64 != 0 && q == S::DV / 64 ? 1 : 2;  // a last span of 32 columns: two matrices
      unsigned r[4];
      if (halves == 2) {
        ldmatrix<4, true>(r, v_row + 32 * q);
      } else {
        unsigned r2[2];
        ldmatrix<2, true>(r2, v_row + 32 * q);
        r[0] = r2[0], r[1] = r2[1], r[2] = r[3] = 0u;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h < halves) {
          const int grp = 4 * q + 2 * h;
          const unsigned char sa = vs_l[grp], sb = vs_l[S::GROUPS + grp];
          const unsigned char sc = vs_l[8 * S::GROUPS + grp], sd = vs_l[9 * S::GROUPS + grp];
          float fa = 0.0f, fb = 0.0f, fc = 0.0f, fd = 0.0f;
          __half2 hab, hcd;
          if constexpr (S::FP4_HALF) {
            hab = fp4_half_factors(sa, sb);
            hcd = fp4_half_factors(sc, sd);
          } else {
            fa = fp4_group_factor(sa), fb = fp4_group_factor(sb), fc = fp4_group_factor(sc), fd = fp4_group_factor(sd);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const unsigned b[2] = {fp4_column_pair<T>(r[2 * h], j, hab, fa, fb),
                                   fp4_column_pair<T>(r[2 * h + 1], j, hcd, fc, fd)};
            mma_tile<T, S::UPPER>(o[8 * q + 4 * h + j], a, b);
          }
        }
      }
    }
  } else if constexpr (!S::BYTES8) {  // 16-bit V as stored (attention/mma_tile.cuh)
    pv_tile<T, S::UPPER, 1, S::ONT, 1, S::VROW / 2>(
        acc,
        [&](int, unsigned (&b)[1][4]) {  // P's: one k16 step, the warp's 16 tokens
#pragma unroll
          for (int i = 0; i < 4; ++i) b[0][i] = a[i];
        },
        v_lane_row<S::VROW / 2>(reinterpret_cast<const T*>(v_w), lane), lane, S::DV);
  } else {
    typedef KvPair<typename Cfg::kv_t, T> P;
    // matrices: tokens 0-7 and 8-15 of bytes [32q, 32q + 16), then of [32q + 16, 32q + 32)
    const unsigned char* v_row = v_w + (lane % 8 + ((lane / 8) % 2) * 8) * S::VROW + 16 * (lane / 16);
#pragma unroll
    for (int q = 0; q < (S::DV + 31) / 32; ++q) {
      constexpr int LAST = S::DV % 32 == 0 ? 4 : 2;  // a last group of 16 columns takes two matrices
      if (LAST == 2 && q == S::DV / 32) {
        unsigned r[2];
        ldmatrix<2, true>(r, v_row + 32 * q);
        // bytes (tok 2t col 2g, tok 2t col 2g+1, tok 2t+1 col 2g, tok 2t+1 col 2g+1) -> even | odd pairs
        const unsigned e0 = __byte_perm(r[0], 0, 0x3120u), e1 = __byte_perm(r[1], 0, 0x3120u);
        const unsigned be[2] = {P::two((unsigned short)(e0 & 0xFFFFu)), P::two((unsigned short)(e1 & 0xFFFFu))};
        const unsigned bo[2] = {P::two((unsigned short)(e0 >> 16)), P::two((unsigned short)(e1 >> 16))};
        mma_tile<T, S::UPPER>(o[4 * q], a, be);
        mma_tile<T, S::UPPER>(o[4 * q + 1], a, bo);
      } else {
        unsigned r[4];
        ldmatrix<4, true>(r, v_row + 32 * q);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // columns [32q + 16h, 32q + 16h + 16)
          const unsigned e0 = __byte_perm(r[2 * h], 0, 0x3120u), e1 = __byte_perm(r[2 * h + 1], 0, 0x3120u);
          const unsigned be[2] = {P::two((unsigned short)(e0 & 0xFFFFu)), P::two((unsigned short)(e1 & 0xFFFFu))};
          const unsigned bo[2] = {P::two((unsigned short)(e0 >> 16)), P::two((unsigned short)(e1 >> 16))};
          mma_tile<T, S::UPPER>(o[4 * q + 2 * h], a, be);
          mma_tile<T, S::UPPER>(o[4 * q + 2 * h + 1], a, bo);
        }
      }
    }
  }
}

// Q's A fragments (rows g and g + 8: query heads, zeros past the group; reduction index k of chunk
// c at head_dim column 16c + qk_column(k)), built once from global memory, and the rows' ALiBi slopes.
template <class Cfg>
__device__ __forceinline__ void decode_mma_q_fragments(unsigned (&qf)[DecodeMmaShape<Cfg>::KC][1][4], float (&slope)[2],
                                                       const typename Cfg::q_t* q_seq, long long q_s_head,
                                                       const float* alibi_slopes, int q_head0, int lane) {
  typedef DecodeMmaShape<Cfg> S;
  typedef typename S::T T;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int head = g + 8 * rr;
    const bool real = (S::UPPER || rr == 0) && head < S::G;
    const typename Cfg::q_t* qh = q_seq + (long long)(q_head0 + (real ? head : 0)) * q_s_head;
#pragma unroll
    for (int c = 0; c < S::KC; ++c)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int k = 2 * t + 8 * hi;
        const int d0 = S::FP4 ? fp4_qk_column(c, k) : 16 * c + qk_column<S::BYTES8>(k);
        const int d1 = S::FP4 ? fp4_qk_column(c, k + 1) : 16 * c + qk_column<S::BYTES8>(k + 1);
        qf[c][0][rr + 2 * hi] = !S::UPPER && rr == 1 ? 0u  // padding rows: constant zeros
                                                     : pack2<T>(real ? to_float(qh[d0]) : 0.0f, real ? to_float(qh[d1]) : 0.0f);
      }
    slope[rr] = Cfg::ALIBI && real ? alibi_slopes[q_head0 + head] : 0.0f;
  }
}

// Merge the warps' (o, m, l) through shared memory (free once every copy has landed and every thread
// is past the loop: (m, l) [warp][head], then o [head][d] accumulated warp by warp) and write out
// the final output, or this partition's normalised partial and its (m, l).
template <class Cfg>
__device__ __forceinline__ void decode_mma_merge_warps(unsigned char* smem, const float (&o)[DecodeMmaShape<Cfg>::ONT][4],
                                                       SoftmaxState (&st)[2], const Epilogue<Cfg>& ep, float v_out,
                                                       int seq, int q_head0) {
  typedef DecodeMmaShape<Cfg> S;
  constexpr int DV = S::DV, G = S::G, WARPS = S::WARPS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rr = 0; rr < S::LANE_ROWS; ++rr) {
    st[rr].l = quad_sum(st[rr].l);
  }
  cp_async_wait_all();
  __syncthreads();
  float* o_s = reinterpret_cast<float*>(smem);
  float* ml_s = o_s + G * DV;
  if (t == 0) {
#pragma unroll
    for (int rr = 0; rr < S::LANE_ROWS; ++rr) {
      const int head = g + 8 * rr;
      if (head < G) ml_s[(warp * G + head) * 2] = st[rr].m, ml_s[(warp * G + head) * 2 + 1] = st[rr].l;
    }
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int rr = 0; rr < S::LANE_ROWS; ++rr) {
    const int head = g + 8 * rr < G ? g + 8 * rr : 0;
    float m = KGEN_NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, ml_s[(w * G + head) * 2]);
    f[rr] = SoftmaxState::rescale(st[rr].m, m);  // this warp's share of the block's state
  }
#pragma unroll 1
  for (int w = 0; w < WARPS; ++w) {
    if (warp == w) {
#pragma unroll
      for (int nt = 0; nt < S::ONT; ++nt)
#pragma unroll
        for (int i = 0; i < 2 * S::LANE_ROWS; ++i) {
          const int head = g + 8 * (i >> 1), d = pv_column<S::BYTES8, S::FP4>(nt, i, t);
          if (head < G) {
            float* dst = o_s + head * DV + d;
            *dst = (w == 0 ? 0.0f : *dst) + o[nt][i] * f[i >> 1];
          }
        }
    }
    __syncthreads();
  }
  for (int i = tid; i < G * DV; i += S::THREADS) {
    const int head = i / DV, d = i % DV;
    SoftmaxState blk = SoftmaxState::empty();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) blk.merge(SoftmaxState{ml_s[(w * G + head) * 2], ml_s[(w * G + head) * 2 + 1]});
    ep.finish(blk, seq, q_head0 + head, d, o_s[i], v_out);  // (single pass: the sink once, at the end)
  }
}

// One tile's softmax update of the warp's S (s[j][i]: head g + 8 (i >> 1), token 8j + 2t + (i & 1)
// of the warp's 16, from pos_w on): the logits (FOLD: raw products, the scale in exp2's FFMA),
// the mask, the rows' state raised and O rescaled, and the weights as P's A fragment (times V's
// per-token scales).
template <class Cfg, bool FOLD>
__device__ __forceinline__ void decode_mma_weights(unsigned (&pa)[1][4], float (&s)[2][4], SoftmaxState (&st)[2],
                                                   float (&o)[DecodeMmaShape<Cfg>::ONT][4], const TileSoftmax& softmax,
                                                   const float* ss, int pos_w, const KeyRange& keys, float qk_scale,
                                                   float v_inv_ref, const float (&slope)[2], int seq_len, int lane) {
  typedef DecodeMmaShape<Cfg> S;
  typedef typename S::T T;
  constexpr int NT = S::NT;
  const int t = lane & 3;
  float m_tile[2] = {KGEN_NEG_INF, KGEN_NEG_INF};
  const int lane_pos = pos_w + 2 * t;  // the position of this lane's first column (2t)
  const KeyRange seen{keys.begin - lane_pos, keys.end - lane_pos};  // its column 2t + c is seen: c in seen
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < 2 * S::LANE_ROWS; ++i) {
      const int rr = i >> 1, col = 8 * j + 2 * t + (i & 1), pos = pos_w + col;
      const float y = FOLD ? (S::TOKEN_SCALES ? s[j][i] * ss[col] : s[j][i])
                           : Logits<Cfg>::of(s[j][i], S::TOKEN_SCALES ? qk_scale * ss[col] : qk_scale, slope[rr],
                                             pos, seq_len - 1);
      s[j][i] = seen.contains(8 * j + (i & 1)) ? y : KGEN_NEG_INF;
      m_tile[rr] = fmaxf(m_tile[rr], s[j][i]);
    }
  float mb[2] = {0.0f, 0.0f};
#pragma unroll
  for (int rr = 0; rr < S::LANE_ROWS; ++rr)  // the four lanes of a group hold the row's tokens
    scale_row(o, rr, softmax.raise(st[rr], quad_max(m_tile[rr]), mb[rr]));
  // Each weight added to the row's sum as it is made (no per-tile sums; docs/decode-family.md,
  // "Registers of the softmax update").
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < 2 * S::LANE_ROWS; ++i) {
      const int rr = i >> 1;
      s[j][i] = softmax.weight(s[j][i], mb[rr]);  // exp(logit - m); a masked -inf gives 0
      st[rr].l += s[j][i];  // this lane's share; the four lanes' shares add up at the end
      if (S::TOKEN_SCALES) s[j][i] *= ss[NT + 8 * j + 2 * t + (i & 1)] * v_inv_ref;  // P V sees P times V's scales
    }
  a_from_c<T>(pa[0], s[0], s[1]);  // (rows past LANE_ROWS: the zeros S started with; attention/mma_tile.cuh)
}

template <class Cfg, class Params>
__device__ __forceinline__ void paged_decode_mma_body(const Params& p) {
  // The parameters (Params: generated from the kernel's argument table): the output side is the
  // epilogue's (attention/epilogue.cuh), the K/V pool's (attention/kv_pool.cuh), q bound here; ABI 1's
  // positional signature is templates/abi1/'s, which fills a Params and calls this.
  const auto* __restrict__ q = p.q;
  const long long q_s_seq = p.q_s_seq, q_s_head = p.q_s_head;
  const KvPool<Cfg> pool = KvPool<Cfg>::of(p);  // the K/V pool (attention/kv_pool.cuh)
  typedef DecodeMmaShape<Cfg> S;
  typedef typename S::T T;
  constexpr int DV = S::DV, G = S::G, NT = S::NT, STAGES = S::STAGES, WARPS = S::WARPS;
  const Epilogue<Cfg> ep = Epilogue<Cfg>::of(p, p.o_s_seq, blockIdx.z);  // the output side, partition blockIdx.z
  const int kv_head = blockIdx.x, seq = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int q_head0 = kv_head * G;

  const int seq_len = p.seq_lens[seq];
  int tok_begin, tok_end;  // attention/visibility.cuh
  if (!decode_key_range<Cfg>(seq_len, ep.part, p.partition_tokens, p.max_partitions, ep.split, tok_begin, tok_end))
    return;
  const KeyRange keys{tok_begin, tok_end};
  const int tile0 = tok_begin / NT * NT;
  const int ntiles = tok_end > tok_begin ? (tok_end - tile0 + NT - 1) / NT : 0;

  __shared__ __align__(16) unsigned char smem[S::SMEM_BYTES];
  const int* table = p.block_tables + (long long)seq * p.max_blocks_per_seq;
  auto issue = [&](int tile) {
    decode_mma_issue_tile<Cfg>(smem + (tile % STAGES) * S::STAGE_BYTES, tile0 + tile * NT, tok_begin, tok_end,
                               kv_head, table, pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale,
                               pool.k_s_block, pool.k_s_head, pool.k_s_token, pool.k_s_run, pool.v_s_block,
                               pool.v_s_head, pool.v_s_token, pool.ks_s_block, pool.ks_s_head, pool.ks_s_token,
                               pool.vs_s_block, pool.vs_s_head, pool.vs_s_token);
  };
  StageRing<STAGES>::start(ntiles, issue);  // attention/stage_ring.cuh

  unsigned qf[S::KC][1][4];  // Q's A fragments, for the whole kernel
  float slope[2];
  decode_mma_q_fragments<Cfg>(qf, slope, q + seq * q_s_seq, q_s_head, p.alibi_slopes, q_head0, lane);

  // Scales outside the products (attention/kv_format.cuh): per tensor or head, K's folds into the
  // softmax scale and V's multiplies the output; nvfp4's block scales are in the operands (fp16
  // ones carry 2^-7 more).
  const typename S::F::Scales kv_sc = S::F::tensor_scales(pool.k_scale, pool.v_scale, kv_head, S::FP4_UNIT);
  float qk_scale = Cfg::SOFTMAX_SCALE * kv_sc.k, v_out = kv_sc.v, v_inv_ref = 1.0f;
  if constexpr (S::V_REF)  // fp16 P: V's per-token scales relative to their largest over the block's keys
    S::F::template v_reference<S::THREADS>(pool.v_scale, table, tok_begin, tok_end, kv_head, pool.vs_s_block,
                                           pool.vs_s_head, pool.vs_s_token,
                                           reinterpret_cast<float*>(smem + S::BODY_BYTES), v_out, v_inv_ref);

  SoftmaxState st[2] = {SoftmaxState::empty(), SoftmaxState::empty()};
  // FOLD: the logit is the product (times its per-token K scale) times a positive compile-time
  // scale (attention/logits.cuh's LINEAR, no runtime K scale whose sign could flip the order): the
  // products stay raw, a row's max is scaled once and exp2 takes the scale in its FFMA
  // (attention/softmax_tile.cuh).
  constexpr bool FOLD = Logits<Cfg>::LINEAR && Cfg::SOFTMAX_SCALE > 0.0f &&
                        (S::SCALES == ScaleMode::none || S::SCALES == ScaleMode::per_token_head);
  const TileSoftmax softmax = TileSoftmax::of(FOLD ? Cfg::SOFTMAX_SCALE : 1.0f);
  float acc[1][S::ONT][4];  // the output: one m16 tile of rows (attention/mma_tile.cuh)
  float(&o)[S::ONT][4] = acc[0];
#pragma unroll
  for (int nt = 0; nt < S::ONT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[nt][i] = 0.0f;

  // The loop bound is uniform across the block, so every thread reaches every barrier.
  for (int tile = 0; tile < ntiles; ++tile) {
    StageRing<STAGES>::next(tile, ntiles, issue);
    const int pos_w = tile0 + tile * NT + 16 * warp;  // the warp's first token
    if (!keys.meets(pos_w, 16)) continue;  // warp-uniform: none of its tokens is seen
    const unsigned char* stage = smem + (tile % STAGES) * S::STAGE_BYTES;
    const unsigned char* k_w = stage + 16 * warp * S::ROW;
    const unsigned char* v_w = stage + S::K_BYTES + 16 * warp * S::VROW;
    const float* ss = reinterpret_cast<const float*>(stage + S::K_BYTES + S::V_BYTES) + 16 * warp;
    const unsigned char* ks_w = stage + S::K_BYTES + S::V_BYTES + 16 * warp * S::GROUPS;  // nvfp4 block scales
    const unsigned char* vs_w = ks_w + NT * S::GROUPS;

    float sc[1][2][4];  // S: one m16 tile of rows, two n8 tiles of tokens
    float(&s)[2][4] = sc[0];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
    decode_mma_qk<Cfg>(sc, qf, k_w, ks_w, lane);

    unsigned pa[1][4];  // P's A fragment
    decode_mma_weights<Cfg, FOLD>(pa, s, st, o, softmax, ss, pos_w, keys, qk_scale, v_inv_ref, slope, seq_len, lane);
    decode_mma_pv<Cfg>(acc, pa, v_w, vs_w, lane);
  }

  decode_mma_merge_warps<Cfg>(smem, o, st, ep, v_out, seq, q_head0);
}

}  // namespace kgen
