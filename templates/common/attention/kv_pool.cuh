// The paged K/V pool a decode block reads, as its Params give it: the two caches, their dequantisation
// scales and the strides that place an element (docs/abi.md: block, KV head, slot, and K's head_dim
// runs where K is stored x-packed; the vLLM V layout's head_dim rows). The decode and prefill bodies
// bind it once in their prologue, so the pool's parameters are named in one place:
//
//   KvPool<Cfg>::of(p)              the pool of a kernel's Params
//   head(kv_head)                   the pool of one KV head (its rows offset once)
//   k_row / v_row(phys, h, slot, d)  where element d of a token-major K / V row starts (K's runs,
//                                   Cfg::K_RUN, included)
//   v_column(phys, h, d, slot)      where token `slot` of V's head_dim row d starts (vLLM layout)
//
// Provided by kgen to both compilers as "kgen/attention/kv_pool.cuh" (kgen/compile/provided.py);
// needs kgen/platform.cuh and attention/kv_format.cuh before it.
#pragma once

namespace kgen {

template <class Cfg>
struct KvPool {
  typedef typename Cfg::kv_t kv_t;
  static constexpr int PER = KvFormat<Cfg>::PER;  // elements per kv_t (2: nvfp4's packed pairs)

  const kv_t* __restrict__ k_cache;
  const kv_t* __restrict__ v_cache;
  typename Cfg::scale_arg_t k_scale;  // const float* (nvfp4: kgen::Fp4Scales)
  typename Cfg::scale_arg_t v_scale;
  long long k_s_block, k_s_head, k_s_token, k_s_run, v_s_block, v_s_head, v_s_token, v_s_run;
  long long ks_s_block, ks_s_head, ks_s_token, vs_s_block, vs_s_head, vs_s_token;  // per-token scales

  template <class Params>
  static __device__ __forceinline__ KvPool of(const Params& p) {
    return KvPool{p.k_cache,    p.v_cache,    p.k_scale,    p.v_scale,    p.k_s_block,  p.k_s_head,
                  p.k_s_token,  p.k_s_run,    p.v_s_block,  p.v_s_head,   p.v_s_token,  p.v_s_run,
                  p.ks_s_block, p.ks_s_head,  p.ks_s_token, p.vs_s_block, p.vs_s_head,  p.vs_s_token};
  }

  // The pool of one KV head: its K and V rows offset once (head strides 0), so fewer 64-bit values
  // live through a body's tile loop; the per-token scales keep their head stride.
  __device__ __forceinline__ KvPool head(int kv_head) const {
    KvPool h = *this;
    h.k_cache += (long long)kv_head * k_s_head;
    h.v_cache += (long long)kv_head * v_s_head;
    h.k_s_head = h.v_s_head = 0;
    return h;
  }

  __device__ __forceinline__ const kv_t* k_row(long long phys, int kv_head, int slot, int d0) const {
    return k_cache + phys * k_s_block + kv_head * k_s_head + slot * k_s_token +
           run_offset<Cfg::K_RUN>(d0, k_s_run) / PER;
  }
  __device__ __forceinline__ const kv_t* v_row(long long phys, int kv_head, int slot, int d0) const {
    return v_cache + phys * v_s_block + kv_head * v_s_head + slot * v_s_token + d0 / PER;
  }
  __device__ __forceinline__ const kv_t* v_column(long long phys, int kv_head, int d, unsigned slot) const {
    return v_cache + phys * v_s_block + kv_head * v_s_head + d * v_s_run + slot;
  }
};

}  // namespace kgen
