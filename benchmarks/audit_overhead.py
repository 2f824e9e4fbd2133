"""Per-call overhead of `kern.audit(rate)` on the CPU backend (kgen/audit.py).

The same decode call, timed through the kernel itself and through audited wrappers at rates 0,
0.01 and 1, the four interleaved call by call (so load on the machine hits them alike); prints
the median per-call time of each and its ratio to the plain kernel in one table. At rate 0 the
wrapper is one counter and one branch per call; at 0.01 one call in a hundred also computes the
float64 reference and judges it; at 1 every call does. No assertions: a table of one run.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_overhead.py [--spec specs/llama3_8b_decode.yaml]
        [--batch 2] [--context 128] [--calls 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import kgen
from kgen.families.attention.decode_cases import make_decode_case

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default=str(ROOT / "specs" / "llama3_8b_decode.yaml"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--calls", type=int, default=100, help="calls per variant (rate 1 runs calls // 10)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    spec = kgen.load_spec(a.spec)
    kern = kgen.build(spec, backend="cpu", verify=False)
    args = make_decode_case(spec, [a.context] * a.batch, np.random.default_rng(a.seed))
    args.pop("out")
    out = np.empty(args["q"].shape, dtype=args["q"].dtype)
    plan = kern.plan(args["seq_lens"])
    variants = {"kernel": kern, "audit 0": kern.audit(0.0, seed=a.seed),
                "audit 0.01": kern.audit(0.01, seed=a.seed), "audit 1": kern.audit(1.0, seed=a.seed)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up: caches, the first plan
        fn(**args, out=out, plan=plan)
    for i in range(a.calls):
        for name, fn in variants.items():
            if name == "audit 1" and i % 10:
                continue  # the reference is slow: a tenth of the calls is enough for its median
            t0 = time.perf_counter()
            fn(**args, out=out, plan=plan)
            times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["kernel"])
    print(f"{spec.name} on the CPU backend: batch {a.batch} x {a.context} tokens, {a.calls} calls per variant "
          f"(rate 1: {len(times['audit 1'])})")
    print(f"{'variant':<12} {'min ms':>10} {'median ms':>10} {'mean ms':>10} {'ratio':>8} {'checked':>8}")
    for name, ts in times.items():
        checked = variants[name].stats.checked if name != "kernel" else 0
        print(f"{name:<12} {min(ts) * 1e3:>10.3f} {statistics.median(ts) * 1e3:>10.3f} {statistics.fmean(ts) * 1e3:>10.3f} "
              f"{statistics.median(ts) / base:>8.3f} {checked:>8}")
    print("ratio: median / the plain kernel's median")
    for what, pick in (("median", statistics.median), ("min", min)):
        extra = (pick(times["audit 0"]) - pick(times["kernel"])) * 1e6
        print(f"rate 0 vs the plain kernel: {extra:+.1f} us per call ({what} difference; the kernel call itself "
              f"is {pick(times['kernel']) * 1e3:.3f} ms): within the run's noise when |difference| is of the "
              "order of the min/median spread")


if __name__ == "__main__":
    main()
