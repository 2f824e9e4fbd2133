"""GPU figures of the decode family (issues 3 and 4), for a session that has a GPU:

  1. device copy bandwidth (cupy device-to-device copy, bytes read + written / time)
  2. the Llama decode spec in fp16 and fp8_e4m3 (per_tensor) at batch 64 x context 4096:
     median kernel time (CUDA events, L2 flushed between launches), KV bytes read per call,
     achieved bandwidth and its fraction of the copy bandwidth
  3. the verification matrix on the CUDA backend, and the max |CPU backend - GPU| on identical inputs

Without a GPU it says so and exits 2 (nothing is faked).

    .venv/bin/python benchmarks/gpu_decode.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_figures import kv_bytes_per_token  # noqa: E402

from kgen.arrays import args_to_backend, to_numpy  # noqa: E402
from kgen.build import build  # noqa: E402
from kgen.families.decode_cases import make_decode_case  # noqa: E402
from kgen.runtime.cuda import gpu_available  # noqa: E402
from kgen.spec.models import load_spec  # noqa: E402
from kgen.tune.measure import _CudaTimer  # noqa: E402  (the tuner's event timer with L2 flush)

BATCH, CONTEXT = 64, 4096


def copy_bandwidth(reps: int) -> float:
    import cupy

    n = 1 << 28  # 1 GiB of float32 each way
    src, dst = cupy.ones(n // 4, dtype=cupy.float32), cupy.empty(n // 4, dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * n / statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not gpu_available():
        print("no CUDA GPU visible: these figures need one (nothing measured)", file=sys.stderr)
        return 2
    copy_bw = copy_bandwidth(args.reps)
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
    llama = load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")
    variants = {
        "fp16": llama,
        "fp8_e4m3": llama.with_overrides(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor",
                                            "targets": ["sm_90"]}),
    }
    print(f"{'variant':10s} {'config':40s} {'median us':>10s} {'KV MB':>8s} {'GB/s':>7s} {'of copy':>8s} "
          f"{'matrix':>8s} {'max|cpu-gpu|':>13s}")
    for name, spec in variants.items():
        gpu = build(spec, backend="cuda", seed=1)
        host = make_decode_case(spec, [CONTEXT] * BATCH, np.random.default_rng(0))
        dev = args_to_backend(host, "cuda")
        timer = _CudaTimer()
        for _ in range(3):
            gpu(**dev)
        times = [timer.time(lambda g=gpu, d=dev: g(**d)) for _ in range(args.reps)]
        t = statistics.median(times)
        kv = kv_bytes_per_token(spec) * BATCH * CONTEXT
        small = make_decode_case(spec, [1, 17, 300, 1000], np.random.default_rng(2))
        cpu = build(spec, backend="cpu", verify=False)
        diff = float(np.abs(cpu(**small).astype(np.float64)
                            - to_numpy(gpu(**args_to_backend(small, "cuda"))).astype(np.float64)).max())
        print(f"{name:10s} {str(gpu.config):40s} {t * 1e6:10.1f} {kv / 1e6:8.1f} {kv / t / 1e9:7.0f} "
              f"{kv / t / copy_bw:8.1%} {'pass' if gpu.report.passed else 'FAIL':>8s} {diff:13.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
