// kgen SIMT runtime, part 1: fibers and the per-block scheduler.
//
// A worker (one OS thread) runs one thread block at a time: one fiber per CUDA
// thread, all on that OS thread. A fiber runs until it reaches a barrier, a warp
// operation or its end; then the next ready fiber runs (FIFO ready queue). The order
// in which fibers start and are released from barriers and warp operations follows
// the block's schedule (FIFO by default; reverse or shuffled: kgen_simt_race.h).
// A wait that can never be satisfied is reported as an error naming the kernel,
// block and thread, and the block is abandoned (no hang, no abort()).
#pragma once
#include <sys/mman.h>
#include <unistd.h>
#include <pthread.h>
#include <cstdio>
#include <cstdlib>
#include <cstdarg>
#include <string>
#include <memory>
#include <vector>

#include "kgen_simt_race.h"
#include "kgen_simt_async.h"
#include "kgen_simt_mbar.h"

#if defined(__SANITIZE_ADDRESS__)
#define KGEN_SIMT_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && !defined(KGEN_SIMT_UCONTEXT)
#define KGEN_SIMT_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif
#include <setjmp.h>
#include <signal.h>

namespace kgen_simt {

enum : unsigned char { F_READY, F_RUNNING, F_BARRIER, F_WARP, F_DONE, F_MBAR };
enum WarpOpKind : int {
  OP_SYNCWARP, OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR,
  OP_VOTE_ANY, OP_VOTE_ALL, OP_VOTE_BALLOT,
};
inline const char* op_name(int op) {
  static const char* names[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__any_sync", "__all_sync", "__ballot_sync"};
  return (op >= 0 && op <= OP_VOTE_BALLOT) ? names[op] : "?";
}

struct Fiber {
  void* sp = nullptr;  // saved stack pointer (x86-64 switch)
#if !defined(KGEN_SIMT_ASM_SWITCH)
  ucontext_t uc;
#endif
  uint3 tid;
  unsigned linear = 0, lane = 0, warp = 0;
  unsigned char state = F_READY;
  // warp-operation mailbox
  int op = 0, arg = 0, width = 32;
  unsigned mask = 0;
  unsigned long long val = 0, res = 0;
  const void* mbar = nullptr;  // F_MBAR: the mbarrier waited on, and the parity of the phase awaited
  unsigned mbar_parity = 0;
  char* stack_lo = nullptr;
  size_t stack_size = 0;
};

struct WarpGroup {
  unsigned mask, arrived;
  int op;
};

struct WarpState {
  unsigned exist = 0;   // lanes that exist in this block
  unsigned exited = 0;  // lanes whose thread has returned
  unsigned ngroups = 0;
  WarpGroup groups[32];
};

struct Worker {
  // launch-wide
  const char* kernel = "";
  dim3 grid_dim, block_dim;
  void (*body)(void*) = nullptr;
  void* body_ctx = nullptr;
  void* dyn_smem = nullptr;
  size_t dyn_smem_len = 0;
  // block-wide
  uint3 block_idx;
  unsigned nthreads = 0, nwarps = 0;
  Fiber* cur = nullptr;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<unsigned> ready;  // ring buffer of fiber indices
  unsigned rq_head = 0, rq_count = 0;
  std::vector<unsigned> bar_list;  // fibers waiting at __syncthreads, in arrival order
  unsigned bar_count = 0;
  unsigned n_exited = 0;
  void* main_sp = nullptr;
#if !defined(KGEN_SIMT_ASM_SWITCH)
  ucontext_t main_uc;
#endif
  bool failed = false;
  std::string err;
  // thread schedule of the running block, and race detection (kgen_simt_race.h)
  int sched = SCHEDULE_FIFO;
  Rng rng;
  std::vector<unsigned> order;
  RaceState race;
  std::vector<AsyncQueue> async;  // per thread: its pending cp.async copies (kgen_simt_async.h)
  std::unique_ptr<AsyncCopy[]> async_slots;  // their storage, ASYNC_MAX_PENDING per thread
  HopperState hop;                           // mbarriers and bulk copies (kgen_simt_hopper.h)
  unsigned long long block_serial = 0;       // blocks this worker has started (stale staging areas)
  std::unique_ptr<BulkCopy[]> bulk_slots;
  std::unique_ptr<WgmmaPending[]> wgmma_slots;
  std::vector<WgmmaThread> wgmma_threads;
  unsigned wgmma_capacity = 0;
  std::vector<uint32_t> hop_vc;
  // stacks
  char* stack_mem = nullptr;
  size_t stack_mem_len = 0, stack_size = 0;
  unsigned stack_count = 0;
  Worker* next_worker = nullptr;  // the library's list of workers (stacks kept between launches)
  sigjmp_buf overflow_jb;  // run_block's landing point after a fiber stack overflow
  volatile bool in_block = false;
#if defined(KGEN_SIMT_ASAN)
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
#endif

  void push_ready(unsigned i) {
    unsigned slot = rq_head + rq_count;
    if (slot >= nthreads) slot -= nthreads;
    ready[slot] = i;
    ++rq_count;
  }
  unsigned pop_ready() {
    unsigned i = ready[rq_head];
    if (++rq_head == nthreads) rq_head = 0;
    --rq_count;
    return i;
  }
};

inline thread_local Worker* tls_w = nullptr;

inline void* dynamic_smem_ptr() { return tls_w->dyn_smem; }

// ---- context switch ---------------------------------------------------------
#if defined(KGEN_SIMT_ASM_SWITCH)
// Saves the callee-saved registers of the System V ABI on the current stack, stores
// the stack pointer in *save_sp, loads new_sp and pops the other context's registers.
__attribute__((naked, noinline)) static void kgen_switch_raw(void** /*save_sp*/, void* /*new_sp*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
#endif

void fiber_entry();

// Switch from the running context (fiber `from`, or the worker's main context when
// from == nullptr) to fiber `to` (or main when to == nullptr).
// `final_switch`: the current fiber never runs again (ASan may drop its fake stack).
__attribute__((noinline)) inline void switch_ctx(Worker* w, Fiber* from, Fiber* to, bool final_switch = false) {
#if defined(KGEN_SIMT_ASAN)
  void* fake = nullptr;
  const void* bottom = to ? (const void*)to->stack_lo : w->main_stack_bottom;
  size_t size = to ? to->stack_size : w->main_stack_size;
  __sanitizer_start_switch_fiber(final_switch ? nullptr : &fake, bottom, size);
#else
  (void)final_switch;
#endif
#if defined(KGEN_SIMT_ASM_SWITCH)
  kgen_switch_raw(from ? &from->sp : &w->main_sp, to ? to->sp : w->main_sp);
#else
  swapcontext(from ? &from->uc : &w->main_uc, to ? &to->uc : &w->main_uc);
#endif
#if defined(KGEN_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  asm volatile("" ::: "memory");
}

// ---- errors -----------------------------------------------------------------
// Records "kernel 'k' block (x,y,z) thread (x,y,z): <msg>" and leaves the block for good.
[[noreturn]] __attribute__((noinline)) inline void fail(const char* fmt, ...) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char head[512];
  snprintf(head, sizeof head, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): ", w->kernel, w->block_idx.x,
           w->block_idx.y, w->block_idx.z, f->tid.x, f->tid.y, f->tid.z);
  w->err.assign(head);
  w->err.append(msg);
  w->failed = true;
  switch_ctx(w, f, nullptr, true);
  __builtin_trap();  // never resumed
}

inline void thread_name(Worker* w, unsigned linear, char* buf, size_t n) {
  if (linear >= w->nthreads) {  // a thread's async proxy (race detection: its bulk copies)
    const Fiber& f = w->fibers[linear - w->nthreads];
    snprintf(buf, n, "(the bulk copy issued by thread (%u,%u,%u))", f.tid.x, f.tid.y, f.tid.z);
    return;
  }
  const Fiber& f = w->fibers[linear];
  snprintf(buf, n, "(%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z);
}

// The mbarriers threads are blocked on, and what each one's phase still awaits ("" when none).
inline void mbar_wait_story(Worker* w, char* buf, size_t n) {
  buf[0] = 0;
  size_t used = 0;
  for (unsigned b = 0; b < w->hop.nbars && used + 1 < n; ++b) {
    const Mbar& m = w->hop.bars[b];
    if (!m.live) continue;
    unsigned waiters = 0, first = 0;
    for (unsigned i = w->nthreads; i-- > 0;)
      if (w->fibers[i].state == F_MBAR && w->fibers[i].mbar == m.addr) ++waiters, first = i;
    if (!waiters) continue;
    const Fiber& f = w->fibers[first];
    int k = snprintf(buf + used, n - used,
                     "; %u thread(s) from (%u,%u,%u) wait for phase parity %u of the mbarrier at %p, whose phase %u "
                     "still awaits %u of %u arrival(s) and %lld transaction byte(s)",
                     waiters, f.tid.x, f.tid.y, f.tid.z, f.mbar_parity, m.addr, m.phase, m.pending, m.expected, m.tx);
    if (k < 0) break;
    used += (size_t)k < n - used ? (size_t)k : n - used - 1;
  }
}

// Nothing is ready but the current fiber cannot go on: describe why and fail.
[[noreturn]] __attribute__((noinline)) inline void deadlock(const char* what) {
  Worker* w = tls_w;
  unsigned at_bar = w->bar_count, in_warp = 0, at_mbar = 0;
  for (unsigned i = 0; i < w->nthreads; ++i) {
    in_warp += w->fibers[i].state == F_WARP;
    at_mbar += w->fibers[i].state == F_MBAR;
  }
  char story[768];
  mbar_wait_story(w, story, sizeof story);
  fail("%s can never complete: no thread of the block can make progress (%u at __syncthreads, %u in warp "
       "operations, %u waiting on mbarriers, %u exited, of %u)%s",
       what, at_bar, in_warp, at_mbar, w->n_exited, w->nthreads, story);
}

// The current fiber has set its wait state; run the next ready fiber.
inline void block_current(Worker* w, const char* what) {
  if (w->rq_count == 0) deadlock(what);
  Fiber* f = w->cur;
  Fiber* n = &w->fibers[w->pop_ready()];
  w->cur = n;
  n->state = F_RUNNING;
  switch_ctx(w, f, n);
  // resumed: whoever switched to us has set w->cur = f
}

// The current fiber is in the ready queue: run the queue's head (which may be itself).
inline void yield_current(Worker* w) {
  Fiber* f = w->cur;
  Fiber* n = &w->fibers[w->pop_ready()];
  n->state = F_RUNNING;
  if (n == f) return;
  w->cur = n;
  switch_ctx(w, f, n);
}

// ---- __syncthreads ----------------------------------------------------------
// Block barrier; returns how many threads passed a nonzero `pred` (__syncthreads_count).
__attribute__((noinline, noipa)) inline int syncthreads_count(int pred) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  if (w->n_exited) {
    unsigned ex = 0;
    while (w->fibers[ex].state != F_DONE) ++ex;
    char nm[64];
    thread_name(w, ex, nm, sizeof nm);
    fail("__syncthreads() can never complete: thread %s (and %u other(s)) of the block already exited", nm,
         w->n_exited - 1);
  }
  f->val = pred != 0;
  if (w->bar_count + 1 == w->nthreads) {  // last to arrive: release everybody
    unsigned long long count = f->val;
    for (unsigned i = 0; i < w->bar_count; ++i) count += w->fibers[w->bar_list[i]].val;
    if (w->race.on) w->race.next_epoch();
    const unsigned n = w->bar_count;
    w->bar_count = 0;
    if (w->sched == SCHEDULE_FIFO) {  // the others in arrival order; the last to arrive goes on
      for (unsigned i = 0; i < n; ++i) {
        unsigned j = w->bar_list[i];
        w->fibers[j].res = count;
        w->fibers[j].state = F_READY;
        w->push_ready(j);
      }
      asm volatile("" ::: "memory");
      return (int)count;
    }
    // Other schedules order every thread of the block, this one included, by thread index
    // (all are here): reverse = highest index first, whatever the arrival order.
    for (unsigned i = 0; i <= n; ++i) w->bar_list[i] = i;
    schedule_order(w->sched, w->rng, w->bar_list.data(), n + 1);
    for (unsigned i = 0; i <= n; ++i) {
      unsigned j = w->bar_list[i];
      w->fibers[j].res = count;
      w->fibers[j].state = F_READY;
      w->push_ready(j);
    }
    yield_current(w);
    return (int)count;
  }
  w->bar_list[w->bar_count++] = f->linear;
  f->state = F_BARRIER;
  block_current(w, "__syncthreads()");
  return (int)f->res;
}

// ---- warp operations ----------------------------------------------------------
// PTX shfl.sync source-lane rule (c = ((32 - width) << 8) | clamp).
inline unsigned shfl_src(int op, unsigned lane, unsigned b, int width) {
  unsigned segmask = (unsigned)(32 - width) & 31u;
  unsigned cval = op == OP_SHFL_UP ? 0u : 31u;
  int max_lane = (int)((lane & segmask) | (cval & ~segmask));
  int min_lane = (int)(lane & segmask);
  int j;
  bool ok;
  b &= 31u;
  switch (op) {
    case OP_SHFL_UP: j = (int)lane - (int)b; ok = j >= max_lane; break;
    case OP_SHFL_DOWN: j = (int)lane + (int)b; ok = j <= max_lane; break;
    case OP_SHFL_XOR: j = (int)(lane ^ b); ok = j <= max_lane; break;
    default: j = min_lane | (int)(b & ~segmask); ok = j <= max_lane; break;
  }
  return ok ? (unsigned)j : lane;
}

inline void complete_group(Worker* w, unsigned warp, const WarpGroup& g) {
  Fiber* base = &w->fibers[warp * 32];
  unsigned mask = g.mask;
  int op = g.op;
  if (op >= OP_VOTE_ANY) {
    unsigned ballot = 0;
    for (unsigned m = mask; m; m &= m - 1) {
      unsigned l = __builtin_ctz(m);
      if (base[l].val) ballot |= 1u << l;
    }
    unsigned long long r = op == OP_VOTE_BALLOT ? ballot : op == OP_VOTE_ANY ? (ballot != 0) : (ballot == mask);
    for (unsigned m = mask; m; m &= m - 1) base[__builtin_ctz(m)].res = r;
  } else if (op != OP_SYNCWARP) {
    for (unsigned m = mask; m; m &= m - 1) {
      unsigned l = __builtin_ctz(m);
      unsigned s = shfl_src(op, l, (unsigned)base[l].arg, base[l].width);
      // A source lane outside the mask is undefined in CUDA; we return the caller's own value.
      base[l].res = (mask >> s) & 1u ? base[s].val : base[l].val;
    }
  }
  if (op == OP_SYNCWARP && w->race.on) w->race.syncwarp(warp, mask);
  Fiber* self = w->cur;
  unsigned waking[32], n = 0;
  for (unsigned m = mask; m; m &= m - 1) {
    Fiber* f = &base[__builtin_ctz(m)];
    if (f != self) waking[n++] = f->linear;
  }
  schedule_order(w->sched, w->rng, waking, n);
  for (unsigned i = 0; i < n; ++i) {
    w->fibers[waking[i]].state = F_READY;
    w->push_ready(waking[i]);
  }
}

__attribute__((noinline, noipa)) inline unsigned long long warp_op(int op, unsigned mask, unsigned long long val,
                                                                   int arg, int width) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  WarpState& ws = w->warps[f->warp];
  unsigned bit = 1u << f->lane;
  if (!(mask & bit))
    fail("%s: the calling lane %u is not in the mask 0x%08x", op_name(op), f->lane, mask);
  if (mask & ~ws.exist)
    fail("%s: mask 0x%08x names lanes that do not exist (this warp has lanes 0x%08x; block has %u threads)",
         op_name(op), mask, ws.exist, w->nthreads);
  if (mask & ws.exited) {
    unsigned l = __builtin_ctz(mask & ws.exited);
    char nm[64];
    thread_name(w, f->warp * 32 + l, nm, sizeof nm);
    fail("%s with mask 0x%08x can never complete: lane %u (thread %s) has exited", op_name(op), mask, l, nm);
  }
  f->val = val;
  f->arg = arg;
  f->width = width;
  f->op = op;
  f->mask = mask;
  WarpGroup* g = nullptr;
  unsigned gi = 0;
  for (; gi < ws.ngroups; ++gi) {
    WarpGroup& c = ws.groups[gi];
    if (c.mask & mask) {
      if (c.mask != mask) {
        if (c.mask & bit)
          fail("%s: lanes of one warp disagree on the mask: this lane passes 0x%08x, others wait with 0x%08x",
               op_name(op), mask, c.mask);
        fail("%s: mask 0x%08x overlaps the mask 0x%08x of a pending warp operation (%s)", op_name(op), mask,
             c.mask, op_name(c.op));
      }
      if (c.op != op)
        fail("lanes of mask 0x%08x call different warp operations: %s here, %s in lanes 0x%08x", mask,
             op_name(op), op_name(c.op), c.arrived);
      if (c.arrived & bit) fail("%s: lane %u arrived twice", op_name(op), f->lane);
      g = &c;
      break;
    }
  }
  if (!g) {
    if (mask == bit) {  // a group of one completes at once
      WarpGroup one{mask, bit, op};
      complete_group(w, f->warp, one);
      return f->res;
    }
    g = &ws.groups[ws.ngroups++];
    g->mask = mask;
    g->arrived = 0;
    g->op = op;
  }
  g->arrived |= bit;
  if (g->arrived == mask) {
    WarpGroup done = *g;
    ws.groups[gi] = ws.groups[--ws.ngroups];
    complete_group(w, f->warp, done);
    asm volatile("" ::: "memory");
    return f->res;
  }
  f->state = F_WARP;
  block_current(w, op_name(op));
  return f->res;
}

// ---- fiber lifecycle ------------------------------------------------------------
[[noreturn]] __attribute__((noinline)) inline void fiber_exit(Worker* w) {
  Fiber* f = w->cur;
  f->state = F_DONE;
  ++w->n_exited;
  WarpState& ws = w->warps[f->warp];
  unsigned bit = 1u << f->lane;
  ws.exited |= bit;
  if (w->bar_count) {
    char nm[64];
    thread_name(w, w->bar_list[0], nm, sizeof nm);
    fail("exited while thread %s (and %u other(s)) wait at __syncthreads(), which can therefore never complete",
         nm, w->bar_count - 1);
  }
  for (unsigned i = 0; i < ws.ngroups; ++i)
    if (ws.groups[i].mask & bit) {
      unsigned l = __builtin_ctz(ws.groups[i].arrived);
      char nm[64];
      thread_name(w, f->warp * 32 + l, nm, sizeof nm);
      fail("exited while thread %s waits in %s with mask 0x%08x naming this lane (%u), which can therefore "
           "never complete",
           nm, op_name(ws.groups[i].op), ws.groups[i].mask, f->lane);
    }
  if (w->rq_count == 0) {
    if (w->n_exited == w->nthreads) {
      switch_ctx(w, f, nullptr, true);
      __builtin_trap();
    }
    deadlock("the block");
  }
  Fiber* n = &w->fibers[w->pop_ready()];
  w->cur = n;
  n->state = F_RUNNING;
  switch_ctx(w, f, n, true);
  __builtin_trap();
}

inline void fiber_entry() {
  Worker* w = tls_w;
#if defined(KGEN_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  w->body(w->body_ctx);
  fiber_exit(w);
}

// ---- stacks ---------------------------------------------------------------------
inline size_t page_size() {
  static size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

// Unmap a worker's stacks: the guard pages split the mapping into two maps per stack.
inline void release_stacks(Worker* w) {
  if (w->stack_mem) munmap(w->stack_mem, w->stack_mem_len);
  w->stack_mem = nullptr;
  w->stack_mem_len = 0;
  w->stack_count = 0;
}

// One mapping holding `count` stacks of `size` bytes, each with a PROT_NONE guard page below it.
inline bool ensure_stacks(Worker* w, unsigned count, size_t size) {
  size_t pg = page_size();
  size = (size + pg - 1) / pg * pg;
  if (w->stack_mem && w->stack_count >= count && w->stack_size == size) return true;
  release_stacks(w);
  size_t slot = size + pg;
  size_t len = slot * count;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  w->stack_mem = (char*)p;
  w->stack_mem_len = len;
  w->stack_size = size;
  w->stack_count = count;
  for (unsigned i = 0; i < count; ++i) mprotect(w->stack_mem + i * slot, pg, PROT_NONE);
  return true;
}

inline void init_fiber(Worker* w, Fiber* f, unsigned i) {
  size_t pg = page_size();
  f->stack_lo = w->stack_mem + i * (w->stack_size + pg) + pg;
  f->stack_size = w->stack_size;
#if defined(KGEN_SIMT_ASAN)
  __asan_unpoison_memory_region(f->stack_lo, f->stack_size);
#endif
#if defined(KGEN_SIMT_ASM_SWITCH)
  uintptr_t top = ((uintptr_t)(f->stack_lo + f->stack_size)) & ~(uintptr_t)15;
  uintptr_t* t = (uintptr_t*)top;
  t[-1] = 0;                           // keeps rsp % 16 == 8 at fiber_entry, as after a call
  t[-2] = (uintptr_t)&fiber_entry;     // `ret` target
  for (int k = 3; k <= 8; ++k) t[-k] = 0;  // rbp rbx r12 r13 r14 r15
  f->sp = (void*)(top - 64);
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack_lo;
  f->uc.uc_stack.ss_size = f->stack_size;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, (void (*)())fiber_entry, 0);
#endif
}

// ---- fiber stack overflow: guard page -> SIGSEGV -> error instead of a crash ----------
// (not under ASan, which reports stack overflows itself). Each library chains to the
// handler that was installed before it for faults that are not its own.
inline struct sigaction g_prev_segv;

inline void segv_handler(int sig, siginfo_t* si, void* uctx) {
  Worker* w = tls_w;
  if (w && w->in_block && w->cur) {
    char* a = (char*)si->si_addr;
    Fiber* f = w->cur;
    if (a >= f->stack_lo - page_size() && a < f->stack_lo) {
      char msg[512];
      snprintf(msg, sizeof msg,
               "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u): fiber stack overflow (stack size %zu bytes); "
               "large per-thread arrays need a bigger stack: CpuModule(stack_size=...) or KGEN_SIMT_STACK",
               w->kernel, w->block_idx.x, w->block_idx.y, w->block_idx.z, f->tid.x, f->tid.y, f->tid.z,
               f->stack_size);
      w->err.assign(msg);  // the worker thread is ours and stopped in a fiber: no allocator lock held by us
      w->failed = true;
      siglongjmp(w->overflow_jb, 1);
    }
  }
  // not ours: hand over to whatever was installed before
  if (g_prev_segv.sa_flags & SA_SIGINFO) {
    if (g_prev_segv.sa_sigaction) {
      g_prev_segv.sa_sigaction(sig, si, uctx);
      return;
    }
  } else if (g_prev_segv.sa_handler != SIG_DFL && g_prev_segv.sa_handler != SIG_IGN) {
    g_prev_segv.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);  // re-executing the faulting instruction now crashes as usual
}

inline void install_overflow_guard() {
#if !defined(KGEN_SIMT_ASAN)
  static bool installed = [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = segv_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    return true;
  }();
  (void)installed;
  // an alternate signal stack for this thread (keep one that exists, e.g. faulthandler's)
  stack_t old;
  if (sigaltstack(nullptr, &old) == 0 && (old.ss_flags & SS_DISABLE)) {
    stack_t ss;
    ss.ss_size = 64 * 1024;
    ss.ss_sp = malloc(ss.ss_size);  // kept for the thread's life
    ss.ss_flags = 0;
    if (ss.ss_sp) sigaltstack(&ss, nullptr);
  }
#endif
}

// Run one thread block to completion (or failure) on the calling OS thread.
inline void run_block(Worker* w, uint3 bidx) {
  w->block_idx = bidx;
  unsigned n = w->nthreads;
  dim3 bd = w->block_dim;
  for (unsigned i = 0; i < n; ++i) {
    Fiber* f = &w->fibers[i];
    f->linear = i;
    f->tid = make_uint3(i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y));
    f->lane = i & 31u;
    f->warp = i >> 5;
    f->state = F_READY;
    init_fiber(w, f, i);
  }
  for (unsigned k = 0; k < w->nwarps; ++k) {
    WarpState& ws = w->warps[k];
    unsigned lanes = n - k * 32 >= 32 ? 32 : n - k * 32;
    ws.exist = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    ws.exited = 0;
    ws.ngroups = 0;
  }
  w->rq_head = 0;
  w->rq_count = 0;
  w->order.resize(n);
  for (unsigned i = 0; i < n; ++i) w->order[i] = i;
  schedule_order(w->sched, w->rng, w->order.data(), n);
  for (unsigned i = 1; i < n; ++i) w->push_ready(w->order[i]);
  w->bar_count = 0;
  w->n_exited = 0;
  if (w->async.size() < n) {
    w->async.resize(n);
    w->async_slots.reset(new AsyncCopy[(size_t)n * ASYNC_MAX_PENDING]);  // untouched until used
    for (unsigned i = 0; i < n; ++i) w->async[i].pending = &w->async_slots[(size_t)i * ASYNC_MAX_PENDING];
  }
  for (unsigned i = 0; i < n; ++i) w->async[i].reset();  // copies a thread left pending die with its block
  if (w->race.on) w->race.begin_block(n);
  if (!w->bulk_slots) w->bulk_slots.reset(new BulkCopy[BULK_MAX_PENDING]);  // untouched until used
  ++w->block_serial;
  if (w->wgmma_capacity < n) {
    w->wgmma_slots.reset(new WgmmaPending[(size_t)n * WGMMA_MAX_PENDING]);  // untouched until used
    w->wgmma_threads.resize(n);
    w->wgmma_capacity = n;
  }
  for (unsigned i = 0; i < n; ++i) w->wgmma_threads[i] = WgmmaThread{0, 0};
  w->hop.wg = w->wgmma_slots.get();
  w->hop.wgt = w->wgmma_threads.data();
  w->hop.copies = w->bulk_slots.get();
  w->hop.nbars = 0;
  w->hop.ncopies = 0;
  w->hop.spins = 0;
  if (w->race.on) {
    if (w->hop_vc.size() < (size_t)2 * MBAR_MAX * w->race.n) w->hop_vc.resize((size_t)2 * MBAR_MAX * w->race.n);
    w->hop.vc_mem = w->hop_vc.data();
    w->hop.vc_width = w->race.n;
  } else {
    w->hop.vc_mem = nullptr;
    w->hop.vc_width = 0;
  }
  w->cur = &w->fibers[w->order[0]];
  w->cur->state = F_RUNNING;
#if !defined(KGEN_SIMT_ASAN)
  if (sigsetjmp(w->overflow_jb, 1)) {  // a fiber overflowed its stack (segv_handler)
    w->in_block = false;
    w->cur = nullptr;
    return;
  }
#endif
  w->in_block = true;
  switch_ctx(w, nullptr, w->cur);
  w->in_block = false;
  w->cur = nullptr;
}

}  // namespace kgen_simt
