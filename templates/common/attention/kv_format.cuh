// The KV cache's element format, the one part of the attention bodies that knows it: what a stored
// K/V element is (kv_t: 16-bit, fp32, fp8, int8 or nvfp4's packed pairs) and how its dequantisation
// scales are found (ScaleMode, attention/traits.cuh). The bodies stage K/V as stored and ask this
// part for everything that depends on the format:
//
//   KvFormat<Cfg>           the format's constants (ES, PER, SCALES, TOKEN_SCALES, FP4, GROUPS) and
//     ::bytes(elems)        the bytes `elems` stored elements take in a stage (16-byte aligned)
//     ::scale_bytes(n)      ... the scales a stage of n tokens carries (per token: K's n floats, then
//                           V's; nvfp4: K's n block-scale rows, then V's; else none)
//     ::tensor_scales(...)  K's and V's per-tensor / per-head scales (nvfp4: the fp32 tensor ones)
//     ::issue_scales<N, THREADS>(...)   cp.async of a stage's per-token scales or block-scale rows
//     ::v_reference<THREADS>(...)       fp16 P: V's per-token scales relative to their largest
//   kv_staged_chunk<Cfg, N, W>(...)     N elements of a staged row as floats (nvfp4: times their
//                                       group's e4m3 scale)
//   kv_scale_at<MODE>(...)  one (block, slot, KV head)'s scale, for a body that loads as it goes
//   KvPair<KV, T>           two 8-bit elements as two T in one register (exact), for MMA operands;
//                           fp4_word_pairs / fp4_column_pair / fp4_half_factors: nvfp4's, exact too
//
// Provided by kgen to both compilers as "kgen/attention/kv_format.cuh" (kgen/compile/provided.py);
// needs kgen/platform.cuh, async_copy.cuh, convert.cuh and attention/traits.cuh before it (the MMA
// pairs: mma.cuh's pack2 too, where they are used).
#pragma once

namespace kgen {

template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi);  // mma.cuh

// Dequantisation scale of one (physical block, slot, KV head) for the spec's granularity.
template <ScaleMode MODE>
__device__ __forceinline__ float kv_scale_at(const float* __restrict__ scale, long long phys, int slot,
                                             int kv_head, long long s_block, long long s_head,
                                             long long s_token) {
  if (MODE == ScaleMode::none) return 1.0f;
  if (MODE == ScaleMode::per_tensor) return scale[0];
  if (MODE == ScaleMode::per_head) return scale[kv_head];
  return scale[phys * s_block + kv_head * s_head + slot * s_token];  // per_token_head
}

template <class Cfg>
struct KvFormat {
  typedef typename Cfg::kv_t kv_t;
  typedef typename Cfg::scale_arg_t scale_arg_t;  // const float* (nvfp4: kgen::Fp4Scales)
  static constexpr int ES = (int)sizeof(kv_t);
  static constexpr int PER = ElemsPer<kv_t>::value;  // elements per kv_t (2: nvfp4's packed pairs)
  static constexpr ScaleMode SCALES = ScaleModeOf<Cfg>::value;
  static constexpr bool TOKEN_SCALES = SCALES == ScaleMode::per_token_head;
  static constexpr bool FP4 = SCALES == ScaleMode::block;  // nvfp4: an e4m3 scale per 16 elements of a row
  static constexpr int GROUPS = Cfg::HEAD_DIM / 16;         // ... GROUPS bytes a row
  static constexpr int align16(int x) { return (x + 15) / 16 * 16; }
  static constexpr int bytes(int elems) { return align16(elems / PER * ES); }
  static constexpr int scale_bytes(int n) { return TOKEN_SCALES ? align16(2 * n * 4) : FP4 ? align16(2 * n * GROUPS) : 0; }

