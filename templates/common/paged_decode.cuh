// Paged decode attention: one query token per sequence against its paged KV cache.
//
// Work decomposition: one thread block per (KV head, sequence, KV partition).
// The block serves all GROUP query heads that share its KV head, so every K/V
// row is read from memory once per group. Threads form "token groups" of LANES
// lanes; a token group owns one token at a time and its lanes split head_dim
// into VEC-element chunks (16-byte loads when the layout allows). Each token
// group keeps its own online-softmax state (running max m, sum l, output o) in
// registers; the states are merged across token groups by warp shuffles and
// across warps through shared memory at the end.
//
// With PARTITION_SIZE > 0 (flash-decoding) each block covers one partition of
// the context and writes its normalised partial output plus (m, l); the merge
// kernel combines the partitions with a log-sum-exp merge.
//
// Cfg (rendered per spec) supplies the types and compile-time constants.
#pragma once

namespace kgen {

__host__ __device__ constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }

template <class Cfg>
struct DecodeShape {
  static constexpr int D = Cfg::HEAD_DIM;
  static constexpr int G = Cfg::GROUP;
  static constexpr int VEC = Cfg::VEC;
  static constexpr int CHUNKS = D / VEC;
  static constexpr int LANES = next_pow2(CHUNKS) < 32 ? next_pow2(CHUNKS) : 32;  // lanes per token group
  static constexpr int CPL = (CHUNKS + LANES - 1) / LANES;                       // chunks per lane
  static constexpr int NUM_WARPS = Cfg::NUM_THREADS / 32;
  static constexpr int TOKEN_GROUPS = Cfg::NUM_THREADS / LANES;
  static_assert(D % VEC == 0, "head_dim must be a multiple of the vector width");
  static_assert(Cfg::NUM_THREADS % 32 == 0, "threads must be a multiple of 32");
};

// Sum over the LANES lanes of a token group (xor butterfly: every lane ends with the same value).
template <int LANES>
__device__ __forceinline__ float token_group_sum(float v) {
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset, 32);
  return v;
}

