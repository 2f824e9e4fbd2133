// kgen SIMT runtime, part 8: wgmma.mma_async m64nNk16 (f32 += f16/bf16), the warpgroup tensor-core
// instruction of sm_90a, as templates/common/hopper.cuh calls it on the CPU.
//
// PTX ISA semantics (sections "Asynchronous Warpgroup Level Matrix ..."): the 128 threads of a
// warpgroup (warps 4q .. 4q+3) execute it together. Warp w of the group owns rows 16w .. 16w+15.
// Per thread (lane: g = lane >> 2, t = lane % 4):
//   D (64 x N, f32, N/2 registers): d[i] = (16w + g + 8*((i >> 1) & 1), 8*(i >> 2) + 2t + (i & 1))
//   A in registers (64 x 16, four .b32 of two 16-bit values): the m16n8k16 A fragment of the
//     warp's 16 rows: a0,a1 (g, 2t+0/1), a2,a3 (g+8, 2t+0/1), a4,a5 (g, 2t+8+0/1), a6,a7 (g+8, 2t+8+0/1)
//   A or B in shared memory: a 64-bit matrix descriptor (PTX ISA 9.7.15.5.1.2.2 "Matrix Descriptor
//     Format"): start address >> 4 (bits 0-13), leading dimension byte offset >> 4 (LBO, 16-29),
//     stride dimension byte offset >> 4 (SBO, 32-45), base offset (49-51; must be 0 here),
//     swizzle (62-63: 0 none, 1 128B, 2 64B, 3 32B).
//     The canonical layouts (PTX ISA 9.7.15.5.1.2.1.3 "Canonical Layouts"; the same as CuTe's
//     make_gmma_desc), in elements with T = 8 (16 bytes of 16-bit elements), S = swizzle bytes,
//     before the swizzle is applied to the address:
//       K-major,  none:  ((8,m),(T,2k)) : ((T,SBO),(1,LBO))      (core matrices of 8 rows x 16 bytes)
//       K-major,  S:     ((8,m),(T,2k)) : ((S/2,SBO),(1,T))       (rows of S bytes, 8-row groups at SBO)
//       MN-major, none:  ((T,1,m),(8,k)) : ((1,T,SBO),(T,LBO))    (SBO between 8-element MN groups,
//                                                                  LBO between 8-deep K groups)
//       MN-major, S:     ((T,S/16,m),(8,k)) : ((1,T,LBO),(S/2,SBO))
//     then the swizzle (CuTe's Swizzle<b,4,3>) XORs address bits [4, 4+b) with bits [7, 7+b),
//     b = log2(S/16). On the CPU the "shared address" of the descriptor is the byte offset in the
//     block's dynamic shared memory (1024-byte aligned, where every swizzle pattern starts).
// scale-d = 0: D = A*B; otherwise D = A*B + D. The accumulation is in fp32, k in order, one
// rounding per step (as mma.sync's emulation, kgen_simt_mma.h).
// The product is computed when the last thread of the warpgroup arrives (the operands are read
// then) and kept aside: the accumulator registers hold NaN until the wgmma.wait_group that covers
// the wgmma's commit group, which writes the result back (the latest point the PTX ISA allows).
// A wgmma into an accumulator whose result is pending accumulates onto that result (the chained
// k-steps of one tile). Overwriting the shared operands before the wait is not detected.
#pragma once