  struct Scales { float k, v; };
  // K's and V's scales applied outside the products, 1 where they come with the tiles (per token)
  // or there are none; nvfp4: the tensor scales times `unit` (what its operands leave out).
  static __device__ __forceinline__ Scales tensor_scales(scale_arg_t k_scale, scale_arg_t v_scale, int kv_head,
                                                         float unit = 1.0f) {
    Scales s{1.0f, 1.0f};
    if constexpr (SCALES == ScaleMode::per_tensor) s = Scales{k_scale[0], v_scale[0]};
    if constexpr (SCALES == ScaleMode::per_head) s = Scales{k_scale[kv_head], v_scale[kv_head]};
    if constexpr (FP4) s = Scales{*k_scale.tensor * unit, *v_scale.tensor * unit};
    return s;
  }

  // The cp.async copies of a stage's scales at `dst` (scale_bytes(N) bytes), tokens t = 0 .. N - 1
  // of its tile, by THREADS threads: per token, [0, N) K's floats and [N, 2N) V's; nvfp4, K's block-
  // scale rows ([token][group] bytes, Cfg::S_COPY bytes a copy) then V's. valid(t): token t is read;
  // else its scales are zero-filled (no table entry past the sequence is followed).
  // locate(t, phys, slot): its physical block and slot. UNROLL: the copies in a loop unrolled at
  // compile time (each with a bounds test), else in a runtime loop; measured per body (the CUDA-core
  // decode and the prefill bodies' tile loops are shorter with the first, the tensor-core decode
  // body's with the second).
  template <int N, int THREADS, bool UNROLL, class Valid, class Locate>
  static __device__ __forceinline__ void issue_scales(unsigned char* dst, scale_arg_t k_scale, scale_arg_t v_scale,
                                                      long long ks_s_block, long long ks_s_head, long long ks_s_token,
                                                      long long vs_s_block, long long vs_s_head, long long vs_s_token,
                                                      int kv_head, Valid&& valid, Locate&& locate) {
    if constexpr (FP4) {
      constexpr int FC = Cfg::S_COPY, PIECES = GROUPS / FC;
      copies<2 * N * PIECES, THREADS, UNROLL>([&](unsigned c) {
        const bool is_v = c >= (unsigned)(N * PIECES);
        const unsigned r = is_v ? c - N * PIECES : c;
        const int t = r / PIECES, g0 = (r % PIECES) * FC;
        const bool ok = valid(t);
        const unsigned char* src = reinterpret_cast<const unsigned char*>(k_scale.block);
        if (ok) {
          long long phys;
          int slot;
          locate(t, phys, slot);
          src = reinterpret_cast<const unsigned char*>(
                    is_v ? v_scale.block + phys * vs_s_block + kv_head * vs_s_head + slot * vs_s_token
                         : k_scale.block + phys * ks_s_block + kv_head * ks_s_head + slot * ks_s_token) + g0;
        }
        if constexpr (FC >= 4) {
          cp_async<(FC >= 4 ? FC : 4)>(dst + c * FC, src, ok ? FC : 0);
        } else {  // rows of fewer than 4 bytes a piece: a plain copy, landed at issue
          dst[c] = ok ? src[0] : (unsigned char)0;
        }
      });
    }
    if constexpr (TOKEN_SCALES) {
      float* ss = reinterpret_cast<float*>(dst);
      copies<2 * N, THREADS, UNROLL>([&](unsigned c) {
        const int t = c % N;
        const bool ok = valid(t);
        const float* src = k_scale;
        if (ok) {
          long long phys;
          int slot;
          locate(t, phys, slot);
          src = c < N ? k_scale + phys * ks_s_block + kv_head * ks_s_head + slot * ks_s_token
                      : v_scale + phys * vs_s_block + kv_head * vs_s_head + slot * vs_s_token;
        }
        cp_async<4>(ss + c, src, ok ? 4 : 0);
      });
    }
  }

  // copy(c) for c = threadIdx.x, + THREADS, .. below COPIES (unsigned: index math by shifts and masks).
  template <int COPIES, int THREADS, bool UNROLL, class Copy>
  static __device__ __forceinline__ void copies(Copy&& copy) {
    if constexpr (UNROLL) {
#pragma unroll
      for (int k = 0; k < (COPIES + THREADS - 1) / THREADS; ++k) {
        const unsigned c = threadIdx.x + k * THREADS;
        if (COPIES % THREADS == 0 || c < COPIES) copy(c);
      }
    } else {
      for (unsigned c = threadIdx.x; c < COPIES; c += THREADS) copy(c);
    }
  }