// Load head_dim elements [d0, d0+VEC) of one token row as floats. The layout cuts
// head_dim into runs of RUN contiguous elements, consecutive runs `run_stride`
// elements apart (NHD/HND: one run; vLLM K: runs of x; vLLM V: runs of 1).
template <class T, int VEC, int RUN>
__device__ __forceinline__ void load_row_chunk(const T* __restrict__ row, int d0, long long run_stride,
                                               float (&dst)[VEC]) {
  if (RUN % VEC == 0) {
    load_vec_as_float<T, VEC>(row + (long long)(d0 / RUN) * run_stride + d0 % RUN, dst);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const int d = d0 + i;
      dst[i] = to_float(row[(long long)(d / RUN) * run_stride + d % RUN]);
    }
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

// Online softmax of one row: running max m of the logits seen, running sum l of
// exp(logit - m). The caller keeps the accumulator (sum of exp(logit - m) * value) and
// rescales it with the factors merge() returns: acc = acc * f.self + acc_other * f.other.
// The empty state (no key seen) is m = -inf, l = 0; its factor is 0, never the NaN of
// exp(-inf - -inf), and its LSE is -inf. Used for every merge: one logit into a token
// group's state, token groups by shuffles, warps through shared memory, KV partitions.
struct SoftmaxFactors {
  float self, other;
};

struct SoftmaxState {
  float m, l;

  static __device__ __forceinline__ SoftmaxState empty() { return SoftmaxState{KGEN_NEG_INF, 0.0f}; }

  // exp(m_from - m_to): what a quantity accumulated against max m_from weighs against m_to.
  static __device__ __forceinline__ float rescale(float m_from, float m_to) {
    return m_from == KGEN_NEG_INF ? 0.0f : __expf(m_from - m_to);
  }

  // this := this (+) other; returns the factors for this state's and other's accumulators.
  __device__ __forceinline__ SoftmaxFactors merge(SoftmaxState other) {
    const float m_new = fmaxf(m, other.m);
    const SoftmaxFactors f{rescale(m, m_new), rescale(other.m, m_new)};
    l = l * f.self + other.l * f.other;
    m = m_new;
    return f;
  }

  // One (finite) logit s: merge() with the single-element state (s, 1), whose own factor
  // exp(s - m_new) needs no guard.
  __device__ __forceinline__ SoftmaxFactors add(float s) {
    const float m_new = fmaxf(m, s);
    const SoftmaxFactors f{rescale(m, m_new), __expf(s - m_new)};
    l = l * f.self + f.other;
    m = m_new;
    return f;
  }

  __device__ __forceinline__ float inv_sum() const { return l > 0.0f ? 1.0f / l : 0.0f; }
  __device__ __forceinline__ float lse() const { return m + logf(l); }  // -inf + log(0) = -inf when empty
};

// One query head's logit adjustments after the scaled dot product (order: soft-cap, then ALiBi).
template <class Cfg>
__device__ __forceinline__ float adjust_logit(float s, float alibi_slope, int pos, int seq_len) {
  if (Cfg::SOFT_CAP > 0.0f) s = Cfg::SOFT_CAP * tanhf(s / Cfg::SOFT_CAP);
  if (Cfg::ALIBI) s += alibi_slope * (float)(pos - (seq_len - 1));
  return s;
}

template <class Cfg>
__device__ __forceinline__ void paged_decode_body(
    typename Cfg::out_t* __restrict__ out, const typename Cfg::q_t* __restrict__ q,
    const typename Cfg::kv_t* __restrict__ k_cache, const typename Cfg::kv_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    const float* __restrict__ alibi_slopes, float* __restrict__ part_o, float* __restrict__ part_ml,
    float* __restrict__ lse, int max_blocks_per_seq, int max_partitions, long long q_s_seq,
    long long q_s_head, long long o_s_seq, long long o_s_head, long long k_s_block, long long k_s_head,
    long long k_s_token, long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token,
    long long v_s_run, long long ks_s_block, long long ks_s_head, long long ks_s_token,
    long long vs_s_block, long long vs_s_head, long long vs_s_token) {
  typedef DecodeShape<Cfg> S;
  constexpr int D = S::D, G = S::G, VEC = S::VEC, LANES = S::LANES, CPL = S::CPL;
  constexpr int B = Cfg::BLOCK_SIZE, P = Cfg::PARTITION_SIZE;

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int tgroup = tid / LANES;        // token group within the block
  const int tlane = tid % LANES;         // lane within the token group
  const int q_head0 = kv_head * G;

  const int seq_len = seq_lens[seq];
  // Keys the query may see: [ctx_begin, seq_len); without tail masking the
  // promise is that seq_len is a multiple of B, so whole blocks are read.
  const int ctx_end = Cfg::TAIL_MASK ? seq_len : ((seq_len + B - 1) / B) * B;
  int ctx_begin = 0;
  if (Cfg::SLIDING_WINDOW > 0) ctx_begin = seq_len > Cfg::SLIDING_WINDOW ? seq_len - Cfg::SLIDING_WINDOW : 0;
  int tok_begin = ctx_begin, tok_end = ctx_end;
  if (P > 0) {
    const int num_parts = (seq_len + P - 1) / P;
    if (part >= num_parts) return;  // uniform across the block: no barrier is skipped by some threads only
    tok_begin = max(ctx_begin, part * P);
    tok_end = min(ctx_end, (part + 1) * P);
  }

  // Queries of the group, widened to fp32, in shared memory (reused for the output merge).
  KGEN_DYNAMIC_SMEM(float, q_s);
  __shared__ float warp_m[S::NUM_WARPS * G];
  __shared__ float warp_l[S::NUM_WARPS * G];
  for (int i = tid; i < G * D; i += Cfg::NUM_THREADS) {
    const int g = i / D, d = i % D;
    q_s[i] = to_float(q[seq * q_s_seq + (long long)(q_head0 + g) * q_s_head + d]);
  }
  __syncthreads();

  float slope[G];
#pragma unroll
  for (int g = 0; g < G; ++g) slope[g] = Cfg::ALIBI ? alibi_slopes[q_head0 + g] : 0.0f;

  SoftmaxState st[G];
  float o[G][CPL * VEC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    st[g] = SoftmaxState::empty();
#pragma unroll
    for (int i = 0; i < CPL * VEC; ++i) o[g][i] = 0.0f;
  }

  const int* table = block_tables + (long long)seq * max_blocks_per_seq;
  // The loop bound is uniform across the block, so every lane reaches every shuffle.
  for (int base = tok_begin; base < tok_end; base += S::TOKEN_GROUPS) {
    const int pos = base + tgroup;
    const bool valid = pos < tok_end;
    long long phys = 0;
    int slot = 0;
    float qk[G];
#pragma unroll
    for (int g = 0; g < G; ++g) qk[g] = 0.0f;
    if (valid) {
      phys = table[pos / B];
      slot = pos % B;
      const typename Cfg::kv_t* k_row = k_cache + phys * k_s_block + (long long)kv_head * k_s_head + slot * k_s_token;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int chunk = tlane + c * LANES;
        if (chunk < S::CHUNKS) {
          float kf[VEC];
          load_row_chunk<typename Cfg::kv_t, VEC, Cfg::K_RUN>(k_row, chunk * VEC, k_s_run, kf);
#pragma unroll
          for (int g = 0; g < G; ++g)
#pragma unroll
            for (int i = 0; i < VEC; ++i) qk[g] += q_s[g * D + chunk * VEC + i] * kf[i];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) qk[g] = token_group_sum<LANES>(qk[g]);
    if (valid) {
      const float ks = kv_scale_at<Cfg::SCALE_MODE>(k_scale, phys, slot, kv_head, ks_s_block, ks_s_head, ks_s_token);
      const float vs = kv_scale_at<Cfg::SCALE_MODE>(v_scale, phys, slot, kv_head, vs_s_block, vs_s_head, vs_s_token);
      const typename Cfg::kv_t* v_row = v_cache + phys * v_s_block + (long long)kv_head * v_s_head + slot * v_s_token;
      float vf[CPL][VEC];
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int chunk = tlane + c * LANES;
        if (chunk < S::CHUNKS) {
          load_row_chunk<typename Cfg::kv_t, VEC, Cfg::V_RUN>(v_row, chunk * VEC, v_s_run, vf[c]);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) vf[c][i] = 0.0f;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float s = adjust_logit<Cfg>(qk[g] * ks * Cfg::SOFTMAX_SCALE, slope[g], pos, seq_len);
        const SoftmaxFactors f = st[g].add(s);
        const float p = f.other;  // this token's weight exp(s - m)
        const float pv = p * vs;
#pragma unroll
        for (int c = 0; c < CPL; ++c)
#pragma unroll
          for (int i = 0; i < VEC; ++i) o[g][c * VEC + i] = o[g][c * VEC + i] * f.self + pv * vf[c][i];
      }
    }
  }

  // Merge the token groups of each warp: lanes that own the same chunks sit LANES apart.
#pragma unroll
  for (int offset = LANES; offset < 32; offset <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const SoftmaxState other{__shfl_xor_sync(0xffffffffu, st[g].m, offset, 32),
                               __shfl_xor_sync(0xffffffffu, st[g].l, offset, 32)};
      const SoftmaxFactors f = st[g].merge(other);
#pragma unroll
      for (int i = 0; i < CPL * VEC; ++i) {
        const float o_other = __shfl_xor_sync(0xffffffffu, o[g][i], offset, 32);
        o[g][i] = o[g][i] * f.self + o_other * f.other;
      }
    }
  }

  // Merge the warps through shared memory. q_s is free once every thread is past the loop.
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      warp_m[warp * G + g] = st[g].m;
      warp_l[warp * G + g] = st[g].l;
    }
  }
  __syncthreads();
  float* o_s = q_s;
  for (int i = tid; i < G * D; i += Cfg::NUM_THREADS) o_s[i] = 0.0f;
  SoftmaxState blk[G];  // the block's state: every warp's merged (each thread computes it)
