// kgen SIMT runtime, part 4: thread schedules and shared-memory race detection.
//
// Schedules: the order in which a block's fibers start, leave a barrier and leave a
// warp operation. FIFO is the default; reverse and a seeded shuffle make bugs that
// depend on that order show (see kgen_simt_sched.h for where the order is applied).
//
// Race detection (libraries built with KGEN_SIMT_RACECHECK: g++ -fsanitize=thread with
// kgen's own callbacks in kgen_simt_tsan.h instead of the TSan runtime, which fibers
// would break): every load and store the compiler emits reports its address; those
// inside the block's shared memory (static __shared__ arrays are thread_local, so: this
// library's TLS block; and the dynamic shared-memory buffer) update a shadow word per
// 4 bytes. Two accesses race when they come from different threads of the block, touch
// a common byte, at least one writes, not both are atomics, and nothing orders them:
// a __syncthreads between them (the block's barrier interval, `epoch`, differs) or a
// __syncwarp chain inside one warp, or an mbarrier phase between warps (per-thread vector
// clocks over the block's threads and their async proxies: kgen_simt_hopper.h). A thread's
// async proxy (tid nthreads + t) performs its bulk copies (cp.async.bulk): its writes are ordered after
// what the thread did before the issue and before what a waiter of the copy's mbarrier does.
#pragma once
#include <link.h>
#include <cstdint>
#include <cstring>
#include <vector>

// The detector's hot path is called from every instrumented access: not instrumented itself.
#define KGEN_SIMT_NOTSAN __attribute__((no_sanitize_thread))

namespace kgen_simt {

enum Schedule : int { SCHEDULE_DEFAULT = 0, SCHEDULE_FIFO = 1, SCHEDULE_REVERSE = 2, SCHEDULE_SHUFFLE = 3, SCHEDULE_MIXED = 4 };

inline const char* schedule_name(int s) {
  switch (s) {
    case SCHEDULE_REVERSE: return "reverse";
    case SCHEDULE_SHUFFLE: return "shuffle";
    default: return "fifo";
  }
}

// splitmix64: seeds one block's shuffle from (seed, block) so a schedule does not depend
// on which worker runs the block.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t s = 1;
  unsigned below(unsigned n) { s = mix64(s); return (unsigned)(s % n); }
};

// Put `v[0..n)` (thread indices, ascending) in the order of schedule `mode`.
inline void schedule_order(int mode, Rng& rng, unsigned* v, unsigned n) {
  if (mode == SCHEDULE_REVERSE) {
    for (unsigned i = 0, j = n; i + 1 < j; ++i, --j) { unsigned t = v[i]; v[i] = v[j - 1]; v[j - 1] = t; }
  } else if (mode == SCHEDULE_SHUFFLE) {
    for (unsigned i = n; i > 1; --i) { unsigned j = rng.below(i); unsigned t = v[i - 1]; v[i - 1] = v[j]; v[j] = t; }
  }
}

enum AccessKind : unsigned char { ACC_READ = 0, ACC_WRITE = 1, ACC_ATOMIC_READ = 2, ACC_ATOMIC_WRITE = 3 };
inline bool acc_writes(unsigned char k) { return k & 1; }
inline bool acc_atomic(unsigned char k) { return k & 2; }

// Plain data (no constructors: an instrumented constructor would not inline into the
// uninstrumented detector). Zero = nothing recorded.
struct RaceAccess {
  uint32_t epoch;   // barrier interval of the block (0: no access recorded)
  uint32_t clk;     // the thread's warp-sync clock at the access
  uint16_t tid;     // linear thread index in the block
  uint8_t mask;     // bytes of the word touched
  uint8_t kind;     // AccessKind
  uintptr_t pc;     // return address of the instrumentation call
};

struct ShadowWord {
  RaceAccess w;     // last write
  RaceAccess r[2];  // reads since it (two threads' worth)
};

struct RaceConflict {
  const RaceAccess* prev;  // the earlier access, not ordered before this one
  uintptr_t addr;          // first byte of the word both touch
};

