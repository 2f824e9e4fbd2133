"""The CPU runtime's Hopper primitives (templates/common/hopper.cuh on the CPU side,
templates/simt/kgen_simt_hopper.h): mbarrier phases and transaction counts, the blocking wait and
the ordering the race detector takes from it, deadlocks and livelocks reported instead of hangs,
and the bulk copy (cp.async.bulk) landing when its phase completes."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_module import GpuModule

from kgen.errors import KernelRuntimeError
from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

MBAR_KERNELS = r"""
// One thread walks an mbarrier through its phases; out[i] records each test (1: phase complete).
extern "C" __global__ void phases(int* out) {
  __shared__ unsigned long long bar;
  kgen::mbar_init(&bar, 3);
  out[0] = kgen::mbar_test_wait(&bar, 0);          // phase 0 in progress
  kgen::mbar_arrive(&bar);
  out[1] = kgen::mbar_test_wait(&bar, 0);          // 2 arrivals still pending
  kgen::mbar_arrive(&bar, 2);                      // phase 0 completes
  out[2] = kgen::mbar_test_wait(&bar, 0);
  out[3] = kgen::mbar_test_wait(&bar, 1);          // phase 1 (parity 1) in progress
  kgen::mbar_arrive_expect_tx(&bar, 64);
  kgen::mbar_arrive(&bar, 2);                      // arrivals done, 64 bytes outstanding
  out[4] = kgen::mbar_test_wait(&bar, 1);
  kgen::mbar_complete_tx(&bar, 32);
  out[5] = kgen::mbar_test_wait(&bar, 1);
  kgen::mbar_expect_tx(&bar, 16);
  kgen::mbar_complete_tx(&bar, 48);                // tx-count 0: phase 1 completes
  out[6] = kgen::mbar_test_wait(&bar, 1);
  out[7] = kgen::mbar_test_wait(&bar, 0);          // phase 2 (parity 0) in progress
  kgen::mbar_complete_tx(&bar, 8);                 // tx-count may go negative ...
  kgen::mbar_arrive(&bar, 3);
  out[8] = kgen::mbar_test_wait(&bar, 0);          // ... and then holds the phase
  kgen::mbar_expect_tx(&bar, 8);
  out[9] = kgen::mbar_test_wait(&bar, 0);
  kgen::mbar_inval(&bar);
  kgen::mbar_init(&bar, 1);                        // reusable after inval
  kgen::mbar_arrive(&bar);
  out[10] = kgen::mbar_try_wait(&bar, 0);
}

// Warp 0 produces rounds of 32 ints into a 2-stage ring, warp 1 consumes them; full[s] counts the
// 32 producers, empty[s] the 32 consumers. Each consumer reads another lane's value.
// mode 0: correct; 1: the consumers skip the wait on full; 2: count 33 on full (one arrive
// missing); 3: the consumers spin on test_wait; 4: spin, and one arrive missing.
extern "C" __global__ void ring(int* out, int rounds, int mode) {
  __shared__ int buf[2][32];
  __shared__ unsigned long long full[2], empty[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      kgen::mbar_init(&full[s], (mode == 2 || mode == 4) ? 33 : 32);
      kgen::mbar_init(&empty[s], 32);
    }
    kgen::fence_mbarrier_init();
  }
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    const int s = r & 1;
    const unsigned parity = (r >> 1) & 1;
    if (warp == 0) {
      if (r >= 2) kgen::mbar_wait(&empty[s], parity ^ 1);
      buf[s][lane] = r * 100 + lane;
      kgen::mbar_arrive(&full[s]);
    } else {
      if (mode == 3 || mode == 4) {
        while (!kgen::mbar_test_wait(&full[s], parity)) {
        }
      } else if (mode != 1) {
        kgen::mbar_wait(&full[s], parity);
      }
      out[r * 32 + lane] = buf[s][(lane + 7) & 31];
      kgen::mbar_arrive(&empty[s]);
    }
  }
}

