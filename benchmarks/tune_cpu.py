"""Tuning figures for the Llama decode spec on the CPU backend (wall clock, fiber runtime).

    PYTHONPATH=. .venv/bin/python benchmarks/tune_cpu.py [--spec specs/llama3_8b_decode.yaml] [--measure-s 0.05]

Prints the number of configs, pruned/failed counts, every config's median per bucket,
the best/worst spread and the tuned-vs-default speedup per bucket. CPU timings say how
the kernel runs on the fiber runtime, nothing about a GPU.
"""

from __future__ import annotations

import argparse
import math
import tempfile

import kgen
from kgen.tune.runner import tune_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="specs/llama3_8b_decode.yaml")
    ap.add_argument("--measure-s", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    spec = kgen.load_spec(args.spec)
    with tempfile.TemporaryDirectory() as root:  # don't overwrite the user's saved results
        r = tune_spec(spec, backend="cpu", measure_s=args.measure_s, seed=args.seed, budget_s=1e6,
                      strategy="exhaustive", root=root)
    space, ms = r["space"], r["measurements"]
    failed = {str(m["config"]) for m in ms if m["status"] != "ok"}
    print(f"{spec.name} on {r['device']['name']} ({r['clock']}, {r['seconds']:.1f} s tuning)")
    print(f"configs: {len(space['configs']) + len(space['pruned'])} in the space, {len(space['pruned'])} pruned, "
          f"{len(failed)} failed, {len(space['configs']) - len(failed)} timed on "
          f"{len(r['winners'])} buckets ({len(ms)} measurements)")
    buckets = list(r["winners"])
    by = {(str(m["config"]), f"{m['batch']}x{m['context']}"): m for m in ms}
    print(f"{'config':34s}" + "".join(f"{b:>12s}" for b in buckets) + "   (median ms)")
    for c in space["configs"]:
        cells = []
        for b in buckets:
            m = by.get((str(c), b))
            t = m["median_s"] * 1e3 if m and m["status"] == "ok" else math.inf
            cells.append(f"{t:11.3f}{'*' if r['winners'][b] == c else ' '}")
        print(f"{str(c):34s}" + "".join(cells))
    print(f"{'bucket':>10s} {'best ms':>9s} {'worst ms':>9s} {'worst/best':>10s} {'default/best':>12s}")
    for b in buckets:
        ok = [m["median_s"] for (c, bb), m in by.items() if bb == b and m["status"] == "ok"]
        default = by[(str(space["defaults"]), b)]["median_s"]
        print(f"{b:>10s} {min(ok) * 1e3:9.3f} {max(ok) * 1e3:9.3f} {max(ok) / min(ok):10.2f} "
              f"{default / min(ok):12.2f}")


if __name__ == "__main__":
    main()