namespace kgen_simt {

enum WgmmaType : int { WG_F16 = 0, WG_BF16 = 1 };

struct WgmmaCall {
  float* d;
  const unsigned* a;  // the thread's four A registers (register form) or nullptr
};

struct WgmmaStage {
  unsigned long long serial;  // the block that filled it (a failed block may leave it half full)
  unsigned arrived;
  unsigned long long desc_a, desc_b;
  int n, type, trans_a, trans_b, scale_d, a_regs;
  WgmmaCall call[128];
};
inline thread_local WgmmaStage wgmma_stage[8];  // one per warpgroup of the running block
inline thread_local float wgmma_a[64][16], wgmma_b[16][256];  // operands of the product being computed

// Swizzle<b,4,3> of a shared-memory byte address: the 16-byte chunk index inside each S-byte row
// (bits 4..) XORed with the row index modulo the pattern's height (bits 7..): 128B: bits [4,7) ^=
// bits [7,10); 64B: [4,6) ^= [7,9); 32B: bit 4 ^= bit 7 (the pattern repeats every 1024, 512, 256 B).
inline size_t wgmma_swizzle(size_t addr, unsigned swizzle) {
  const size_t mask = swizzle == 128 ? 7 : swizzle == 64 ? 3 : swizzle == 32 ? 1 : 0;
  return addr ^ (((addr >> 7) & mask) << 4);
}

inline float wg_elem(unsigned short bits, int type) {
  return type == WG_F16 ? bits_to_float<__half>(bits) : bits_to_float<__nv_bfloat16>(bits);
}

// Element (mn, k) of a shared-memory operand given by descriptor `desc`; `k_major`: K contiguous.
inline unsigned short wg_smem_elem(Worker* w, unsigned long long desc, bool k_major, int mn, int k) {
  const size_t start = (size_t)(desc & 0x3fff) << 4, lbo = (size_t)((desc >> 16) & 0x3fff) << 4,
               sbo = (size_t)((desc >> 32) & 0x3fff) << 4;
  const unsigned mode = (unsigned)(desc >> 62), sw = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0;
  size_t off;
  if (k_major) {
    off = sw ? (size_t)(mn % 8) * sw + (size_t)(mn / 8) * sbo + (size_t)k * 2
             : (size_t)(mn % 8) * 16 + (size_t)(mn / 8) * sbo + (size_t)(k % 8) * 2 + (size_t)(k / 8) * lbo;
  } else if (sw) {
    const int run = (int)sw / 2;  // elements contiguous along MN
    off = (size_t)(mn % run) * 2 + (size_t)(mn / run) * lbo + (size_t)(k % 8) * sw + (size_t)(k / 8) * sbo;
  } else {  // without a swizzle the roles of the two offsets swap: SBO steps along MN, LBO along K
    off = (size_t)(mn % 8) * 2 + (size_t)(mn / 8) * sbo + (size_t)(k % 8) * 16 + (size_t)(k / 8) * lbo;
  }
  const size_t addr = wgmma_swizzle(start + off, sw);
  if (addr + 2 > w->dyn_smem_len)
    fail("wgmma.mma_async: the descriptor 0x%016llx addresses byte %zu, beyond the %zu bytes of dynamic shared memory",
         desc, addr, w->dyn_smem_len);
  unsigned short v;
  std::memcpy(&v, static_cast<unsigned char*>(w->dyn_smem) + addr, 2);
  return v;
}

inline void wgmma_compute(Worker* w, WgmmaStage& s, unsigned group) {
  const int n = s.n;
  for (int m = 0; m < 64; ++m)
    for (int k = 0; k < 16; ++k) {
      unsigned short bits;
      if (s.a_regs) {
        const int r = m % 16, lane = (r % 8) * 4 + (k % 8) / 2, reg = (r / 8) + 2 * (k / 8);
        const unsigned word = s.call[(m / 16) * 32 + lane].a[reg];
        bits = (k & 1) ? hi16(word) : lo16(word);
      } else {
        bits = wg_smem_elem(w, s.desc_a, !s.trans_a, m, k);
      }
      wgmma_a[m][k] = wg_elem(bits, s.type);
    }
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < n; ++j) wgmma_b[k][j] = wg_elem(wg_smem_elem(w, s.desc_b, !s.trans_b, j, k), s.type);
  for (int th = 0; th < 128; ++th) {
    const int warp = th / 32, lane = th % 32, g = lane >> 2, t = lane & 3;
    const unsigned linear = group * 128 + th;
    float* d = s.call[th].d;
    WgmmaThread& wt = w->hop.wgt[linear];
    WgmmaPending* slots = w->hop.wg + (size_t)linear * WGMMA_MAX_PENDING;
    WgmmaPending* rec = nullptr;
    for (unsigned r = 0; r < wt.count; ++r)
      if (slots[r].d == d) rec = &slots[r];
    if (rec && rec->regs != (unsigned)n / 2)
      fail("wgmma.mma_async: the accumulator at %p has a pending m64n%uk16 result; this one is m64n%dk16", (void*)d,
           rec->regs * 2, n);
    if (!rec) {
      if (wt.count == WGMMA_MAX_PENDING)
        fail("wgmma.mma_async: more than %u accumulators in flight in one thread (the CPU backend's limit); "
             "wgmma.wait_group first", WGMMA_MAX_PENDING);
      rec = &slots[wt.count++];
      rec->d = d;
      rec->regs = (unsigned)n / 2;
      for (int i = 0; i < n / 2; ++i) rec->v[i] = d[i];  // the accumulator as the registers hold it now
    }
    rec->group = wt.commits;
    for (int i = 0; i < n / 2; ++i) {  // a chained wgmma accumulates onto the pending result
      const int row = 16 * warp + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
      float acc = s.scale_d ? rec->v[i] : 0.0f;
      for (int k = 0; k < 16; ++k) acc += wgmma_a[row][k] * wgmma_b[k][col];
      rec->v[i] = acc;
      d[i] = __builtin_nanf("");  // not written back until the wait
    }
  }
}

