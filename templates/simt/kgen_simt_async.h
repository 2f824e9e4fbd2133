// kgen SIMT runtime, part 6: cp.async, the asynchronous global -> shared copies of sm_80+.
//
// PTX ISA semantics, per thread:
//   cp.async.{ca,cg}.shared.global [dst], [src], cp-size{, src-size}   (ca: 4, 8, 16 bytes; cg: 16)
//       copies src-size bytes (default cp-size) and zero-fills the rest of the cp-size bytes;
//   cp.async.commit_group   closes the group of the copies issued since the previous commit;
//   cp.async.wait_group N   waits until at most the N most recent committed groups are pending;
//   cp.async.wait_all       = commit_group + wait_group 0.
// A copy may land any time between its issue and the wait that covers it; this runtime
// takes the latest point: the source bytes are read at issue, the destination is filled
// with 0xFF (a NaN in every float format kgen uses) at issue, and the data lands only at
// the covering wait. A kernel that reads its buffer before the wait (or another thread's
// copies before the barrier that follows that thread's wait) therefore reads NaN here.
// Copies land in issue order (PTX gives no order between copies; this is one legal order).
#pragma once
#include <cstdint>
#include <cstring>

namespace kgen_simt {

struct AsyncCopy {
  unsigned char* dst;
  unsigned group;                // commits the thread had made at issue: the group it joins
  unsigned char size, src_size;  // cp-size; bytes read from the source (the rest is zero-filled)
  unsigned char data[16];        // the source bytes, read at issue
};

// Copies one thread may have pending at once on the CPU backend (storage reserved per thread
// by the runtime when a block starts, so the kernel's own code never allocates).
constexpr unsigned ASYNC_MAX_PENDING = 1024;

// One thread's pending copies and committed-group count.
struct AsyncQueue {
  AsyncCopy* pending = nullptr;  // ASYNC_MAX_PENDING slots, in issue order
  unsigned count = 0, commits = 0;

  void reset() {
    count = 0;
    commits = 0;
  }

  // False (nothing done) when ASYNC_MAX_PENDING copies are already pending.
  bool issue(void* dst, const void* src, unsigned size, unsigned src_size) {
    if (count == ASYNC_MAX_PENDING) return false;
    AsyncCopy& c = pending[count++];
    c.dst = static_cast<unsigned char*>(dst);
    c.group = commits;
    c.size = (unsigned char)size;
    c.src_size = (unsigned char)src_size;
    if (src_size) std::memcpy(c.data, src, src_size);
    std::memset(dst, 0xFF, size);  // not landed yet
    return true;
  }

  void commit() { ++commits; }

  // Land every copy of the committed groups but the `n` most recent (in issue order);
  // `landed(dst, size)` is told of each.
  template <class F>
  void wait_group(unsigned n, F landed) {
    if (commits <= n) return;
    const unsigned limit = commits - n;  // groups [0, limit) complete
    unsigned keep = 0;
    for (unsigned i = 0; i < count; ++i) {
      AsyncCopy& c = pending[i];
      if (c.group < limit) {
        std::memcpy(c.dst, c.data, c.src_size);
        std::memset(c.dst + c.src_size, 0, (size_t)(c.size - c.src_size));
        landed(c.dst, c.size);
      } else {
        pending[keep++] = c;
      }
    }
    count = keep;
  }
};

}  // namespace kgen_simt
