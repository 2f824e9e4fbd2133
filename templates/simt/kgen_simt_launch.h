// kgen SIMT runtime, part 3: launching a grid (worker pool, argument unpacking).
#pragma once
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

namespace kgen_simt {

constexpr unsigned kMaxThreadsPerBlock = 1024;

#if defined(KGEN_SIMT_ASAN)
constexpr size_t kDefaultStack = 512 * 1024;  // ASan's redzones make frames much bigger
#else
constexpr size_t kDefaultStack = 64 * 1024;
#endif

#if defined(KGEN_SIMT_RACECHECK)
constexpr bool kRaceCheck = true;
#else
constexpr bool kRaceCheck = false;
#endif

struct Options {
  std::atomic<unsigned> workers{0};  // 0: KGEN_SIMT_THREADS or the number of CPUs
  std::atomic<size_t> stack_size{0};  // 0: KGEN_SIMT_STACK or kDefaultStack
  std::atomic<int> schedule{SCHEDULE_DEFAULT};  // default: mixed with race detection, else FIFO
  std::atomic<unsigned long long> seed{0};   // of the shuffled and mixed schedules
  std::atomic<bool> keep_stacks{false};      // fiber stacks outlive a launch (see keep_stacks())
};
inline Options g_options;

inline size_t parse_size(const char* s) {
  if (!s || !*s) return 0;
  char* end = nullptr;
  unsigned long long v = strtoull(s, &end, 10);
  if (end && (*end == 'k' || *end == 'K')) v <<= 10;
  if (end && (*end == 'm' || *end == 'M')) v <<= 20;
  return (size_t)v;
}

inline unsigned worker_count() {
  unsigned n = g_options.workers.load();
  if (!n) n = (unsigned)parse_size(getenv("KGEN_SIMT_THREADS"));
  static const unsigned ncpu = std::thread::hardware_concurrency();  // reads /sys: once
  if (!n) n = ncpu;
  return n ? n : 1;
}

inline size_t stack_size() {
  size_t s = g_options.stack_size.load();
  if (!s) s = parse_size(getenv("KGEN_SIMT_STACK"));
  if (!s) s = kDefaultStack;
  return s < 16384 ? 16384 : s;
}

struct Job {
  const char* kernel;
  dim3 grid, block;
  size_t smem;
  void (*body)(void*);
  void* ctx;
  unsigned long long total;
  size_t stack;
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_m;
  std::string err;
};

// Every worker of this library, for keep_stacks() (pushed lock-free: helpers start side by side,
// and a fork()ed child inherits the list with no lock held). Never shrinks: workers are never freed.
inline std::atomic<Worker*> g_workers{nullptr};

inline Worker* this_worker() {
  if (!tls_w) {
    tls_w = new Worker();  // one per OS thread, kept for the thread's life
    Worker* head = g_workers.load();
    do tls_w->next_worker = head;
    while (!g_workers.compare_exchange_weak(head, tls_w));
    install_overflow_guard();
#if defined(KGEN_SIMT_ASAN)
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* addr;
      size_t size;
      pthread_attr_getstack(&attr, &addr, &size);
      tls_w->main_stack_bottom = addr;
      tls_w->main_stack_size = size;
      pthread_attr_destroy(&attr);
    }
#endif
  }
  return tls_w;
}

// Race detection: this worker's shared-memory ranges and a shadow big enough for them.
inline bool setup_race(Worker* w, const Job* job) {
  RaceState& r = w->race;
  if (!r.tls_len) {  // the TLS block of this library in this OS thread: found once
    uintptr_t lo, len;
    if (!find_tls_block(&tls_w, &lo, &len)) return false;
    r.tls_lo = lo;
    r.tls_len = len;
    r.skip_lo = (uintptr_t)&tls_w;
    r.skip_hi = r.skip_lo + sizeof(tls_w);
  }
  r.dyn_lo = (uintptr_t)w->dyn_smem;
  r.dyn_len = w->dyn_smem ? job->smem : 0;
  r.resize_shadow(r.tls_words() + r.dyn_words());
  r.on = true;
  return true;
}

// The worker's share of a launch is over: its stacks go unless this library keeps them.
inline void end_of_launch(Worker* w) {
  if (!g_options.keep_stacks.load()) release_stacks(w);
}