// A block smaller than a warp: __syncwarp and an mbarrier order a neighbour exchange.
extern "C" __global__ void tiny(int* out) {
  __shared__ int s[8];
  __shared__ unsigned long long bar;
  const int t = threadIdx.x;
  s[t] = t;
  __syncwarp(0xffu);
  out[t] = s[(t + 1) & 7];
  if (t == 0) kgen::mbar_init(&bar, 8);
  __syncthreads();
  kgen::mbar_arrive(&bar);
  kgen::mbar_wait(&bar, 0);
  s[t] = 10 * t;
  kgen::mbar_arrive(&bar);
  kgen::mbar_wait(&bar, 1);
  out[8 + t] = s[(t + 3) & 7];
}
"""

# CPU only: NVRTC 13.0 crashes (SIGSEGV, in-process) compiling mbarrier.init with a constant count of 0.
MISUSE_KERNEL = r"""
extern "C" __global__ void misuse(int mode) {
  __shared__ unsigned long long bar;
  if (mode == 0) kgen::mbar_arrive(&bar);          // never initialised
  kgen::mbar_init(&bar, 2);
  if (mode == 1) kgen::mbar_arrive(&bar, 3);       // more arrivals than the phase awaits
  if (mode == 2) kgen::mbar_init(&bar, 2);         // initialised twice
  if (mode == 3) kgen::mbar_init(&bar + 0, 0);
}
"""

BULK_KERNELS = r"""
// Thread 0 copies `n` bytes of src into shared memory with one bulk copy; the block waits on the
// mbarrier and writes the bytes back out. mode 1: thread 0 reads the destination before the phase
// completes (out_early gets what it saw); mode 2: the other threads skip the wait.
extern "C" __global__ void bulk(const unsigned char* src, unsigned char* dst, unsigned char* early, int n, int mode) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  __shared__ unsigned long long bar;
  if (threadIdx.x == 0) {
    kgen::mbar_init(&bar, 1);
    kgen::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    kgen::bulk_copy_g2s(smem, src, n, &bar);       // completes its bytes: tx-count -n
    if (mode == 1) for (int i = 0; i < n; ++i) early[i] = smem[i];
    kgen::mbar_arrive_expect_tx(&bar, n);          // ... and this arrival completes the phase
  }
  if (mode != 2) kgen::mbar_wait(&bar, 0);
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = smem[(i + 16) % n];
}
"""
NAMES = ["phases", "ring", "tiny", "misuse", "bulk"]


def _source(gpu: bool = False) -> str:
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    plat = (templates_dir() / "common" / "platform.cuh").read_text()
    hopper = (templates_dir() / "common" / "hopper.cuh").read_text()
    return head + plat + hopper + MBAR_KERNELS + ("" if gpu else MISUSE_KERNEL) + BULK_KERNELS


@pytest.fixture(scope="module")
def module():
    return CpuModule.from_source(_source(), NAMES)


@pytest.fixture(scope="module")
def race_module():
    return CpuModule.from_source(_source(), NAMES, race_check=True)


def _run(mod, name, block, args, smem=0, grid=(1, 1, 1)):
    mod.launch(Launch(name, grid, (block, 1, 1), smem, list(args)))


# ---- mbarrier -------------------------------------------------------------------------------------
def test_phases_complete_on_arrivals_and_transaction_bytes(module):
    out = np.full(11, -1, dtype=np.int32)
    _run(module, "phases", 1, [out])
    assert out.tolist() == [0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "shuffle"])
@pytest.mark.parametrize("mode", [0, 3])
def test_ring_buffer_orders_producer_and_consumer(race_module, schedule, mode):
    """Blocking waits (mode 0) and test_wait spin loops (mode 3) give every round's values, and the
    race detector sees the mbarrier phases order the two warps' accesses (no report)."""
    rounds = 9
    race_module.schedule, race_module.seed = schedule, 7
    try:
        out = np.full(rounds * 32, -1, dtype=np.int32)
        _run(race_module, "ring", 64, [out, rounds, mode])
    finally:
        race_module.schedule = None
    want = [r * 100 + (lane + 7) % 32 for r in range(rounds) for lane in range(32)]
    assert out.tolist() == want


@pytest.mark.parametrize("schedule", ["fifo", "reverse"])
def test_a_block_smaller_than_a_warp(race_module, schedule):
    race_module.schedule = schedule
    out = np.zeros(16, np.int32)
    _run(race_module, "tiny", 8, [out])
    assert out.tolist() == [(t + 1) % 8 for t in range(8)] + [10 * ((t + 3) % 8) for t in range(8)]