  // fp16 P with per-token V scales: P times v_scale[j] is rounded to fp16, whose range is narrow, so
  // the scales are taken relative to v_ref, their largest over keys [lo, hi) (the output is
  // multiplied by v_ref): P * ratio <= 1 cannot overflow, and a tiny ratio loses to fp16's
  // subnormals at most 2^-25 * v_ref per stored unit. Sets v_out = v_ref, v_inv_ref = 1 / v_ref
  // (all zero or not finite: left as they are). red: THREADS / 32 floats of shared memory; holds a
  // block barrier (every thread calls it).
  template <int THREADS>
  static __device__ __forceinline__ void v_reference(const float* v_scale, const int* table, int lo, int hi, int kv_head,
                                                     long long vs_s_block, long long vs_s_head, long long vs_s_token,
                                                     float* red, float& v_out, float& v_inv_ref) {
    constexpr int B = Cfg::BLOCK_SIZE;
    float mx = 0.0f;
    for (int key = lo + (int)threadIdx.x; key < hi; key += THREADS)
      mx = fmaxf(mx, kv_scale_at<ScaleMode::per_token_head>(v_scale, table[key / B], key % B, kv_head, vs_s_block,
                                                            vs_s_head, vs_s_token));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off, 32));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = 0.0f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) mx = fmaxf(mx, red[w]);
    if (mx > 0.0f && mx < 3.0e38f) v_out = mx, v_inv_ref = 1.0f / mx;
  }
};

// N elements [e, e + N) of row t of a stage's K or V rows (W elements a row: head_dim for K,
// v_head_dim for V) as floats; nvfp4: times their group's e4m3 scale from `scales` ([row][group]
// bytes), e2m1 * e4m3 exactly (convert.cuh), at most one group at a time.
template <class Cfg, int N, int W>
__device__ __forceinline__ void kv_staged_chunk(const typename Cfg::kv_t* rows, const unsigned char* scales, int t,
                                                int e, float* dst) {
  typedef KvFormat<Cfg> F;
  if constexpr (F::FP4) {
    constexpr int PIECE = N < 16 ? N : 16;
#pragma unroll
    for (int p = 0; p < N; p += PIECE) {
      const int x = e + p;
      load_fp4_as_float<PIECE>(rows + (t * W + x) / F::PER, scales[t * (W / 16) + x / 16], dst + p);
    }
  } else {
    load_as_float<typename Cfg::kv_t, N>(rows + t * W + e, dst);
  }
}

// ---- MMA operands from a quantized cache, converted in registers ----

// Two 8-bit cache elements (the low and high byte of `two`) as two elements of T (fp16 or bf16) in
// one register, exactly (fp8 and int8 values are exact in fp16 and bf16).
// (The MLA bodies' fp8 tiles too.)
template <class KV, class T> struct KvPair;
template <__nv_fp8_interpretation_t KIND, class T>
struct KvPairFp8 {  // convert.cuh's fp8 pair conversions
  static __device__ __forceinline__ unsigned two(unsigned short x) {
    if constexpr (IsSame<T, __half>::value) {
      return fp8x2_to_half2_bits<KIND>(x);
    } else {  // via half2 and float2: exact (fp8's values are bf16 values)
      const float2 f = fp8x2_to_float2<KIND>(x);
      return pack2<T>(f.x, f.y);
    }
  }
};
template <class T> struct KvPair<__nv_fp8_e4m3, T> : KvPairFp8<__NV_E4M3, T> {};
template <class T> struct KvPair<__nv_fp8_e5m2, T> : KvPairFp8<__NV_E5M2, T> {};
template <class T> struct KvPair<i8, T> {
  static __device__ __forceinline__ unsigned two(unsigned short x) {
    const unsigned u = (unsigned)x ^ 0x8080u;
    if constexpr (IsSame<T, __half>::value) {  // 0x6400 | (x + 128) is the half 1024 + 128 + x exactly
      const unsigned bits = __byte_perm(u, 0x64646464u, 0x4140u);
      __half2 h;
      memcpy(&h, &bits, 4);
      h = __hsub2(h, __floats2half2_rn(1152.0f, 1152.0f));
      unsigned r;
      memcpy(&r, &h, 4);
      return r;
    } else {  // bf16's 8-bit significand cannot hold 128 + x over a power of two: fp32's magic number
      const float lo = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u)) - 8388736.0f;
      const float hi = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7441u)) - 8388736.0f;
      return pack2<T>(lo, hi);
    }
  }
};