struct RaceState {
  bool on = false;
  uintptr_t tls_lo = 0, tls_len = 0;    // this library's TLS block in this OS thread (static __shared__)
  uintptr_t skip_lo = 0, skip_hi = 0;   // the runtime's own thread_local (read by threadIdx): not shared memory
  uintptr_t dyn_lo = 0, dyn_len = 0;    // dynamic shared memory of the running block
  uint32_t epoch = 0;
  std::vector<ShadowWord> shadow;       // TLS words, then dynamic shared-memory words
  std::vector<uint32_t> clk;            // per thread (and per async proxy)
  std::vector<uint32_t> vc;             // per thread: the clocks of the n threads it has synced with
  ShadowWord* sh = nullptr;             // the vectors' data (no std:: calls on the hot path)
  uint32_t* clkp = nullptr;
  uint32_t* vcp = nullptr;
  unsigned n = 0;                       // vector-clock width: 2 * nthreads (threads, then their proxies)
  bool wide = false;                    // an mbarrier or bulk copy ordered threads of different warps
  int as_tid = -1;                      // >= 0: accesses are that proxy's (a bulk copy landing)

  void resize_shadow(size_t words) {
    if (shadow.size() < words) shadow.resize(words);
    sh = shadow.data();
  }

  size_t tls_words() const { return (tls_len + 3) / 4 + 1; }
  size_t dyn_words() const { return (dyn_len + 3) / 4 + 1; }

  void next_epoch() {
    if (++epoch == 0) {  // wrapped: forget everything
      std::memset(shadow.data(), 0, shadow.size() * sizeof(ShadowWord));
      epoch = 1;
    }
  }

  // Called by run_block (launch side: may allocate). Until a block uses an mbarrier only the
  // entries of a thread's own warp are ever set, so only those are cleared.
  void begin_block(unsigned nthreads) {
    next_epoch();
    const unsigned width = 2 * nthreads;
    clk.assign(width, 1u);
    if (n != width || vc.size() != (size_t)width * width) {
      vc.assign((size_t)width * width, 0u);
    } else if (wide) {
      std::memset(vc.data(), 0, vc.size() * sizeof(uint32_t));
    } else {
      for (unsigned t = 0; t < nthreads; ++t) {
        const unsigned lo = t & ~31u, len = width - lo < 32 ? width - lo : 32;  // (blocks under 16 threads)
        std::memset(&vc[(size_t)t * width + lo], 0, len * sizeof(uint32_t));
      }
    }
    n = width;
    wide = false;
    as_tid = -1;
    clkp = clk.data();
    vcp = vc.data();
  }

  // Entries [lo, hi) a join must cover: the warp's lanes until cross-warp ordering exists.
  void join_range(unsigned warp, unsigned& lo, unsigned& hi) const {
    lo = wide ? 0 : warp * 32;
    hi = wide || warp * 32 + 32 > n ? n : warp * 32 + 32;
  }

  // A completed __syncwarp(mask) of warp `warp`: every lane of the mask has seen what every
  // other lane of the mask did before it.
  void syncwarp(unsigned warp, unsigned mask) {
    unsigned lo, hi;
    join_range(warp, lo, hi);
    // fold every lane's clock vector into the first lane's row, then copy it to the others
    const unsigned first = warp * 32 + __builtin_ctz(mask);
    uint32_t* acc = vcp + (size_t)first * n;
    for (unsigned m = mask & (mask - 1); m; m &= m - 1) {
      const uint32_t* v = vcp + (size_t)(warp * 32 + __builtin_ctz(m)) * n;
      for (unsigned k = lo; k < hi; ++k) acc[k] = acc[k] > v[k] ? acc[k] : v[k];
    }
    for (unsigned m = mask; m; m &= m - 1) {
      const unsigned t = warp * 32 + __builtin_ctz(m);
      if (clkp[t] > acc[t]) acc[t] = clkp[t];
    }
    for (unsigned m = mask & (mask - 1); m; m &= m - 1) {
      uint32_t* v = vcp + (size_t)(warp * 32 + __builtin_ctz(m)) * n;
      for (unsigned k = lo; k < hi; ++k) v[k] = acc[k];
    }
    for (unsigned m = mask; m; m &= m - 1) ++clkp[warp * 32 + __builtin_ctz(m)];
  }