// Run blocks of `job` until none are left or one failed.
inline void run_worker(Job* job) {
  Worker* w = this_worker();
  unsigned n = job->block.x * job->block.y * job->block.z;
  auto record = [&](const std::string& msg) {
    std::lock_guard<std::mutex> lk(job->err_m);
    if (!job->failed.exchange(true)) job->err = msg;
  };
  if (!ensure_stacks(w, n, job->stack)) {
    record(std::string("kernel '") + job->kernel + "': cannot allocate fiber stacks");
    return;
  }
  w->kernel = job->kernel;
  w->grid_dim = job->grid;
  w->block_dim = job->block;
  w->body = job->body;
  w->body_ctx = job->ctx;
  w->nthreads = n;
  w->nwarps = (n + 31) / 32;
  if (w->fibers.size() < n) w->fibers.resize(n);
  if (w->ready.size() < n) w->ready.resize(n);
  if (w->bar_list.size() < n) w->bar_list.resize(n);
  if (w->warps.size() < w->nwarps) w->warps.resize(w->nwarps);
  w->ready.resize(n);  // the ring buffer's capacity must be exactly n
  void* smem = nullptr;
  if (job->smem) {
    // 1024-byte aligned: wgmma's 128B swizzle pattern repeats from 1024-byte boundaries
    if (posix_memalign(&smem, 1024, job->smem) != 0) {
      record(std::string("kernel '") + job->kernel + "': cannot allocate dynamic shared memory");
      end_of_launch(w);
      return;
    }
  }
  w->dyn_smem = smem;
  w->dyn_smem_len = job->smem;
  if (kRaceCheck && !setup_race(w, job)) {
    free(smem);
    record(std::string("kernel '") + job->kernel + "': race detection cannot find the shared-memory range");
    end_of_launch(w);
    return;
  }
  int mode = g_options.schedule.load();
  if (mode == SCHEDULE_DEFAULT) mode = kRaceCheck ? SCHEDULE_MIXED : SCHEDULE_FIFO;
  const unsigned long long seed = g_options.seed.load();
  unsigned long long gx = job->grid.x, gxy = gx * job->grid.y;
  for (;;) {
    if (job->failed.load(std::memory_order_relaxed)) break;
    unsigned long long b = job->next.fetch_add(1);
    if (b >= job->total) break;
    uint3 bidx = make_uint3((unsigned)(b % gx), (unsigned)((b / gx) % job->grid.y), (unsigned)(b / gxy));
    // Per block, from (seed, block) only: the same blocks get the same orders whatever the worker.
    w->rng.s = mix64(seed ^ mix64(b + 1));
    w->sched = mode != SCHEDULE_MIXED ? mode : (int)(SCHEDULE_FIFO + mix64(seed + b) % 3);
    w->failed = false;
    run_block(w, bidx);
    if (w->failed) {
      record(w->err);
      break;
    }
  }
  free(smem);
  w->dyn_smem = nullptr;
  w->race.on = false;
  end_of_launch(w);
}

