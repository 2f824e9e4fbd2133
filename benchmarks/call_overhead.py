"""Host cost of one kernel call: the Python work before the launches (argument checks, planning,
scratch, packing), without a plan and with one. Measured with `Kernel.bind`, which does exactly
that work and launches nothing, on the CPU backend (numpy arrays; on CUDA the same code runs over
CuPy arrays or torch tensors, and the launches are added). Prints a table; no assertions.

    PYTHONPATH=. .venv/bin/python benchmarks/call_overhead.py [--spec specs/llama3_8b_decode.yaml] [--seqs 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kgen
from kgen.families.attention.decode_cases import make_decode_case


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="specs/llama3_8b_decode.yaml")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    spec = kgen.load_spec(args.spec)
    kern = kgen.build(spec, backend="cpu", verify=False)
    kern.debug = False  # the serving setting: no value checks (they would read device memory on a GPU)
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(1, 2048, size=args.seqs)]
    call = make_decode_case(spec, lens, rng)
    plan = kern.plan(call["seq_lens"])
    rows = [("without a plan", _median_us(lambda: kern.bind(**call), args.repeats)),
            ("with a plan", _median_us(lambda: kern.bind(plan=plan, **call), args.repeats))]
    print(f"{spec.name}, config {kern.config}, {args.seqs} sequences, median of {args.repeats} "
          "(host Python time of Kernel.bind on this machine):")
    print("| call | µs per call |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.0f} |")


if __name__ == "__main__":
    main()
