"""Race detection and thread schedules of the CPU backend (templates/simt/kgen_simt_race.h).

Planted shared-memory races must be reported with the kernel, block, both threads and both
source lines; the same kernels made correct must run clean under every schedule; kgen's own
generated kernels must run clean in race mode; a bug that depends on the thread order must
show under the varied schedules although the default order hides it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import inline_provided

import kgen
from kgen.compile.host import compile_host
from kgen.errors import ArgumentError, KernelRuntimeError
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule
from kgen.verify.runner import verify

SPECS = Path(__file__).resolve().parents[2] / "specs"

SRC = r"""
// ---- tree reduction: a missing __syncthreads is a race on s[] ----
extern "C" __global__ void reduce_racy(const float* x, float* out) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = x[blockIdx.x * 128 + t];
  __syncthreads();
  for (int k = 64; k > 0; k >>= 1) {
    if (t < k) s[t] += s[t + k];  // RACY_REDUCE
  }
  if (t == 0) out[blockIdx.x] = s[0];
}
extern "C" __global__ void reduce_ok(const float* x, float* out) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = x[blockIdx.x * 128 + t];
  __syncthreads();
  for (int k = 64; k > 0; k >>= 1) {
    if (t < k) s[t] += s[t + k];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

// ---- write/write on one word, and a write/read pair on different lines ----
extern "C" __global__ void flag_racy(int* out) {
  __shared__ int flag;
  if (threadIdx.x == 3) flag = 1;  // WRITE_A
  if (threadIdx.x == 40) flag = 2;  // WRITE_B
  __syncthreads();
  out[threadIdx.x] = flag;
}
extern "C" __global__ void publish_racy(int* out) {
  __shared__ int box[64];
  const int t = threadIdx.x;
  box[t] = t;                                  // PUBLISH
  out[t] = box[(t + 1) % 64];                  // CONSUME
}

// ---- dynamic shared memory ----
extern "C" __global__ void dyn_racy(float* out) {
  KGEN_DYNAMIC_SMEM(float, buf);
  const int t = threadIdx.x;
  buf[t] = (float)t;                           // DYN_WRITE
  out[t] = buf[blockDim.x - 1 - t];            // DYN_READ
}

// ---- inside a warp: __syncwarp orders, its absence races ----
extern "C" __global__ void warp_exchange(int* out, int sync) {
  __shared__ int s[32];
  const int t = threadIdx.x;
  s[t] = t * 3;                                // WARP_WRITE
  if (sync) __syncwarp();
  out[t] = s[(t + 5) & 31];                    // WARP_READ
}

// ---- atomics: concurrent atomics are fine; a plain store racing them is not ----
extern "C" __global__ void atomic_count(int* out, int racy) {
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  atomicAdd(&count, 1);                        // ATOMIC_ADD
  if (racy && threadIdx.x == 17) count = 100;  // PLAIN_STORE
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = count;
}

// ---- neighbouring bytes of one word written by different threads: not a race ----
extern "C" __global__ void bytes_ok(unsigned char* out) {
  __shared__ unsigned char b[64];
  const int t = threadIdx.x;
  b[t] = (unsigned char)(t + 1);
  __syncthreads();
  out[t] = b[63 - t];
}

// ---- order-dependent without a race: slots handed out by an atomic counter ----
// Correct only if threads take the counter in index order, which nothing guarantees.
extern "C" __global__ void ticket_order(int* counters, int* out) {
  const int mine = atomicAdd(&counters[blockIdx.x], 1);
  out[blockIdx.x * blockDim.x + mine] = threadIdx.x;
}
"""
KERNELS = ["reduce_racy", "reduce_ok", "flag_racy", "publish_racy", "dyn_racy", "warp_exchange", "atomic_count",
           "bytes_ok", "ticket_order"]
SCHEDULES = ["fifo", "reverse", "shuffle", "mixed"]


def line_of(marker: str) -> int:
    """kernel.cu line number of the source line carrying `// MARKER`."""
    return next(i for i, ln in enumerate(SRC.splitlines(), 1) if ln.rstrip().endswith(f"// {marker}"))


@pytest.fixture(scope="module")
def race_mod() -> CpuModule:
    return CpuModule.from_source(SRC, KERNELS, race_check=True)


def launch(mod, kernel, grid, block, *args, smem=0):
    mod.launch(Launch(kernel, grid, block, smem, list(args)))


def race_error(mod, kernel, grid, block, *args, smem=0) -> str:
    with pytest.raises(KernelRuntimeError, match="shared-memory race") as info:
        launch(mod, kernel, grid, block, *args, smem=smem)
    return str(info.value)


THREAD = r"thread \((\d+),0,0\)"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_missing_barrier_in_reduction_is_reported_with_both_lines(race_mod, schedule):
    mod = CpuModule(race_mod.artifact, schedule=schedule, seed=7)
    x = np.ones(128, np.float32)
    msg = race_error(mod, "reduce_racy", (1, 1, 1), (128, 1, 1), x, np.zeros(1, np.float32))
    assert "kernel 'reduce_racy' block (0,0,0)" in msg
    assert "__shared__ 's'" in msg
    threads = re.findall(THREAD, msg)
    assert len(threads) == 2 and threads[0] != threads[1], msg
    line = line_of("RACY_REDUCE")
    assert msg.count(f"kernel.cu:{line} `if (t < k) s[t] += s[t + k];") == 2, msg
    assert re.search(r"(reads|writes) it at .* and thread .* (read|wrote) it at", msg), msg


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_reduction_with_barrier_runs_clean_under_every_schedule(race_mod, schedule):
    mod = CpuModule(race_mod.artifact, schedule=schedule, seed=3)
    x = np.random.default_rng(0).standard_normal(4 * 128).astype(np.float32)
    out = np.zeros(4, np.float32)
    launch(mod, "reduce_ok", (4, 1, 1), (128, 1, 1), x, out)
    np.testing.assert_allclose(out, x.reshape(4, 128).sum(axis=1), rtol=1e-5)


def test_write_write_race_names_both_writers(race_mod):
    msg = race_error(race_mod, "flag_racy", (1, 1, 1), (64, 1, 1), np.zeros(64, np.int32))
    assert "__shared__ 'flag' (byte 0)" in msg
    assert sorted(re.findall(THREAD, msg)) == ["3", "40"]
    assert f"kernel.cu:{line_of('WRITE_A')}" in msg and f"kernel.cu:{line_of('WRITE_B')}" in msg
    assert "writes it" in msg and "wrote it" in msg


def test_read_of_a_neighbours_write_names_both_lines(race_mod):
    msg = race_error(race_mod, "publish_racy", (1, 1, 1), (64, 1, 1), np.zeros(64, np.int32))
    assert f"kernel.cu:{line_of('PUBLISH')} `box[t] = t;" in msg
    assert f"kernel.cu:{line_of('CONSUME')} `out[t] = box[(t + 1) % 64];" in msg


def test_dynamic_shared_memory_race(race_mod):
    n = 96
    msg = race_error(race_mod, "dyn_racy", (2, 1, 1), (n, 1, 1), np.zeros(n, np.float32), smem=n * 4)
    assert "dynamic shared memory (byte " in msg
    assert f"kernel.cu:{line_of('DYN_WRITE')}" in msg and f"kernel.cu:{line_of('DYN_READ')}" in msg


def test_syncwarp_orders_lanes_and_its_absence_is_a_race(race_mod):
    for schedule in SCHEDULES:
        mod = CpuModule(race_mod.artifact, schedule=schedule, seed=11)
        out = np.zeros(32, np.int32)
        launch(mod, "warp_exchange", (1, 1, 1), (32, 1, 1), out, np.int32(1))
        np.testing.assert_array_equal(out, ((np.arange(32) + 5) % 32) * 3)
    msg = race_error(race_mod, "warp_exchange", (1, 1, 1), (32, 1, 1), np.zeros(32, np.int32), np.int32(0))
    assert f"kernel.cu:{line_of('WARP_WRITE')}" in msg and f"kernel.cu:{line_of('WARP_READ')}" in msg


def test_atomics_do_not_race_each_other_but_a_plain_store_does(race_mod):
    out = np.zeros(3, np.int32)
    launch(race_mod, "atomic_count", (3, 1, 1), (64, 1, 1), out, np.int32(0))
    np.testing.assert_array_equal(out, [64, 64, 64])
    msg = race_error(race_mod, "atomic_count", (1, 1, 1), (64, 1, 1), out, np.int32(1))
    assert "__shared__ 'count'" in msg
    assert f"kernel.cu:{line_of('PLAIN_STORE')}" in msg and f"kernel.cu:{line_of('ATOMIC_ADD')}" in msg
    assert "atomically" in msg


def test_different_bytes_of_one_word_are_not_a_race(race_mod):
    out = np.zeros(64, np.uint8)
    launch(race_mod, "bytes_ok", (1, 1, 1), (64, 1, 1), out)
    np.testing.assert_array_equal(out, 64 - np.arange(64))


def test_varied_schedules_expose_an_order_dependent_bug_the_default_order_hides(race_mod):
    """ticket_order assumes threads take an atomic ticket in index order: no race, and the
    default (FIFO) order makes it look right; reverse, shuffled and mixed schedules do not."""
    blocks, n = 8, 64
    identity = np.tile(np.arange(n, dtype=np.int32), blocks)
    plain = CpuModule(compile_host(SRC, KERNELS))  # no race detection: FIFO
    out = np.full(blocks * n, -1, np.int32)
    launch(plain, "ticket_order", (blocks, 1, 1), (n, 1, 1), np.zeros(blocks, np.int32), out)
    np.testing.assert_array_equal(out, identity)  # hidden by the default order
    for schedule in ("reverse", "shuffle", None):  # None: race mode's default, mixed per block
        mod = CpuModule(race_mod.artifact, schedule=schedule, seed=1)
        out[:] = -1
        launch(mod, "ticket_order", (blocks, 1, 1), (n, 1, 1), np.zeros(blocks, np.int32), out)
        per_block = out.reshape(blocks, n)
        assert all(sorted(row) == list(range(n)) for row in per_block.tolist())  # every slot written once
        assert not np.array_equal(out, identity), schedule
    assert (per_block == np.arange(n)).all(axis=1).any()  # mixed: some blocks FIFO, some not
    assert not (per_block == np.arange(n)).all(axis=1).all()


def test_schedules_are_repeatable_for_a_seed(race_mod):
    runs = []
    for seed in (5, 5, 6):
        out = np.full(4 * 64, -1, np.int32)
        launch(CpuModule(race_mod.artifact, schedule="shuffle", seed=seed), "ticket_order", (4, 1, 1), (64, 1, 1),
               np.zeros(4, np.int32), out)
        runs.append(out)
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_race_check_and_sanitize_cannot_be_combined():
    with pytest.raises(ValueError, match="cannot be combined"):
        compile_host(SRC, KERNELS, sanitize=True, race_check=True)


def test_unknown_schedule_is_refused(race_mod):
    with pytest.raises(ArgumentError, match="schedule must be one of"):
        CpuModule(race_mod.artifact, schedule="backwards")


# ---------------------------------------------------------------- kgen's own kernels
@pytest.mark.parametrize("spec_name,config", [
    pytest.param("llama3_8b_decode", None, marks=pytest.mark.full),  # fp16, one pass (~25 s; the decode pipeline
                                                     # verifies in race mode by default: test_paged_decode.py)
    pytest.param("llama3_8b_decode", {"partition_size": 256},  # fp16, split-KV + merge kernel (~30 s: full tier;
                 marks=pytest.mark.full),                   # tests/families/attention/test_paged_decode.py races a split)
    ("cache_write_fp8_e4m3", None),
    ("copy_blocks_fp16", None),
])
def test_generated_kernels_verify_clean_in_race_mode(spec_name, config):
    spec = kgen.load_spec(SPECS / f"{spec_name}.yaml")
    kern = kgen.build(spec, backend="cpu", config=config, race_check=True, seed=2)
    assert kern.module.artifact.race_check
    assert kern.report.passed, kern.report


def test_generated_decode_without_a_barrier_is_reported():
    """The race detector sees the generated kernel's shared memory, cp.async copies included: drop
    the barrier between the wait for a tile's copies and reading the tile, and it names both lines."""
    spec = kgen.load_spec(SPECS / "llama3_8b_decode.yaml")  # the CUDA-core body (mma_min_group 0)
    kern = kgen.build(spec, backend="cpu", config={"mma_min_group": 0}, verify=False, race_check=True)
    # the body, the ring and the KV-format part as kernel code
    source = inline_provided(inline_provided(kern.source), ("kgen/attention/stage_ring.cuh", "kgen/attention/kv_format.cuh"))
    barrier = source.index("__syncthreads();  // everybody's have")
    mutant = source[:barrier] + source[barrier + len("__syncthreads();"):]
    kern.module = CpuModule.from_source(mutant, kern.kernel_names, race_check=True)
    report = verify(kern, seed=1, cases=["len_B+1"])  # the runtime's error is the case's verdict
    assert not report.passed
    msg = report.cases[-1].note
    assert "shared-memory race on __shared__ 'smem'" in msg, msg
    lines = mutant.splitlines()
    write = next(i for i, ln in enumerate(lines, 1) if "cp_async<S::K_COPY>(ks" in ln)  # the copy's issue
    read = next(i for i, ln in enumerate(lines, 1) if "load_as_float<typename Cfg::kv_t, N>(rows + t * W" in ln)
    assert "kernel 'llama3_8b_decode' block (" in msg
    assert f"kernel.cu:{write}" in msg and f"kernel.cu:{read}" in msg, msg
