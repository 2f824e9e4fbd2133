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
from kgen.tune.fresh import run_in_fresh_process
from kgen.tune.measure import BUDGET, PRUNED, make_task, run_bounded
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
    """A batch executor (tasks -> results), or None for "local": this process, one task at a time."""
    if name == "local":
        return None
    if name == "ray":
        return ray_map
    raise KgenUserError(f"executor must be local or ray (got {name!r})")


def tune_spec(spec, backend: str = "auto", buckets: dict | None = None, budget_s: float = DEFAULT_BUDGET_S,
              strategy: str = "auto", executor: str | Callable = "local", measure_s: float | None = None,
              seed: int | None = None, save: bool = True, root: Path | None = None,
              progress: Callable[[dict, dict], None] | None = None) -> dict:
    """Tune `spec` and return the results (see docs/tuning.md for the format).

    budget_s bounds the whole run, compiles included: no measurement starts once it is spent;
    on the CPU backend one still running is stopped (kgen.tune.measure.run_bounded; a CUDA one
    finishes: milliseconds); the results say what was done (`complete`, `not_run`). It also
    sizes the search: when every config on every bucket does not fit in
    budget_s / (measure_s + overhead) measurements, the search is a hill climb
    (kgen/tune/search.py); exhaustive goes bucket by bucket from the cheapest, defaults first.
    `executor` is "local", "ray" or a callable mapping a list of task dicts to result dicts.
    `progress(record, state)` is called after each measurement (local; a batch executor: after
    its batch) with the measurement's record and the run's state (done, not_run, planned,
    elapsed_s, best per bucket)."""
    started = time.perf_counter()
    if budget_s <= 0:
        raise KgenUserError(f"budget_s must be positive (got {budget_s})")
    deadline = time.time() + budget_s  # wall-clock epoch: tasks may run in other processes
    backend = select_backend(backend)
    space = expand_space(spec)
    bucket_list = resolve_buckets(spec, backend, buckets)
    measure_s = MEASURE_S[backend] if measure_s is None else float(measure_s)
    max_evals = max(1, int(budget_s / (measure_s + OVERHEAD_S[backend])))
    seed = fresh_seed() if seed is None else int(seed)
    run = _executor(executor) if isinstance(executor, str) else executor
    info = device_info(backend)
    records: list[dict] = []
    skipped: list[dict] = []  # tasks the budget did not reach
    state = {"done": 0, "not_run": 0, "planned": len(space.configs) * len(bucket_list), "best": {},
             "elapsed_s": 0.0}
    made = 0

    def record(r: dict) -> None:
        if r["status"] == BUDGET:
            skipped.append(r)
            state["not_run"] += 1
        else:
            records.append(r)
            state["done"] += 1
            b = bucket_name((r["batch"], r["context"]))
            if r["status"] == "ok" and r["median_s"] < state["best"].get(b, (math.inf,))[0]:
                state["best"][b] = (r["median_s"], r["config"])
        state["elapsed_s"] = time.perf_counter() - started
        if progress is not None:
            progress(r, state)

    def evaluate(pairs):
        nonlocal made
        tasks = [make_task(spec, c, b, backend, measure_s, seed + made + i, deadline) for i, (c, b) in enumerate(pairs)]
        made += len(tasks)
        if run is None:  # here, one at a time: progress after each
            results = []
            for t in tasks:
                # CPU backend: a measurement past the deadline is stopped (run_bounded, a fork); CUDA:
                # each in a spawned process (a fault loses that process's context, a hang is killed).
                results.append(run_bounded(t) if backend == "cpu" else run_in_fresh_process(t))
                record(results[-1])
        else:
            results = run(tasks)
            for r in results:
                record(r)
        return [r["median_s"] for r in results]

    used, measured = search(strategy, space.configs, bucket_list, evaluate, max_evals, start=space.defaults)
    for r in skipped:  # never run: not a measurement (and not a failure) of its config
        measured.pop((config_key(r["config"]), (r["batch"], r["context"])), None)
    best = winners(measured, bucket_list)
    by_key = {config_key(c): c for c in space.configs}
    if all(k is None for k in best.values()):
        reasons = sorted({f"{r['status']}: {r['reason']}" for r in records})
        if skipped:
            raise KernelRuntimeError(
                f"{spec.name}: the budget of {budget_s:g} s was spent before any config was timed "
                f"({len(records)} measurement(s) run, none successful; {len(skipped)} not run): raise --budget-s"
                + "".join(f"\n  {r}" for r in reasons[:8]))
        raise KernelRuntimeError(f"{spec.name}: every config failed on every bucket; nothing to choose:\n  "
                                 + "\n  ".join(reasons[:8]))
    win = {bucket_name(b): (by_key[k] if k is not None else None) for b, k in best.items()}
    configs, pruned = _prune_by_ptxas(space.configs, space.pruned, records)
    results = {
        "format": FORMAT, "kgen_version": __version__, "spec_name": spec.name, "spec_hash": spec.spec_hash(),
        "device": info, "clock": "cuda-events" if backend == "cuda" else "cpu-wall",
        "note": None if backend == "cuda" else "CPU-backend wall-clock timings: meaningless as a GPU ranking",
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - started, 3), "seed": seed, "strategy": used,
        "budget_s": budget_s, "measure_s": measure_s,
        "complete": not skipped, "not_run": len(skipped),
        "buckets": {"batch": sorted({b for b, _ in bucket_list}), "context": sorted({c for _, c in bucket_list})},
        "space": {"params": {k: list(v) for k, v in spec.tuning.params.items()},
                  "constraints": list(spec.tuning.constraints), "configs": configs,
                  "pruned": pruned, "defaults": space.defaults},
        "measurements": records,
        "winners": win,
        "default_winner": _overall_winner(measured, best, by_key, space.defaults),
    }
    if save:
        save_results(results, results_path(spec, info, root))
    return results


def _prune_by_ptxas(configs: list[dict], pruned: list[dict], records: list[dict]) -> tuple[list[dict], list[dict]]:
    """The space's configs and pruned entries once compiling has spoken: a config whose cubin drew a
    ptxas advisory (a measurement of status PRUNED) moves to the pruned list with the advisory as its
    reason, once, like the configs the constraints and the template's checks pruned before compiling."""
    reasons = {config_key(r["config"]): r["reason"] for r in records if r["status"] == PRUNED}
    kept = [c for c in configs if config_key(c) not in reasons]
    return kept, pruned + [{"config": c, "reason": reasons[config_key(c)]} for c in configs
                           if config_key(c) in reasons]


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
