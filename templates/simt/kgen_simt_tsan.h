// kgen SIMT runtime, part 5: the compiler's -fsanitize=thread callbacks, kgen's own.
//
// Libraries built with KGEN_SIMT_RACECHECK (kgen.compile.host, race_check=True) have two
// translation units: the kernel source, compiled with -fsanitize=thread, and the runtime
// (KGEN_SIMT_RUNTIME_TU), compiled without it and linked first, so the out-of-line
// runtime (scheduler, warp operations, launch) is the uninstrumented copy. The library is
// linked WITHOUT the TSan runtime; the definitions below take its place. Plain accesses
// feed the shared-memory race detector (kgen_simt_race.h); atomics are performed
// (sequentially consistent) and recorded as atomic accesses.
#pragma once
#if defined(KGEN_SIMT_RACECHECK) && defined(KGEN_SIMT_RUNTIME_TU)
#include <dlfcn.h>

// Not inline: the calls appear only after instrumentation, so nothing else would emit them
// (this header is part of exactly one translation unit, the generated shim).
#define KGEN_TSAN_CB extern "C" __attribute__((no_sanitize_thread, used, visibility("hidden")))

namespace kgen_simt {

// "{pc:0xOFFSET}" (offset of the access inside this library, for kgen to turn into file:line).
inline void race_pc_token(uintptr_t pc, char* buf, size_t n) {
  Dl_info info;
  uintptr_t base = dladdr((void*)pc, &info) && info.dli_fbase ? (uintptr_t)info.dli_fbase : 0;
  snprintf(buf, n, "{pc:0x%lx}", (unsigned long)(pc - 1 - base));  // inside the call instruction
}

inline const char* race_verb(unsigned char kind, bool past) {
  switch (kind) {
    case ACC_READ: return past ? "read" : "reads";
    case ACC_WRITE: return past ? "wrote" : "writes";
    case ACC_ATOMIC_READ: return past ? "atomically read" : "atomically reads";
    default: return past ? "atomically updated" : "atomically updates";
  }
}

// Report the race and leave the block (like fail()).
[[noreturn]] __attribute__((noinline, no_sanitize_thread)) inline void race_report(
    Worker* w, const RaceConflict& c, unsigned char kind, uintptr_t pc) {
  const RaceState& r = w->race;
  char where[96];
  if (c.addr - r.tls_lo < r.tls_len)
    snprintf(where, sizeof where, "{tls:0x%lx}", (unsigned long)(c.addr - r.tls_lo));
  else
    snprintf(where, sizeof where, "dynamic shared memory (byte %lu)", (unsigned long)(c.addr - r.dyn_lo));
  char pc_now[48], pc_prev[48], t_now[64], t_prev[64];
  race_pc_token(pc, pc_now, sizeof pc_now);
  race_pc_token(c.prev->pc, pc_prev, sizeof pc_prev);
  thread_name(w, r.as_tid >= 0 ? (unsigned)r.as_tid : w->cur->linear, t_now, sizeof t_now);
  thread_name(w, c.prev->tid, t_prev, sizeof t_prev);
  char msg[1024];
  snprintf(msg, sizeof msg,
           "kernel '%s' block (%u,%u,%u): shared-memory race on %s: thread %s %s it at %s and thread %s %s it "
           "at %s, with no __syncthreads() (or __syncwarp() of both, or mbarrier phase) between the two accesses "
           "(thread schedule: %s)",
           w->kernel, w->block_idx.x, w->block_idx.y, w->block_idx.z, where, t_now, race_verb(kind, false), pc_now,
           t_prev, race_verb(c.prev->kind, true), pc_prev, schedule_name(w->sched));
  w->err.assign(msg);
  w->failed = true;
  switch_ctx(w, w->cur, nullptr, true);
  __builtin_trap();
}

__attribute__((always_inline, no_sanitize_thread)) inline void race_hook(const volatile void* a, size_t n,
                                                                        unsigned char kind, void* ret) {
  Worker* w = tls_w;
  if (!w || !w->race.on || !w->in_block) return;
  RaceState& r = w->race;
  const uintptr_t addr = (uintptr_t)a;
  if (addr - r.tls_lo >= r.tls_len && addr - r.dyn_lo >= r.dyn_len) return;  // not shared memory
  RaceConflict c{nullptr, 0};
  const unsigned t = r.as_tid >= 0 ? (unsigned)r.as_tid : w->cur->linear;
  if (r.access(t, addr, n, kind, (uintptr_t)ret, c)) race_report(w, c, kind, (uintptr_t)ret);
}

}  // namespace kgen_simt

#define KGEN_TSAN_ACCESS(N)                                                                                   \
  KGEN_TSAN_CB void __tsan_read##N(void* a) {                                                                \
    ::kgen_simt::race_hook(a, N, ::kgen_simt::ACC_READ, __builtin_return_address(0));                       \
  }                                                                                                          \
  KGEN_TSAN_CB void __tsan_write##N(void* a) {                                                               \
    ::kgen_simt::race_hook(a, N, ::kgen_simt::ACC_WRITE, __builtin_return_address(0));                      \
  }                                                                                                          \
  KGEN_TSAN_CB void __tsan_unaligned_read##N(void* a) {                                                      \
    ::kgen_simt::race_hook(a, N, ::kgen_simt::ACC_READ, __builtin_return_address(0));                       \
  }                                                                                                          \
  KGEN_TSAN_CB void __tsan_unaligned_write##N(void* a) {                                                     \
    ::kgen_simt::race_hook(a, N, ::kgen_simt::ACC_WRITE, __builtin_return_address(0));                      \
  }                                                                                                          \
  KGEN_TSAN_CB void __tsan_volatile_read##N(void* a) {                                                       \
    ::kgen_simt::race_hook(a, N, ::kgen_simt::ACC_READ, __builtin_return_address(0));                       \
  }                                                                                                          \
  KGEN_TSAN_CB void __tsan_volatile_write##N(void* a) {                                                      \
    ::kgen_simt::race_hook(a, N, ::kgen_simt::ACC_WRITE, __builtin_return_address(0));                      \
  }