// wgmma.commit_group: closes the thread's group of wgmmas issued since the last commit.
__attribute__((noinline, noipa)) inline void wgmma_commit() { ++tls_w->hop.wgt[tls_w->cur->linear].commits; }

// wgmma.wait_group n: the results of all but the n most recent groups reach their registers.
__attribute__((noinline, noipa)) inline void wgmma_wait(unsigned n) {
  Worker* w = tls_w;
  const unsigned linear = w->cur->linear;
  WgmmaThread& wt = w->hop.wgt[linear];
  WgmmaPending* slots = w->hop.wg + (size_t)linear * WGMMA_MAX_PENDING;
  unsigned keep = 0;
  for (unsigned r = 0; r < wt.count; ++r) {
    if (wt.commits - slots[r].group > n) {
      std::memcpy(slots[r].d, slots[r].v, slots[r].regs * sizeof(float));
    } else {
      if (keep != r) slots[keep] = slots[r];
      ++keep;
    }
  }
  wt.count = keep;
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}: `a` = the four A registers (register
// form) or nullptr (A from desc_a).
__attribute__((noinline, noipa)) inline void wgmma(float* d, int n, int type, const unsigned* a,
                                                   unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                                                   int trans_a, int trans_b) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  const unsigned group = f->linear / 128, th = f->linear % 128;
  if (n < 8 || n > 256 || n % 8) fail("wgmma.mma_async: N = %d; it must be a multiple of 8 in 8 .. 256", n);
  if (group >= 8) fail("wgmma.mma_async: warpgroup %u; the CPU backend has staging for 8 (1024 threads)", group);
  if ((group + 1) * 128 > w->nthreads)
    fail("wgmma.mma_async: warpgroup %u is incomplete (the block has %u threads; a warpgroup is 128)", group,
         w->nthreads);
  if (((desc_b >> 49) & 7) || (!a && ((desc_a >> 49) & 7)))
    fail("wgmma.mma_async: a matrix descriptor with a nonzero base offset (the CPU backend supports 0 only)");
  WgmmaStage& s = wgmma_stage[group];
  if (s.serial != w->block_serial) {
    s.serial = w->block_serial;
    s.arrived = 0;
  }
  if (s.arrived == 0) {
    s.desc_a = desc_a;
    s.desc_b = desc_b;
    s.n = n;
    s.type = type;
    s.trans_a = trans_a;
    s.trans_b = trans_b;
    s.scale_d = scale_d;
    s.a_regs = a != nullptr;
  } else if (s.desc_b != desc_b || s.n != n || s.type != type || s.trans_b != trans_b || s.a_regs != (a != nullptr) ||
             (!a && (s.desc_a != desc_a || s.trans_a != trans_a)) || (s.scale_d != 0) != (scale_d != 0)) {
    fail("wgmma.mma_async: the threads of warpgroup %u disagree on the shape, type, descriptors or scale-d", group);
  }
  s.call[th].d = d;
  s.call[th].a = a;
  if (++s.arrived < 128) {
    f->state = F_WARP;
    block_current(w, "wgmma.mma_async (a warpgroup-wide instruction)");
    return;
  }
  s.arrived = 0;
  wgmma_compute(w, s, group);
  unsigned waking[128], k = 0;
  for (unsigned i = 0; i < 128; ++i)
    if (i != th) waking[k++] = group * 128 + i;
  schedule_order(w->sched, w->rng, waking, k);
  for (unsigned i = 0; i < k; ++i) {
    w->fibers[waking[i]].state = F_READY;
    w->push_ready(waking[i]);
  }
}

// The descriptor of shared-memory operand `p` (CPU: its offset in dynamic shared memory).
inline unsigned long long wgmma_desc(const void* p, unsigned lbo, unsigned sbo, unsigned swizzle) {
  Worker* w = tls_w;
  const size_t off = (size_t)(static_cast<const unsigned char*>(p) - static_cast<unsigned char*>(w->dyn_smem));
  if (!w->dyn_smem || off >= w->dyn_smem_len)
    fail("wgmma descriptor: %p is not in the block's dynamic shared memory (the CPU backend's wgmma reads operands "
         "from there only)", p);
  if (off % 16 || lbo % 16 || sbo % 16 || off >> 18 || lbo >> 18 || sbo >> 18)
    fail("wgmma descriptor: address %zu, LBO %u, SBO %u: each must be a multiple of 16 below 2^18", off, lbo, sbo);
  const unsigned long long mode = swizzle == 128 ? 1 : swizzle == 64 ? 2 : swizzle == 32 ? 3 : 0;
  if (swizzle && !mode) fail("wgmma descriptor: swizzle %u; it must be 0, 32, 64 or 128 bytes", swizzle);
  return (unsigned long long)(off >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (mode << 62);
}

}  // namespace kgen_simt