def test_a_missing_wait_is_a_race(race_module):
    out = np.zeros(4 * 32, dtype=np.int32)
    with pytest.raises(KernelRuntimeError, match=r"shared-memory race.*thread \(\d+,0,0\).*thread \(\d+,0,0\)"):
        _run(race_module, "ring", 64, [out, 4, 1])


def test_the_ring_without_race_check_runs_too(module):
    out = np.full(5 * 32, -1, dtype=np.int32)
    _run(module, "ring", 64, [out, 5, 0])
    assert out.tolist() == [r * 100 + (lane + 7) % 32 for r in range(5) for lane in range(32)]


def test_a_missing_arrive_is_a_deadlock_not_a_hang(module):
    out = np.zeros(4 * 32, dtype=np.int32)
    with pytest.raises(KernelRuntimeError, match=r"mbarrier.try_wait.parity can never complete.*64 waiting on "
                                                 r"mbarriers.*awaits 1 of 33 arrival"):
        _run(module, "ring", 64, [out, 4, 2])


def test_a_test_wait_spin_on_a_missing_arrive_is_reported(module):
    out = np.zeros(4 * 32, dtype=np.int32)
    with pytest.raises(KernelRuntimeError, match=r"test_wait.parity\(0\): \d+ failed waits in a row.*awaits 1 of 33"):
        _run(module, "ring", 64, [out, 4, 4])


@pytest.mark.parametrize("mode,message", [
    (0, r"mbarrier.arrive: no mbarrier is initialised at"),
    (1, r"mbarrier.arrive: 3 arrival\(s\) on the mbarrier at .* awaits only 2 more of 2"),
    (2, r"mbarrier.init: the mbarrier at .* is already initialised"),
    (3, r"mbarrier.init: count 0 is outside 1 .. 2\^20-1"),
])
def test_misuse_is_reported(module, mode, message):
    with pytest.raises(KernelRuntimeError, match=message):
        _run(module, "misuse", 1, [mode])


# ---- cp.async.bulk ----------------------------------------------------------------------------------
def test_bulk_copy_lands_when_its_phase_completes(module):
    """Issued before the arrival that completes the phase: until then the destination holds the
    0xFF poison (the copy has not landed); after the wait, the data."""
    n = 256
    src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    early = np.zeros(n, np.uint8)
    _run(module, "bulk", 64, [src, dst, early, n, 1], smem=n)
    assert (early == 0xFF).all()
    assert dst.tolist() == [int(src[(i + 16) % n]) for i in range(n)]


def test_bulk_copy_read_without_the_wait_is_a_race(race_module):
    n = 128
    src = np.arange(n, dtype=np.uint8)
    dst, early = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    _run(race_module, "bulk", 64, [src, dst, early, n, 0], smem=n)  # with the wait: clean
    assert dst.tolist() == [int(src[(i + 16) % n]) for i in range(n)]
    with pytest.raises(KernelRuntimeError, match=r"shared-memory race on dynamic shared memory.*the bulk copy "
                                                 r"issued by thread \(0,0,0\)"):
        _run(race_module, "bulk", 64, [src, dst, early, n, 2], smem=n)


def test_bulk_copy_checks_alignment(module):
    src = np.zeros(64, np.uint8)
    with pytest.raises(KernelRuntimeError, match=r"cp.async.bulk: .* 24 bytes: both addresses must be 16-byte aligned"):
        _run(module, "bulk", 32, [src, np.zeros(64, np.uint8), np.zeros(64, np.uint8), 24, 0], smem=64)