  // Release: `into` (a vector of n clocks) takes what thread t has seen and t's own clock.
  void release(unsigned t, uint32_t* into) {
    wide = true;
    const uint32_t* v = vcp + (size_t)t * n;
    for (unsigned k = 0; k < n; ++k) into[k] = into[k] > v[k] ? into[k] : v[k];
    if (clkp[t] > into[t]) into[t] = clkp[t];
    ++clkp[t];
  }
  // Acquire: thread t has seen everything `from` holds.
  void acquire(unsigned t, const uint32_t* from) {
    wide = true;
    uint32_t* v = vcp + (size_t)t * n;
    for (unsigned k = 0; k < n; ++k) v[k] = v[k] > from[k] ? v[k] : from[k];
  }

  KGEN_SIMT_NOTSAN bool ordered(const RaceAccess& a, unsigned t) const {
    if (a.epoch != epoch || a.tid == t) return true;
    return vcp[(size_t)t * n + a.tid] >= a.clk;
  }

  KGEN_SIMT_NOTSAN bool conflicts(const RaceAccess& a, unsigned t, unsigned char mask, unsigned char kind) const {
    if (a.epoch != epoch || !(a.mask & mask)) return false;
    if (!acc_writes(a.kind) && !acc_writes(kind)) return false;
    if (acc_atomic(a.kind) && acc_atomic(kind)) return false;
    return !ordered(a, t);
  }

  // Shadow word of `addr` (nullptr: not shared memory).
  KGEN_SIMT_NOTSAN ShadowWord* word(uintptr_t addr) {
    if (addr - tls_lo < tls_len) {
      if (addr >= skip_lo && addr < skip_hi) return nullptr;
      return sh + (addr / 4 - tls_lo / 4);
    }
    if (addr - dyn_lo < dyn_len) return sh + ((tls_len + 3) / 4 + 1) + (addr / 4 - dyn_lo / 4);
    return nullptr;
  }

  // Record thread t's access of `size` bytes at `addr`; a race fills `out` and returns true.
  KGEN_SIMT_NOTSAN bool access(unsigned t, uintptr_t addr, size_t size, unsigned char kind, uintptr_t pc, RaceConflict& out) {
    if (size == 0) return false;
    const uintptr_t end = addr + size;
    for (uintptr_t a = addr & ~(uintptr_t)3; a < end; a += 4) {
      ShadowWord* s = word(a < addr ? addr : a);
      if (!s) continue;
      const uintptr_t lo = a < addr ? addr : a, hi = a + 4 < end ? a + 4 : end;
      const unsigned char mask = (unsigned char)(((1u << (hi - a)) - 1u) & ~((1u << (lo - a)) - 1u));
      if (conflicts(s->w, t, mask, kind)) { out.prev = &s->w; out.addr = a; return true; }
      RaceAccess cur;
      cur.epoch = epoch;
      cur.clk = clkp[t];
      cur.tid = (uint16_t)t;
      cur.mask = mask;
      cur.kind = kind;
      cur.pc = pc;
      if (acc_writes(kind)) {
        for (const RaceAccess& r : s->r)
          if (conflicts(r, t, mask, kind)) { out.prev = &r; out.addr = a; return true; }
        s->w = cur;
        s->r[0].epoch = s->r[1].epoch = 0;  // each was ordered before this write (or both atomic)
      } else {
        RaceAccess* slot = nullptr;
        for (RaceAccess& r : s->r)
          if (r.epoch == epoch && r.tid == t) { cur.mask |= r.mask; slot = &r; break; }
        if (!slot)
          for (RaceAccess& r : s->r)
            if (r.epoch != epoch || (ordered(r, t) && !(r.mask & ~mask))) { slot = &r; break; }
        if (slot) *slot = cur;  // else: two other unordered readers are kept, this one is not
      }
    }
    return false;
  }
};

// This OS thread's copy of the TLS block (PT_TLS segment) of the module holding `inside`.
inline bool find_tls_block(const void* inside, uintptr_t* lo, uintptr_t* len) {
  struct Q { uintptr_t at, lo, len; } q{(uintptr_t)inside, 0, 0};
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        Q* q = static_cast<Q*>(data);
        if (!info->dlpi_tls_data) return 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          if (info->dlpi_phdr[i].p_type != PT_TLS) continue;
          uintptr_t b = (uintptr_t)info->dlpi_tls_data, n = info->dlpi_phdr[i].p_memsz;
          if (q->at >= b && q->at < b + n) { q->lo = b; q->len = n; return 1; }
        }
        return 0;
      },
      &q);
  *lo = q.lo;
  *len = q.len;
  return q.len != 0;
}

}  // namespace kgen_simt
