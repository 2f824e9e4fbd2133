// The CUDA-core (SIMT) attention math of a row group: LANES lanes that split head_dim (VEC elements
// a lane, CPL chunks) for q . K, and v_head_dim (VCPL chunks) for P V and the output, serving HPT
// query heads over batches of SUB tokens. The dense decode body (paged_decode.cuh) owns the tiles,
// the copies and the row groups' geometry; this part owns what a thread computes on a staged tile:
//
//   token_group_sum<LANES>      a value summed over the row group (xor butterfly)
//   RowGroupSums<LANES, N>      N values summed over the row group by a transpose reduce
//   SimtHeads<Cfg, S>           a thread's heads: queries, ALiBi slopes, online-softmax states and
//                               output accumulators in registers
//     ::start(...)              the heads' queries loaded, states empty, outputs zero
//     ::dots(...)               Q . K: a batch's partial dot products (this lane's chunks)
//     ::softmax(...)            the batch's online-softmax update (TileSoftmax, attention/
//                               softmax_tile.cuh): the dot products become V weights
//     ::accumulate(...)         P V: o += weights x V rows (or V's [head_dim][token] tile)
//     ::finish(l_part)          each head's l after the last batch
//     ::store(...)              the heads' (o, m, l) into a token slot's scratch
//   merge_slots<S>(...)         the token slots' scratch merged and written through the epilogue
//
// S is the body's shape (DecodeShape: D, DV, G, VEC, CHUNKS, V_CHUNKS, LANES, CPL, VCPL, QK, OUT,
// HPT, SUB, NT, SLOTS, THREADS, V_BY_TOKEN, V_ROW, GROUPS).
//
// Provided by kgen to both compilers as "kgen/attention/simt_tile.cuh" (kgen/compile/provided.py);
// needs kgen/platform.cuh, convert.cuh, softmax.cuh, attention/softmax_tile.cuh and
// attention/kv_format.cuh before it.
#pragma once

namespace kgen {

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

template <class Cfg, class S>
struct SimtHeads {
  typedef typename Cfg::kv_t kv_t;
  static constexpr int D = S::D, DV = S::DV, VEC = S::VEC, LANES = S::LANES, CPL = S::CPL, OUT = S::OUT;
  static constexpr int HPT = S::HPT, SUB = S::SUB, NT = S::NT;
  // Where a batch's logits are a power of two (DIST), the transpose reduce (RowGroupSums) leaves
  // each lane HELD logits of one head, hl: tokens [jb, jb + HELD) of each batch; it computes the
  // softmax of those only, HEAD_LANES lanes sharing a head's. l_part (the caller's, zero at the
  // start: a local of the body keeps the loop's SASS as it was): this lane's share of head hl's sum
  // of weights (its tokens), summed over those lanes after the loop.
  static constexpr bool DIST = ((HPT * SUB) & (HPT * SUB - 1)) == 0 && HPT <= LANES;
  typedef RowGroupSums<LANES, (DIST ? HPT * SUB : 1)> Sums;
  static constexpr int HEAD_LANES = SUB / Sums::HELD * Sums::SPREAD;

  int lane;    // lane within the row group
  int hl, jb;  // DIST: the head and the first token of the batch's logits this lane holds
  float qr[HPT][S::QK];  // head h's query: dims (c * LANES + lane) * VEC + i at c * VEC + i
  float slope[HPT];
  SoftmaxState st[HPT];
  float o[HPT][OUT];

  // Head h is group member g = min(hset * HPT + h, G - 1) (a head past the group repeats the last
  // one; its results are dropped): query(g) points at its query, slope_of(g) is its ALiBi slope.
  template <class Query, class Slope>
  __device__ __forceinline__ void start(int lane_in_group, int hset, Query query, Slope slope_of) {
    lane = lane_in_group;
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
      const int g = min(hset * HPT + h, S::G - 1);
      const typename Cfg::q_t* qh = query(g);
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int chunk = c * LANES + lane;
#pragma unroll
        for (int i = 0; i < VEC; ++i) qr[h][c * VEC + i] = chunk < S::CHUNKS ? to_float(qh[chunk * VEC + i]) : 0.0f;
      }
      slope[h] = slope_of(g);
      st[h] = SoftmaxState::empty();
#pragma unroll
      for (int i = 0; i < OUT; ++i) o[h][i] = 0.0f;
    }
    const int xb = lane / Sums::SPREAD * Sums::HELD;
    hl = xb / SUB, jb = xb % SUB;
  }

  // Q . K: s[h][j], head h's query times the K row of the stage's token t1 + j over this lane's
  // chunks (ks: the stage's K rows, fs: its nvfp4 block scales).
  __device__ __forceinline__ void dots(const kv_t* ks, const unsigned char* fs, int t1, float (&s)[HPT][SUB]) const {
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
  }

  // The batch's online softmax, one rescale of o per batch: s, the partial dot products, becomes
  // each token's V weight. logit(dot, j, slope): token j's logit (-inf when masked); v_weight(p, j):
  // its weight p times its V scale; l_part: see DIST.
  template <class Logit, class VWeight>
  __device__ __forceinline__ void softmax(const TileSoftmax& sm, float (&s)[HPT][SUB], Logit logit, VWeight v_weight,
                                             float& l_part) {
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
        const float f = sm.raise(st[h], m_tile, mb_h);
#pragma unroll
        for (int i = 0; i < OUT; ++i) o[h][i] *= f;
        if (HPT == 1 || h == hl) f_l = f, mb = mb_h;
      }
      l_part *= f_l;
