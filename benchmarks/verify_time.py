"""Time of the full verification case matrix on the CPU backend (issue 3 figure).

Run: PYTHONPATH=. .venv/bin/python benchmarks/verify_time.py [--reps 3] [SPEC ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kgen.build import build
from kgen.families.registry import family_for
from kgen.spec.models import load_spec
from kgen.verify.runner import verify

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("specs", nargs="*", default=[str(ROOT / "specs" / "llama3_8b_decode.yaml")])
    args = ap.parse_args()
    print(f"{'spec':28s} {'config':40s} {'cases':>5s} {'matrix time (median, min..max)':>34s}")
    for path in args.specs:
        spec = load_spec(path)
        family = family_for(spec)
        if family.rows is None or family.rows.packed:  # decode kernels only: one query row per sequence
            continue
        configs = [None] + ([{"partition_size": 4 * spec.kv_cache.block_size}] if "partition_size" in family.params else [])
        for config in configs:
            kernel = build(spec, backend="cpu", verify=False, config=config)
            times, n = [], 0
            for rep in range(args.reps):
                t = time.perf_counter()
                report = verify(kernel, seed=rep)
                times.append(time.perf_counter() - t)
                n = len(report.cases)
                assert report.passed, report.summary()
            print(f"{spec.name:28s} {str(kernel.config):40s} {n:5d} "
                  f"{statistics.median(times):12.2f} s ({min(times):.2f}..{max(times):.2f})")


if __name__ == "__main__":
    main()
