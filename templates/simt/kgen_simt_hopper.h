// kgen SIMT runtime, part 7: the Hopper (sm_90) primitives templates/common/hopper.cuh calls on
// the CPU: mbarrier and the bulk copy (cp.async.bulk) that completes on one. State: kgen_simt_mbar.h.
//
// PTX ISA semantics. An mbarrier's current phase completes when its pending arrival count and its
// transaction count (tx-count) are both zero; then the phase number advances, the pending count is
// reset to the expected count given at init and tx-count to 0.
//   mbarrier.init [b], count          expected = pending = count (1 .. 2^20-1), phase 0
//   mbarrier.arrive{.expect_tx} [b]   (tx-count += bytes, then) pending -= count; returns a state
//   mbarrier.expect_tx / complete_tx  tx-count += / -= bytes
//   mbarrier.try_wait.parity [b], p   true once the phase of parity p has completed, i.e. while the
//                                     current phase's parity differs from p
//   mbarrier.test_wait.parity         the same test, never blocking
//   mbarrier.inval [b]                the object may be reused as ordinary memory
// Here try_wait blocks the thread (yields to the scheduler) until the phase completes: the PTX
// ISA lets it suspend up to an implementation-defined time limit; this runtime's limit is "until
// no thread of the block can make progress", which is reported as an error. A loop spinning on
// test_wait yields on each failure; SPIN_LIMIT failures in a row with no phase completing in the
// block are reported as a livelock.
//
// Bulk copies: the source is read and the destination written when the phase of the copy's
// mbarrier completes (the latest point allowed); at issue the destination is filled with 0xFF
// (NaN in every float format kgen uses) and the copy's bytes are counted as completed
// transactions of the current phase. With race detection the copy's writes are those of the
// issuing thread's async proxy (ordered after what the thread did before the issue; released to
// the mbarrier's waiters when the phase completes), and an mbarrier phase orders the arrivals'
// accesses before the accesses of every thread whose wait saw it complete.
#pragma once