#pragma unroll
      for (int i = 0; i < Sums::HELD; ++i) {
        const float p = sm.weight(w[i], mb);
        l_part += p;
        w[i] = v_weight(p, jb + i);
      }
      Sums::gather(w, s);
    } else {
#pragma unroll
      for (int h = 0; h < HPT; ++h)
#pragma unroll
        for (int j = 0; j < SUB; ++j) s[h][j] = token_group_sum<LANES>(s[h][j]);
#pragma unroll
      for (int h = 0; h < HPT; ++h) {
        float m_tile = KGEN_NEG_INF;
#pragma unroll
        for (int j = 0; j < SUB; ++j) {
          s[h][j] = logit(s[h][j], j, slope[h]);
          m_tile = fmaxf(m_tile, s[h][j]);
        }
        float mb;
        const float f = sm.raise(st[h], m_tile, mb);
#pragma unroll
        for (int i = 0; i < OUT; ++i) o[h][i] *= f;
#pragma unroll
        for (int j = 0; j < SUB; ++j) {
          const float p = sm.weight(s[h][j], mb);
          st[h].l += p;
          s[h][j] = v_weight(p, j);
        }
      }
    }
  }

  // P V: o += the batch's weights s times the V rows of the stage's tokens t1 .. t1 + SUB - 1 (vs:
  // the stage's V; fs: its nvfp4 block scales, K's rows then V's).
  __device__ __forceinline__ void accumulate(const float (&s)[HPT][SUB], const kv_t* vs, const unsigned char* fs,
                                             int t1) {
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

  // After the last batch: each head's l, where DIST, the sum of its lanes' shares l_part (each held
  // by SPREAD lanes).
  __device__ __forceinline__ void finish(float l_part) {
    if constexpr (DIST) {
#pragma unroll
      for (int offset = Sums::SPREAD; offset < HEAD_LANES; offset <<= 1)
        l_part += __shfl_xor_sync(0xffffffffu, l_part, offset, 32);
#pragma unroll
      for (int h = 0; h < HPT; ++h) st[h].l = HPT == 1 ? l_part : __shfl_sync(0xffffffffu, l_part, h * HEAD_LANES, LANES);
    }
  }

  // The heads' (o, m, l) into token slot `slot`'s scratch: o_s [slot][g][d], ml_s [slot][g] (m, l).
  __device__ __forceinline__ void store(float* o_s, float* ml_s, int slot, int hset) const {
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
      const int g = hset * HPT + h;
      if (HPT * S::HEAD_SETS == S::G || g < S::G) {
#pragma unroll
        for (int i = 0; i < OUT; ++i) {
          const int d = S::V_BY_TOKEN ? i * LANES + lane : ((i / VEC) * LANES + lane) * VEC + i % VEC;
          if (d < DV) o_s[(slot * S::G + g) * DV + d] = o[h][i];
        }
        if (lane == 0) {
          ml_s[(slot * S::G + g) * 2] = st[h].m;
          ml_s[(slot * S::G + g) * 2 + 1] = st[h].l;
        }
      }
    }
  }
};

// The token slots' scratch (SimtHeads::store) merged, each element of the block's G heads written
// through the epilogue: the final output, or this partition's normalised partial and its (m, l).
template <class S, class Ep>
__device__ __forceinline__ void merge_slots(const float* o_s, const float* ml_s, const Ep& ep, int seq, int q_head0) {
  constexpr int G = S::G, DV = S::DV, THREADS = S::THREADS;
  const int tid = threadIdx.x;
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

}  // namespace kgen