KGEN_TSAN_ACCESS(1)
KGEN_TSAN_ACCESS(2)
KGEN_TSAN_ACCESS(4)
KGEN_TSAN_ACCESS(8)
KGEN_TSAN_ACCESS(16)
#undef KGEN_TSAN_ACCESS

KGEN_TSAN_CB void __tsan_read_range(void* a, unsigned long n) {
  ::kgen_simt::race_hook(a, n, ::kgen_simt::ACC_READ, __builtin_return_address(0));
}
KGEN_TSAN_CB void __tsan_write_range(void* a, unsigned long n) {
  ::kgen_simt::race_hook(a, n, ::kgen_simt::ACC_WRITE, __builtin_return_address(0));
}
KGEN_TSAN_CB void __tsan_init() {}
KGEN_TSAN_CB void __tsan_func_entry(void*) {}
KGEN_TSAN_CB void __tsan_func_exit() {}
KGEN_TSAN_CB void __tsan_vptr_update(void**, void*) {}
KGEN_TSAN_CB void __tsan_vptr_read(void**) {}
KGEN_TSAN_CB void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
KGEN_TSAN_CB void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// Atomics (memory orders are taken as sequentially consistent).
#define KGEN_TSAN_ATOMIC_RW(T, a, kind) \
  ::kgen_simt::race_hook(a, sizeof(T), ::kgen_simt::kind, __builtin_return_address(0))
#define KGEN_TSAN_FETCH(N, T, OP)                                                       \
  KGEN_TSAN_CB T __tsan_atomic##N##_fetch_##OP(volatile T* a, T v, int) {             \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_WRITE);                                         \
    return __atomic_fetch_##OP(a, v, __ATOMIC_SEQ_CST);                                  \
  }
#define KGEN_TSAN_ATOMICS(N, T)                                                                              \
  KGEN_TSAN_CB T __tsan_atomic##N##_load(const volatile T* a, int) {                                       \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_READ);                                                              \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                             \
  }                                                                                                          \
  KGEN_TSAN_CB void __tsan_atomic##N##_store(volatile T* a, T v, int) {                                    \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_WRITE);                                                             \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                \
  }                                                                                                          \
  KGEN_TSAN_CB T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                    \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_WRITE);                                                             \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                      \
  }                                                                                                          \
  KGEN_TSAN_FETCH(N, T, add)                                                                                 \
  KGEN_TSAN_FETCH(N, T, sub)                                                                                 \
  KGEN_TSAN_FETCH(N, T, and)                                                                                 \
  KGEN_TSAN_FETCH(N, T, or)                                                                                  \
  KGEN_TSAN_FETCH(N, T, xor)                                                                                 \
  KGEN_TSAN_FETCH(N, T, nand)                                                                                \
  KGEN_TSAN_CB int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {        \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_WRITE);                                                             \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                 \
  }                                                                                                          \
  KGEN_TSAN_CB int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {          \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_WRITE);                                                             \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                  \
  }                                                                                                          \
  KGEN_TSAN_CB T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {              \
    KGEN_TSAN_ATOMIC_RW(T, a, ACC_ATOMIC_WRITE);                                                             \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                       \
    return c;                                                                                                \
  }
KGEN_TSAN_ATOMICS(8, char)
KGEN_TSAN_ATOMICS(16, short)
KGEN_TSAN_ATOMICS(32, int)
KGEN_TSAN_ATOMICS(64, long)
#undef KGEN_TSAN_ATOMICS
#undef KGEN_TSAN_FETCH
#undef KGEN_TSAN_ATOMIC_RW
#undef KGEN_TSAN_CB

// The runtime's entry points from kernel code and the launch shim: emitted here, uninstrumented.
extern "C" __attribute__((used, visibility("hidden"))) void* const kgen_simt_runtime_entry_points[] = {
    (void*)&::kgen_simt::launch, (void*)&::kgen_simt::syncthreads_count, (void*)&::kgen_simt::warp_op,
    (void*)&::kgen_simt::write_err, (void*)&::kgen_simt::dynamic_smem_ptr, (void*)&::kgen_simt::mbar_init,
    (void*)&::kgen_simt::mbar_inval, (void*)&::kgen_simt::mbar_arrive, (void*)&::kgen_simt::mbar_tx,
    (void*)&::kgen_simt::mbar_wait, (void*)&::kgen_simt::mbar_test_wait, (void*)&::kgen_simt::bulk_copy,
    (void*)&::kgen_simt::wgmma, (void*)&::kgen_simt::wgmma_commit, (void*)&::kgen_simt::wgmma_wait};

#endif  // KGEN_SIMT_RACECHECK && KGEN_SIMT_RUNTIME_TU