namespace kgen_simt {

constexpr unsigned long long SPIN_LIMIT = 1ull << 25;
constexpr long long MBAR_TX_MAX = (1 << 20) - 1;

inline Mbar* mbar_find(Worker* w, const void* bar, const char* op, unsigned* index = nullptr) {
  for (unsigned i = 0; i < w->hop.nbars; ++i) {
    Mbar& m = w->hop.bars[i];
    if (m.live && m.addr == bar) {
      if (index) *index = i;
      return &m;
    }
  }
  fail("%s: no mbarrier is initialised at %p (mbarrier.init it first; or it was invalidated)", op, bar);
}

// The phase of bars[bi] completes: land its copies, release its arrivals, wake its waiters.
inline void mbar_complete_phase(Worker* w, unsigned bi);

__attribute__((noinline, noipa)) inline void mbar_init(void* bar, unsigned count) {
  Worker* w = tls_w;
  if ((uintptr_t)bar % 8) fail("mbarrier.init: the mbarrier at %p is not 8-byte aligned", bar);
  if (count < 1 || count > (1u << 20) - 1) fail("mbarrier.init: count %u is outside 1 .. 2^20-1", count);
  unsigned slot = w->hop.nbars;
  for (unsigned i = 0; i < w->hop.nbars; ++i) {
    if (w->hop.bars[i].addr == bar && w->hop.bars[i].live)
      fail("mbarrier.init: the mbarrier at %p is already initialised (mbarrier.inval it before reusing it)", bar);
    if (!w->hop.bars[i].live && slot == w->hop.nbars) slot = i;
  }
  if (slot == MBAR_MAX) fail("mbarrier.init: more than %u live mbarriers in one block (the CPU backend's limit)", MBAR_MAX);
  if (slot == w->hop.nbars) ++w->hop.nbars;
  Mbar& m = w->hop.bars[slot];
  m.addr = bar;
  m.expected = m.pending = count;
  m.tx = 0;
  m.phase = 0;
  m.live = true;
  m.vc_pending = m.vc_done = nullptr;
  if (w->hop.vc_mem) {
    m.vc_pending = w->hop.vc_mem + (size_t)2 * slot * w->hop.vc_width;
    m.vc_done = m.vc_pending + w->hop.vc_width;
    std::memset(m.vc_pending, 0, (size_t)2 * w->hop.vc_width * sizeof(uint32_t));
  }
}

__attribute__((noinline, noipa)) inline void mbar_inval(void* bar) {
  Worker* w = tls_w;
  unsigned bi = 0;
  Mbar* m = mbar_find(w, bar, "mbarrier.inval", &bi);
  for (unsigned i = 0; i < w->hop.ncopies; ++i)
    if (w->hop.copies[i].bar == bi) fail("mbarrier.inval: a bulk copy still completes on the mbarrier at %p", bar);
  for (unsigned i = 0; i < w->nthreads; ++i)
    if (w->fibers[i].state == F_MBAR && w->fibers[i].mbar == bar) {
      char nm[64];
      thread_name(w, i, nm, sizeof nm);
      fail("mbarrier.inval: thread %s still waits on the mbarrier at %p", nm, bar);
    }
  m->live = false;
}

inline void mbar_check_tx(Mbar& m, const char* op) {
  if (m.tx > MBAR_TX_MAX || m.tx < -MBAR_TX_MAX)
    fail("%s: the transaction count of the mbarrier at %p reached %lld, outside +-(2^20-1)", op, m.addr, m.tx);
}

// mbarrier.arrive{.expect_tx} [bar], count: returns the state (the phase the arrival belongs to).
__attribute__((noinline, noipa)) inline unsigned long long mbar_arrive(void* bar, unsigned count, unsigned tx_bytes) {
  Worker* w = tls_w;
  const char* op = tx_bytes ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive";
  unsigned bi = 0;
  Mbar& m = *mbar_find(w, bar, op, &bi);
  if (count == 0 || count > m.pending)
    fail("%s: %u arrival(s) on the mbarrier at %p, whose phase %u awaits only %u more of %u (an extra arrive?)", op,
         count, bar, m.phase, m.pending, m.expected);
  if (m.vc_pending) w->race.release(w->cur->linear, m.vc_pending);
  m.tx += tx_bytes;
  mbar_check_tx(m, op);
  m.pending -= count;
  w->hop.spins = 0;
  const unsigned long long state = m.phase;
  if (m.pending == 0 && m.tx == 0) mbar_complete_phase(w, bi);
  return state;
}

// mbarrier.expect_tx (delta > 0) / mbarrier.complete_tx (delta < 0).
__attribute__((noinline, noipa)) inline void mbar_tx(void* bar, long long delta) {
  Worker* w = tls_w;
  const char* op = delta >= 0 ? "mbarrier.expect_tx" : "mbarrier.complete_tx";
  unsigned bi = 0;
  Mbar& m = *mbar_find(w, bar, op, &bi);
  if (delta < 0 && m.vc_pending) w->race.release(w->cur->linear, m.vc_pending);
  m.tx += delta;
  mbar_check_tx(m, op);
  w->hop.spins = 0;
  if (m.pending == 0 && m.tx == 0) mbar_complete_phase(w, bi);
}

// mbarrier.try_wait.parity, looped until true: blocks until the phase of parity `parity` completed.
__attribute__((noinline, noipa)) inline void mbar_wait(void* bar, unsigned parity) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  unsigned bi = 0;
  Mbar* m = mbar_find(w, bar, "mbarrier.try_wait", &bi);
  if ((m->phase & 1u) == (parity & 1u)) {
    f->state = F_MBAR;
    f->mbar = bar;
    f->mbar_parity = parity & 1u;
    block_current(w, "mbarrier.try_wait.parity");  // the completing phase has acquired for us
    f->mbar = nullptr;
    return;
  }
  if (m->vc_done) w->race.acquire(f->linear, m->vc_done);
}

// mbarrier.test_wait.parity: never blocks; a failed test lets the other threads run.
__attribute__((noinline, noipa)) inline bool mbar_test_wait(void* bar, unsigned parity) {
  Worker* w = tls_w;
  Fiber* f = w->cur;
  Mbar& m = *mbar_find(w, bar, "mbarrier.test_wait");
  if ((m.phase & 1u) != (parity & 1u)) {
    if (m.vc_done) w->race.acquire(f->linear, m.vc_done);
    return true;
  }
  if (++w->hop.spins > SPIN_LIMIT)
    fail("mbarrier.test_wait.parity(%u): %llu failed waits in a row in this block and no mbarrier made progress; "
         "the mbarrier at %p (phase %u) still awaits %u of %u arrival(s) and %lld transaction byte(s)",
         parity & 1u, SPIN_LIMIT, bar, m.phase, m.pending, m.expected, m.tx);
  f->state = F_READY;
  w->push_ready(f->linear);
  yield_current(w);
  return false;
}