#pragma unroll
  for (int g = 0; g < G; ++g) {
    blk[g] = SoftmaxState::empty();
#pragma unroll 1  // merges interleaved across warps while o[] is live cost registers
    for (int w = 0; w < S::NUM_WARPS; ++w) blk[g].merge(SoftmaxState{warp_m[w * G + g], warp_l[w * G + g]});
  }
  __syncthreads();
  for (int w = 0; w < S::NUM_WARPS; ++w) {
    if (warp == w && lane < LANES) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float a = SoftmaxState::rescale(st[g].m, blk[g].m);
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int chunk = tlane + c * LANES;
          if (chunk < S::CHUNKS) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) o_s[g * D + chunk * VEC + i] += o[g][c * VEC + i] * a;
          }
        }
      }
    }
    __syncthreads();
  }

  // Write out: the final output, or this partition's normalised partial and its (m, l).
  for (int i = tid; i < G * D; i += Cfg::NUM_THREADS) {
    const int g = i / D, d = i % D;
    const float inv_l = blk[g].inv_sum();
    const int h = q_head0 + g;
    if (P > 0) {
      part_o[(((long long)seq * Cfg::NUM_Q_HEADS + h) * max_partitions + part) * D + d] = o_s[i] * inv_l;
    } else {
      out[seq * o_s_seq + (long long)h * o_s_head + d] = from_float<typename Cfg::out_t>(o_s[i] * inv_l);
    }
  }
  if (tid < G) {
    const int h = q_head0 + tid;
    if (P > 0) {
      float* ml = part_ml + (((long long)seq * Cfg::NUM_Q_HEADS + h) * max_partitions + part) * 2;
      ml[0] = blk[tid].m;
      ml[1] = blk[tid].l;
    } else if (lse != nullptr) {
      lse[(long long)seq * Cfg::NUM_Q_HEADS + h] = blk[tid].lse();
    }
  }
}

