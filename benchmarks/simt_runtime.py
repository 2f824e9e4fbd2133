"""CPU SIMT runtime figures: fiber switches per second and g++ build times.

    PYTHONPATH=. .venv/bin/python benchmarks/simt_runtime.py [--iters N] [--threads W] [--launch-only]

A "switch" is one fiber-to-fiber context switch: a __syncthreads in a block of T threads
costs T switches, a full-warp shuffle round costs 32 switches per warp. The launch rows time
`CpuModule.launch` of a one-block kernel that only stores, per block size (fiber stacks, the
runtime's fixed cost, Python's argument packing); `--launch-only` gives only those.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

SRC = r"""
extern "C" __global__ void __launch_bounds__(256) bench_sync(float* out, int iters) {
  float acc = threadIdx.x;
  for (int i = 0; i < iters; ++i) { acc += 1.0f; __syncthreads(); }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(256) bench_shfl(float* out, int iters) {
  float v = threadIdx.x;
  for (int i = 0; i < iters; ++i) v += __shfl_xor_sync(0xffffffffu, v, i & 31) * 0.5f;
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
extern "C" __global__ void __launch_bounds__(1024) bench_empty(float* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}
"""


def _time(fn, reps=3):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


LAUNCH_BLOCKS = (1, 32, 128, 1024)  # threads per block of the launch-overhead rows


def launch_rows(art, workers: int, blocks: int) -> list[tuple[str, str, str]]:
    """Launch overhead per block size: best of 3 rounds of n launches (fewer for big blocks)."""
    from kgen.runtime.base import Launch
    from kgen.runtime.cpu import CpuModule

    mod = CpuModule(art, workers=workers)
    rows = []
    for threads in LAUNCH_BLOCKS:
        n = max(20, min(500, 16000 // threads))
        out = np.zeros(blocks * threads, np.float32)
        ln = Launch("bench_empty", (blocks, 1, 1), (threads, 1, 1), 0, [out])
        mod.launch(ln)  # first launch: library state, helper threads
        t = _time(lambda m=mod, ln=ln, n=n: [m.launch(ln) for _ in range(n)])
        rows.append((f"launch overhead, {blocks} block(s) x {threads} thr, {workers or os.cpu_count()} worker(s)",
                     f"{t / n * 1e6:.1f} us/launch", f"best of 3 x {n}"))
    return rows


def main() -> None:
    from kgen.compile.host import compile_host
    from kgen.runtime.base import Launch
    from kgen.runtime.cpu import CpuModule

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=0, help="worker threads (0: all CPUs)")
    ap.add_argument("--launch-only", action="store_true", help="only the launch-overhead rows (cached build)")
    a = ap.parse_args()

    rows = []
    if a.launch_only:
        art = compile_host(SRC, ["bench_sync", "bench_shfl", "bench_empty"])
        rows += launch_rows(art, 1, 1) + launch_rows(art, a.threads, 4)
        _print(rows)
        return
    tmp = tempfile.TemporaryDirectory()
    if True:
        os.environ["KGEN_CACHE_DIR"] = tmp.name
        t0 = time.perf_counter()
        art = compile_host(SRC, ["bench_sync", "bench_shfl", "bench_empty"])
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compile_host(SRC, ["bench_sync", "bench_shfl", "bench_empty"])
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        compile_host(SRC, ["bench_sync", "bench_shfl", "bench_empty"], sanitize=True)
        cold_san = time.perf_counter() - t0
    rows.append(("g++ build, cold (3 kernels)", f"{cold * 1e3:.0f} ms", ""))
    rows.append(("g++ build, cold, sanitize=True", f"{cold_san * 1e3:.0f} ms", ""))
    rows.append(("compile_host, warm (cache hit)", f"{warm * 1e3:.2f} ms", ""))

    for workers, label in ((1, "1 worker"), (a.threads, f"{a.threads or os.cpu_count()} workers")):
        mod = CpuModule(art, workers=workers)
        nblk = 8
        out = np.zeros(nblk * 256, np.float32)
        it = np.int32(a.iters)
        sync = Launch("bench_sync", (nblk, 1, 1), (256, 1, 1), 0, [out, it])
        shfl = Launch("bench_shfl", (nblk, 1, 1), (256, 1, 1), 0, [out, it])
        t = _time(lambda m=mod, ln=sync: m.launch(ln))
        sw = nblk * 256 * a.iters
        rows.append((f"__syncthreads, 256 thr, {label}", f"{sw / t / 1e6:.1f} M switches/s", f"{t * 1e3:.1f} ms"))
        t = _time(lambda m=mod, ln=shfl: m.launch(ln))
        rows.append((f"__shfl_xor_sync, 256 thr, {label}", f"{sw / t / 1e6:.1f} M switches/s",
                     f"{sw / 32 / t / 1e6:.2f} M warp-shuffles/s"))
    rows += launch_rows(art, 1, 1) + launch_rows(art, a.threads, 4)
    tmp.cleanup()
    _print(rows)


def _print(rows: list[tuple[str, str, str]]) -> None:
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'value':>26}  note")
    for name, val, note in rows:
        print(f"{name:<{w}}  {val:>26}  {note}")


if __name__ == "__main__":
    main()