// A pool of helper threads, created on demand and kept (idle ones sleep on a condvar).
class Pool {
 public:
  void run(Job* job, unsigned helpers) {
    std::unique_lock<std::mutex> lk(m_);
    while (threads_ < helpers) {
      std::thread(&Pool::loop, this).detach();
      ++threads_;
    }
    job_ = job;
    wanted_ = helpers;
    running_ = helpers;
    ++gen_;
    lk.unlock();
    cv_.notify_all();
    run_worker(job);
    lk.lock();
    done_cv_.wait(lk, [&] { return running_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop() {
    unsigned long long seen = 0;
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      cv_.wait(lk, [&] { return gen_ != seen && wanted_ > 0; });
      seen = gen_;
      --wanted_;
      Job* job = job_;
      lk.unlock();
      run_worker(job);
      lk.lock();
      if (--running_ == 0) done_cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  Job* job_ = nullptr;
  unsigned threads_ = 0, wanted_ = 0, running_ = 0;
  unsigned long long gen_ = 0;
};

// Per process: a fork()ed child (multiprocessing) has none of the parent's helper threads,
// so it starts a fresh pool and launch mutex (the parent's are leaked in the child).
struct ProcessState {
  pid_t pid;
  Pool* pool;
  std::mutex* launch_m;
};
inline ProcessState& process_state() {
  static ProcessState st{0, nullptr, nullptr};
  static std::mutex guard;  // held only for this check
  std::lock_guard<std::mutex> lk(guard);
  pid_t now = getpid();
  if (st.pid != now) {
    st.pool = new Pool();        // never destroyed: detached threads outlive static destructors
    st.launch_m = new std::mutex();
    st.pid = now;
  }
  return st;
}
inline Pool& pool() { return *process_state().pool; }
inline std::mutex& launch_mutex() { return *process_state().launch_m; }

// Fiber stacks between launches. Mapping a launch's stacks and unmapping them when it ends costs
// about 20 us per thread of its block (an mprotect per guard page, page faults on fresh memory,
// the munmap), so a library may keep them: `keep` > 0 keeps them from now on, 0 unmaps those kept
// and stops keeping, < 0 changes nothing. Kept stacks cost memory maps (a guard page splits the
// mapping: two per stack), and every library loaded into a process has its own workers, so kept
// by all of them they would exhaust vm.max_map_count (65,530) after a few dozen libraries; the
// caller decides which libraries keep theirs (kgen/runtime/fiber_stacks.py). Returns the maps this
// library's stacks hold now. A kept stack is reused as it was left, as the blocks of one launch
// always reused them: its guard page stays PROT_NONE, and every block starts its fibers afresh
// (init_fiber), whatever the last launch left on them (a block abandoned after an error).
inline size_t keep_stacks(int keep) {
  std::lock_guard<std::mutex> lk(launch_mutex());  // no launch in flight: no worker is on its stacks
  if (keep >= 0) g_options.keep_stacks = keep > 0;
  size_t maps = 0;
  for (Worker* w = g_workers.load(); w; w = w->next_worker) {
    if (keep == 0) release_stacks(w);
    maps += 2 * (size_t)w->stack_count;
  }
  return maps;
}

inline int write_err(char* err, size_t errlen, const std::string& msg) {
  if (err && errlen) {
    size_t n = msg.size() < errlen - 1 ? msg.size() : errlen - 1;
    std::memcpy(err, msg.data(), n);
    err[n] = 0;
  }
  return 1;
}

// Launch a grid: 0 on success, nonzero with a message in err otherwise.
inline int launch(const char* kernel, dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx, char* err,
                  size_t errlen) {
  unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
  unsigned long long total = (unsigned long long)grid.x * grid.y * grid.z;
  char buf[256];
  if (nthreads == 0 || nthreads > kMaxThreadsPerBlock || block.z > 64) {
    snprintf(buf, sizeof buf, "kernel '%s': invalid block (%u,%u,%u): 1..%u threads, z <= 64", kernel, block.x,
             block.y, block.z, kMaxThreadsPerBlock);
    return write_err(err, errlen, buf);
  }
  if (total == 0 || grid.y > 65535 || grid.z > 65535) {
    snprintf(buf, sizeof buf, "kernel '%s': invalid grid (%u,%u,%u)", kernel, grid.x, grid.y, grid.z);
    return write_err(err, errlen, buf);
  }
  std::lock_guard<std::mutex> lk(launch_mutex());
  Job job;
  job.kernel = kernel;
  job.grid = grid;
  job.block = block;
  job.smem = smem;
  job.body = body;
  job.ctx = ctx;
  job.total = total;
  job.stack = stack_size();
  unsigned nw = worker_count();
  if (nw > total) nw = (unsigned)total;
  if (nw <= 1)
    run_worker(&job);
  else
    pool().run(&job, nw - 1);
  if (job.failed.load()) return write_err(err, errlen, job.err);
  if (err && errlen) err[0] = 0;
  return 0;
}

// ---- typed entry: unpack cuLaunchKernel-style args into the kernel's parameters ----
template <class... P>
struct Bound {
  void (*fn)(P...);
  std::tuple<std::decay_t<P>...> args;
  static void run(void* self) {
    Bound* b = static_cast<Bound*>(self);
    std::apply(b->fn, b->args);
  }
};

template <class... P, size_t... I>
inline std::tuple<std::decay_t<P>...> unpack(void** args, std::index_sequence<I...>) {
  return std::tuple<std::decay_t<P>...>(*static_cast<std::decay_t<P>*>(args[I])...);
}

template <class... P>
inline int launch_kernel(const char* name, void (*fn)(P...), dim3 grid, dim3 block, size_t smem, void** args,
                         char* err, size_t errlen) {
  Bound<P...> b{fn, unpack<P...>(args, std::index_sequence_for<P...>{})};
  return launch(name, grid, block, smem, &Bound<P...>::run, &b, err, errlen);
}

// Parameter type codes for the Python side's argument checks: p (pointer), i4 u4 i8 u8
// f4 f8 (scalars), b<N> (anything else passed by value, N bytes).
template <class T>
inline std::string type_code() {
  using U = std::decay_t<T>;
  if (std::is_pointer<U>::value) return "p";
  if (std::is_floating_point<U>::value) return "f" + std::to_string(sizeof(U));
  if (std::is_integral<U>::value) return (std::is_signed<U>::value ? "i" : "u") + std::to_string(sizeof(U));
  return "b" + std::to_string(sizeof(U));
}
template <class... P>
inline std::string signature(void (*)(P...)) {
  std::string s;
  ((s += (s.empty() ? "" : ","), s += type_code<P>()), ...);
  return s;
}

}  // namespace kgen_simt