// Log-sum-exp merge of the partitions of one (sequence, query head).
template <class Cfg>
__device__ __forceinline__ void paged_decode_merge_body(typename Cfg::out_t* __restrict__ out,
                                                        const float* __restrict__ part_o,
                                                        const float* __restrict__ part_ml,
                                                        float* __restrict__ lse,
                                                        const int* __restrict__ seq_lens, int max_partitions,
                                                        long long o_s_seq, long long o_s_head) {
  constexpr int D = Cfg::HEAD_DIM, P = Cfg::PARTITION_SIZE;
  const int h = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_parts = (seq_lens[seq] + P - 1) / P;
  const long long row = ((long long)seq * Cfg::NUM_Q_HEADS + h) * max_partitions;
  const float* ml = part_ml + row * 2;
  SoftmaxState tot = SoftmaxState::empty();  // every partition's state merged
  for (int p = 0; p < num_parts; ++p) tot.merge(SoftmaxState{ml[2 * p], ml[2 * p + 1]});
  const float inv = tot.inv_sum();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < num_parts; ++p) {
      // Partials are normalised: partition p weighs l_p * exp(m_p - m); an empty one is not read.
      const float wp = ml[2 * p + 1] * SoftmaxState::rescale(ml[2 * p], tot.m);
      if (wp != 0.0f) acc += part_o[(row + p) * D + d] * wp;
    }
    out[seq * o_s_seq + (long long)h * o_s_head + d] = from_float<typename Cfg::out_t>(acc * inv);
  }
  if (threadIdx.x == 0 && lse != nullptr) lse[(long long)seq * Cfg::NUM_Q_HEADS + h] = tot.lse();
}

}  // namespace kgen