// ---- bulk copies ---------------------------------------------------------------------------------
// The copy's writes as its issuer's async proxy.
inline void bulk_land(Worker* w, const BulkCopy& c, Mbar& m) {
  const bool race = w->race.on;
  if (race) w->race.as_tid = (int)(w->nthreads + c.issuer);
  std::memcpy(c.dst, c.src, c.bytes);
  KGEN_SIMT_ASYNC_WRITE(c.dst, c.bytes);
  if (race) {
    w->race.as_tid = -1;
    if (m.vc_pending) w->race.release(w->nthreads + c.issuer, m.vc_pending);
  }
}

inline void mbar_complete_phase(Worker* w, unsigned bi) {
  Mbar& m = w->hop.bars[bi];
  unsigned keep = 0;
  for (unsigned i = 0; i < w->hop.ncopies; ++i) {
    BulkCopy& c = w->hop.copies[i];
    if (c.bar == bi) bulk_land(w, c, m);
    else if (keep != i) w->hop.copies[keep++] = c;
    else ++keep;
  }
  w->hop.ncopies = keep;
  const unsigned done_parity = m.phase & 1u;
  if (m.vc_pending) {
    // the blocked waiters acquire this phase (not whatever later phase is current when they run)
    for (unsigned i = 0; i < w->nthreads; ++i) {
      const Fiber& f = w->fibers[i];
      if (f.state == F_MBAR && f.mbar == m.addr && f.mbar_parity == done_parity) w->race.acquire(i, m.vc_pending);
    }
    std::memcpy(m.vc_done, m.vc_pending, w->hop.vc_width * sizeof(uint32_t));
    std::memset(m.vc_pending, 0, w->hop.vc_width * sizeof(uint32_t));
  }
  ++m.phase;
  m.pending = m.expected;
  m.tx = 0;
  w->hop.spins = 0;
  const unsigned parity = m.phase & 1u;
  const bool rev = w->sched == SCHEDULE_REVERSE;
  for (unsigned k = 0; k < w->nthreads; ++k) {
    const unsigned i = rev ? w->nthreads - 1 - k : k;
    Fiber& f = w->fibers[i];
    if (f.state == F_MBAR && f.mbar == m.addr && f.mbar_parity != parity) {
      f.state = F_READY;
      w->push_ready(i);
    }
  }
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes, [bar]
__attribute__((noinline, noipa)) inline void bulk_copy(void* dst, const void* src, unsigned bytes, void* bar) {
  Worker* w = tls_w;
  const char* op = "cp.async.bulk";
  unsigned bi = 0;
  Mbar& m = *mbar_find(w, bar, op, &bi);
  if (w->hop.ncopies == BULK_MAX_PENDING)
    fail("%s: more than %u bulk copies in flight in one block (the CPU backend's limit)", op, BULK_MAX_PENDING);
  if ((uintptr_t)dst % 16 || (uintptr_t)src % 16 || bytes % 16 || bytes == 0)
    fail("cp.async.bulk: shared %p, global %p, %u bytes: both addresses must be 16-byte aligned and the size a "
         "nonzero multiple of 16", dst, src, bytes);
  BulkCopy& c = w->hop.copies[w->hop.ncopies];
  c.src = static_cast<const unsigned char*>(src);
  c.bytes = bytes;
  c.dst = static_cast<unsigned char*>(dst);
  c.bar = bi;
  c.issuer = w->cur->linear;
  ++w->hop.ncopies;
  if (w->race.on) {
    w->race.release(c.issuer, w->race.vcp + (size_t)(w->nthreads + c.issuer) * w->race.n);
    w->race.as_tid = (int)(w->nthreads + c.issuer);
  }
  std::memset(dst, 0xFF, bytes);  // not landed yet
  KGEN_SIMT_ASYNC_WRITE(dst, bytes);
  w->race.as_tid = -1;
  m.tx -= bytes;
  mbar_check_tx(m, op);
  w->hop.spins = 0;
  if (m.pending == 0 && m.tx == 0) mbar_complete_phase(w, bi);
}

}  // namespace kgen_simt