BULK_RING = r"""
// A ring of 2 stages fed by bulk copies: thread 0 loads rounds of 4 x 32 floats, warp 1 sums them.
// full[s]: the producer's arrival + the copy's bytes; empty[s]: the 32 consumers. mode 1: the
// producer does not wait on empty before reloading a stage.
extern "C" __global__ void bulk_ring(const float* x, int rounds, int mode, float* out) {
  KGEN_DYNAMIC_SMEM(float, stage);  // [2][4][32]
  __shared__ unsigned long long full[2], empty[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      kgen::mbar_init(&full[s], 1);
      kgen::mbar_init(&empty[s], 32);
    }
    kgen::fence_mbarrier_init();
  }
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    const int s = r & 1;
    const unsigned parity = (r >> 1) & 1;
    if (threadIdx.x == 0) {
      if (r >= 2 && mode == 0) kgen::mbar_wait(&empty[s], parity ^ 1);
      kgen::mbar_arrive_expect_tx(&full[s], 4 * 32 * 4);
      kgen::bulk_copy_g2s(stage + s * 128, x + r * 128, 4 * 32 * 4, &full[s]);
    } else if (warp == 1) {
      kgen::mbar_wait(&full[s], parity);
      float acc = 0.f;
      for (int i = 0; i < 4; ++i) acc += stage[s * 128 + i * 32 + lane];
      out[r * 32 + lane] = acc;
      kgen::mbar_arrive(&empty[s]);
    }
  }
}
"""


@pytest.fixture(scope="module")
def ring_module():
    return CpuModule.from_source(_source() + BULK_RING, ["bulk_ring"], race_check=True)


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "shuffle"])
def test_bulk_copy_ring_is_ordered_by_its_barriers(ring_module, schedule):
    rounds = 6
    x = np.random.default_rng(2).integers(-9, 10, (4 * rounds, 32)).astype(np.float32)
    out = np.zeros(rounds * 32, np.float32)
    ring_module.schedule = schedule
    ring_module.launch(Launch("bulk_ring", (1, 1, 1), (64, 1, 1), 1024, [x, rounds, 0, out]))
    np.testing.assert_array_equal(out.reshape(rounds, 32), x.reshape(rounds, 4, 32).sum(axis=1))


def test_reloading_a_stage_without_the_empty_wait_is_a_race(ring_module):
    """The consumers woke for round 0's phase; the producer's round-2 copy into the same stage is
    not ordered after their reads."""
    x = np.zeros((12, 32), np.float32)
    ring_module.schedule = "reverse"
    with pytest.raises(KernelRuntimeError, match=r"shared-memory race on dynamic shared memory.*the bulk copy "
                                                 r"issued by thread \(0,0,0\)"):
        ring_module.launch(Launch("bulk_ring", (1, 1, 1), (64, 1, 1), 1024, [x, 3, 1, np.zeros(96, np.float32)]))


def test_kernels_include_the_provided_header():
    src = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "kgen/platform.cuh"
#include "kgen/hopper.cuh"
extern "C" __global__ void all_arrive(int* out) {
  __shared__ unsigned long long bar;
  if (threadIdx.x == 0) kgen::mbar_init(&bar, blockDim.x);
  __syncthreads();
  kgen::mbar_arrive(&bar);
  kgen::mbar_wait(&bar, 0);
  out[threadIdx.x] = kgen::mbar_test_wait(&bar, 0) + 2 * kgen::mbar_test_wait(&bar, 1);
}
"""
    out = np.zeros(96, np.int32)
    CpuModule.from_source(src, ["all_arrive"]).launch(Launch("all_arrive", (1, 1, 1), (96, 1, 1), 0, [out]))
    assert (out == 1).all()


# ---- the same kernels on a GPU: phases, the ring and the bulk copy as the hardware runs them ---------
@pytest.fixture(scope="module")
def gpu_module(tmp_path_factory):
    return GpuModule(_source(gpu=True), ["phases", "ring", "bulk"], tmp_path_factory.mktemp("gpu"))


@pytest.mark.gpu
def test_the_gpu_walks_the_same_phases(gpu_module):
    out = np.full(11, -1, dtype=np.int32)
    _run(gpu_module, "phases", 1, [out])
    assert out.tolist() == [0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [0, 3])
def test_the_gpu_ring_gives_every_round(gpu_module, mode):
    rounds = 9
    out = np.full(rounds * 32, -1, dtype=np.int32)
    _run(gpu_module, "ring", 64, [out, rounds, mode])
    assert out.tolist() == [r * 100 + (lane + 7) % 32 for r in range(rounds) for lane in range(32)]


@pytest.mark.gpu
def test_the_gpu_bulk_copy_lands(gpu_module):
    n = 256
    src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    _run(gpu_module, "bulk", 64, [src, dst, np.zeros(n, np.uint8), n, 0], smem=n)
    assert dst.tolist() == [int(src[(i + 16) % n]) for i in range(n)]
