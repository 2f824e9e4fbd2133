// kgen SIMT runtime, part 7a: the state behind the Hopper primitives (kgen_simt_hopper.h).
//
// An mbarrier is a 64-bit object in shared memory; the runtime keeps its state in a per-block
// table keyed by that address (the word itself is left alone), with room for MBAR_MAX live
// barriers. Bulk copies (cp.async.bulk) are recorded at issue and land when the phase of
// their mbarrier completes: the latest point the PTX ISA allows.
#pragma once
#include <cstdint>

namespace kgen_simt {

constexpr unsigned MBAR_MAX = 64;           // live mbarriers per block
constexpr unsigned BULK_MAX_PENDING = 512;  // bulk copies in flight per block

struct Mbar {
  const void* addr;
  unsigned expected, pending;  // arrivals per phase; still to come in the current phase
  long long tx;                // transaction count of the current phase (bytes expected - completed)
  unsigned phase;              // phases completed so far (the current phase's parity: phase & 1)
  bool live;
  uint32_t* vc_pending;        // race detection: what the current phase's arrivals release
  uint32_t* vc_done;           // ... and what the last completed phase released
};

struct BulkCopy {
  unsigned bar;     // index in the table
  unsigned issuer;  // linear thread index
  unsigned char* dst;
  const unsigned char* src;
  unsigned bytes;
};

// wgmma results not yet waited for: one per accumulator a thread has in flight. The registers
// hold NaN from the issue until the wgmma.wait_group that covers the result.
constexpr unsigned WGMMA_MAX_PENDING = 4;  // accumulators in flight per thread
struct WgmmaPending {
  float* d;          // the thread's accumulator registers
  unsigned regs;     // N/2
  unsigned group;    // the thread's commit count when the last wgmma into d was issued
  float v[128];
};
struct WgmmaThread {
  unsigned count, commits;
};

struct HopperState {
  Mbar bars[MBAR_MAX];
  unsigned nbars = 0;             // slots in use (live or not)
  unsigned long long spins = 0;   // failed test_waits since an mbarrier last made progress
  BulkCopy* copies = nullptr;     // BULK_MAX_PENDING slots (run_block allocates them)
  unsigned ncopies = 0;
  uint32_t* vc_mem = nullptr;     // race detection: 2 * MBAR_MAX vectors of the clock width
  unsigned vc_width = 0;
  WgmmaPending* wg = nullptr;     // WGMMA_MAX_PENDING per thread (run_block allocates them)
  WgmmaThread* wgt = nullptr;     // per thread
};

}  // namespace kgen_simt