// Two nibbles at bits 12..15 and 28..31 of v as a half2 of 2^-14 x their e2m1 values (exact; e = 0
// lands on the subnormal 2^-15 m): the sign stays, e1 e0 m move to bits 9..11 (one shift, one LOP3).
__device__ __forceinline__ unsigned fp4_place(unsigned v) {
  return (v & 0x80008000u) | ((v >> 3) & 0x0E000E00u);
}

__device__ __forceinline__ unsigned hmul2_bits(unsigned h, __half2 f) {
  __half2 v;
  memcpy(&v, &h, 4);
  v = __hmul2(v, f);
  unsigned r;
  memcpy(&r, &v, 4);
  return r;
}

// Two nvfp4 group factors for fp16 operands, e4m3 a and b (bytes) as the half2 (a x 2^7, b x 2^7),
// <= 57344, so that 2^-14 e2m1 times one is e2m1 x e4m3 x 2^-7, exact (6 significant bits, at least
// 2^-17: fp16 subnormals included). Bits placed as halves of 2^-8 x their values (subnormals too;
// 0x7F / 0xFF get an all-ones exponent: NaN), then one HMUL2 by 2^15.
__device__ __forceinline__ __half2 fp4_half_factors(unsigned a, unsigned b) {
  const unsigned u = a | (b << 16);
  const unsigned mag = u & 0x007F007Fu;
  const unsigned nan = ((mag + 0x00010001u) & 0x00800080u) >> 7;  // 1 where the low 7 bits are all ones
  const unsigned h = ((u & 0x00800080u) << 8) | (mag << 7) | nan * 0x7C00u;
  __half2 v;
  memcpy(&v, &h, 4);
  return __hmul2(v, __float2half2_rn(32768.0f));
}

// Four bytes of nvfp4 (elements 2b, 2b + 1 in byte b), all of one group, as four registers of two
// elements of T. fp16: each byte's nibbles placed by one byte permute (w's byte b high nibble and
// w << 4's) and fp4_place, times the factor f (fp4_half_factors) in one HMUL2: e2m1 x e4m3 x 2^-7.
// bf16: through fp32 (fp4x2_scaled times fp4_group_factor): e2m1 x e4m3. Both exact.
template <class T>
__device__ __forceinline__ void fp4_word_pairs(unsigned w, unsigned char scale, __half2 f, unsigned (&out)[4]) {
  if constexpr (IsSame<T, __half>::value) {
    const unsigned x = w << 4;
#pragma unroll
    for (int b = 0; b < 4; ++b) out[b] = hmul2_bits(fp4_place(__byte_perm(w, x, (b << 12) | ((4 + b) << 4))), f);
  } else {
    const float f = fp4_group_factor(scale);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float2 e = fp4x2_scaled((w >> (8 * b)) & 0xFFu);
      out[b] = pack2<T>(e.x * f, e.y * f);
    }
  }
}

// nvfp4 V: nibble j of each 16-bit half of w (column 4g + j of two tokens) as two elements of T, times
// the tokens' factors (fp16: fp4_half_factors, the pair's; bf16: fp4_group_factor's).
template <class T>
__device__ __forceinline__ unsigned fp4_column_pair(unsigned w, int j, __half2 hf, float f_lo, float f_hi) {
  const unsigned h = fp4_place(w << (12 - 4 * j));  // nibble j of each half to bits 12..15
  if constexpr (IsSame<T, __half>::value) {
    return hmul2_bits(h, hf);
  } else {
    __half2 v;
    memcpy(&v, &h, 4);
    const float2 e = __half22float2(v);
    return pack2<T>(e.x * f_lo, e.y * f_hi);
  }
}

}  // namespace kgen
