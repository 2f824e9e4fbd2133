"""Autotuning: search the spec's tuning space over shape buckets and time every
(config, bucket) pair; the results are saved by kgen/tune/results.py.

    results = tune_spec(spec, backend="cpu", budget_s=30)     # plain JSON data, saved
    results["winners"]["4x1024"]                               # the config for batch 4, context 1024
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from kgen.build import select_backend
from kgen.errors import KernelRuntimeError, KgenUserError
from kgen.seeds import fresh_seed
from kgen.tune.measure import make_task, run_task
from kgen.tune.ray_executor import ray_map
from kgen.tune.results import (
    FORMAT,
    bucket_name,
    device_info,
    results_path,
    save_results,
)
from kgen.tune.search import config_key, expand_space, resolve_buckets, search, winners
from kgen.version import __version__

MEASURE_S = {"cpu": 0.05, "cuda": 0.2}  # timing budget per (config, bucket)
OVERHEAD_S = {"cpu": 0.4, "cuda": 0.5}  # inputs, reference, verification per measurement (estimate)
DEFAULT_BUDGET_S = 120.0


# ------------------------------------------------------------------ tuning

def _executor(name: str):
    if name == "local":
        return lambda tasks: [run_task(t) for t in tasks]
    if name == "ray":
        return ray_map
    raise KgenUserError(f"executor must be local or ray (got {name!r})")


def tune_spec(spec, backend: str = "auto", buckets: dict | None = None, budget_s: float = DEFAULT_BUDGET_S,
              strategy: str = "auto", executor: str | Callable = "local", measure_s: float | None = None,
              seed: int | None = None, save: bool = True, root: Path | None = None,
              progress: Callable[[dict, dict], None] | None = None) -> dict:
    """Tune `spec` and return the results (see docs/tuning.md for the format).

    budget_s bounds the number of measurements (budget_s / (measure_s + overhead)); when
    every config on every bucket does not fit, the search is a hill climb (kgen/tune/search.py).
    `executor` is "local", "ray" or a callable mapping a list of task dicts to result dicts.
    `progress(event, state)` is called after each batch of measurements."""
    backend = select_backend(backend)
    space = expand_space(spec)
    bucket_list = resolve_buckets(spec, backend, buckets)
    if budget_s <= 0:
        raise KgenUserError(f"budget_s must be positive (got {budget_s})")
    measure_s = MEASURE_S[backend] if measure_s is None else float(measure_s)
    max_evals = max(1, int(budget_s / (measure_s + OVERHEAD_S[backend])))
    seed = fresh_seed() if seed is None else int(seed)
    run = _executor(executor) if isinstance(executor, str) else executor
    info = device_info(backend)
    records: list[dict] = []
    state = {"done": 0, "planned": len(space.configs) * len(bucket_list), "best": {}}

    def evaluate(pairs):
        tasks = [make_task(spec, c, b, backend, measure_s, seed + len(records) + i) for i, (c, b) in enumerate(pairs)]
        results = run(tasks)
        for r in results:
            records.append(r)
            state["done"] += 1
            b = bucket_name((r["batch"], r["context"]))
            if r["status"] == "ok" and r["median_s"] < state["best"].get(b, (math.inf,))[0]:
                state["best"][b] = (r["median_s"], r["config"])
        if progress is not None:
            progress({"batch": len(pairs)}, state)
        return [r["median_s"] for r in results]

    started = time.perf_counter()
    used, measured = search(strategy, space.configs, bucket_list, evaluate, max_evals, start=space.defaults)
    best = winners(measured, bucket_list)
    by_key = {config_key(c): c for c in space.configs}
    if all(k is None for k in best.values()):
        reasons = sorted({f"{r['status']}: {r['reason']}" for r in records})
        raise KernelRuntimeError(f"{spec.name}: every config failed on every bucket; nothing to choose:\n  "
                                 + "\n  ".join(reasons[:8]))
    win = {bucket_name(b): (by_key[k] if k is not None else None) for b, k in best.items()}
    results = {
        "format": FORMAT, "kgen_version": __version__, "spec_name": spec.name, "spec_hash": spec.spec_hash(),
        "device": info, "clock": "cuda-events" if backend == "cuda" else "cpu-wall",
        "note": None if backend == "cuda" else "CPU-backend wall-clock timings: meaningless as a GPU ranking",
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - started, 3), "seed": seed, "strategy": used,
        "budget_s": budget_s, "measure_s": measure_s,
        "buckets": {"batch": sorted({b for b, _ in bucket_list}), "context": sorted({c for _, c in bucket_list})},
        "space": {"params": {k: list(v) for k, v in spec.tuning.params.items()},
                  "constraints": list(spec.tuning.constraints), "configs": space.configs,
                  "pruned": space.pruned, "defaults": space.defaults},
        "measurements": records,
        "winners": win,
        "default_winner": _overall_winner(measured, best, by_key, space.defaults),
    }
    if save:
        save_results(results, results_path(spec, info, root))
    return results


def _overall_winner(measured: dict, best: dict, by_key: dict, defaults: dict) -> dict:
    """The one config for a single-config build: least geometric-mean slowdown over the buckets
    where it was measured against each bucket's winner (configs measured on every bucket first)."""
    buckets = [b for b, k in best.items() if k is not None]
    scores = []
    for key in by_key:
        ratios = [measured[(key, b)] / measured[(best[b], b)] for b in buckets if (key, b) in measured]
        if ratios and all(math.isfinite(r) for r in ratios):
            gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            scores.append((-len(ratios), gm, key))
    return dict(by_key[min(scores)[2]]) if scores else dict(defaults)
