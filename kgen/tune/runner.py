"""Autotuning: search the spec's tuning space over shape buckets, persist every timing.

    results = tune_spec(spec, backend="cpu", budget_s=30)     # plain JSON data, saved
    results["winners"]["4x1024"]                               # the config for batch 4, context 1024
    load_results(spec, "cpu")                                  # None + a warning on any mismatch

Results live in <cache dir>/tuning/<spec name>/<device slug>.json (and in
generated/<name>/manifest.json under "tuning"). They record the device (GPU name and
compute capability, or CPU model), driver/NVRTC/compiler versions, spec hash and kgen
version; results whose record differs from the current one are never used silently.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from kgen.errors import KernelRuntimeError, KgenUserError
from kgen.fileio import atomic_write_text
from kgen.runtime.cuda import require_gpu
from kgen.seeds import fresh_seed
from kgen.tune.measure import make_task, run_task
from kgen.tune.search import config_key, expand_space, resolve_buckets, search, winners
from kgen.version import __version__

FORMAT = 1
MEASURE_S = {"cpu": 0.05, "cuda": 0.2}  # timing budget per (config, bucket)
OVERHEAD_S = {"cpu": 0.4, "cuda": 0.5}  # inputs, reference, verification per measurement (estimate)
DEFAULT_BUDGET_S = 120.0


class TuningWarning(UserWarning):
    """Tuning results exist but cannot be used (other device, spec or version; corrupt)."""


def bucket_name(bucket) -> str:
    return f"{bucket[0]}x{bucket[1]}"


# ------------------------------------------------------------------ the device record

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(backend: str) -> dict:
    """What a timing depends on besides the spec: the device, its driver, the compilers."""
    from kgen.compile.nvrtc import nvrtc_version

    info: dict = {"backend": backend}
    try:
        info["nvrtc"] = nvrtc_version()
    except Exception as e:  # noqa: BLE001 - the record says why it is missing
        info["nvrtc"] = f"unavailable ({type(e).__name__})"
    if backend == "cuda":
        require_gpu()
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        info |= {"name": props["name"].decode(), "compute_capability": "sm_" + dev.compute_capability,
                 "driver": str(cupy.cuda.runtime.driverGetVersion())}
    else:
        from kgen.compile.host import compiler, compiler_version

        info |= {"name": _cpu_model(), "machine": platform.machine(), "cpus": os.cpu_count(),
                 "compiler": compiler_version(compiler()).splitlines()[0]}
    return info


def device_slug(info: dict) -> str:
    text = f"{info['backend']}-{info['name']}-{info.get('compute_capability', info.get('machine', ''))}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120]


def results_path(spec, info: dict, root: Path | None = None) -> Path:
    from kgen import settings

    return Path(root or settings.cache_dir()) / "tuning" / spec.name / f"{device_slug(info)}.json"


# ------------------------------------------------------------------ tuning

def _executor(name: str):
    if name == "local":
        return lambda tasks: [run_task(t) for t in tasks]
    if name == "ray":
        from kgen.tune.ray_executor import ray_map

        return ray_map
    raise KgenUserError(f"executor must be local or ray (got {name!r})")


def tune_spec(spec, backend: str = "auto", buckets: dict | None = None, budget_s: float = DEFAULT_BUDGET_S,
              strategy: str = "auto", executor: str | Callable = "local", measure_s: float | None = None,
              seed: int | None = None, save: bool = True, root: Path | None = None,
              progress: Callable[[dict, dict], None] | None = None) -> dict:
    """Tune `spec` and return the results (see docs/tuning.md for the format).

    budget_s bounds the number of measurements (budget_s / (measure_s + overhead)); when
    every config on every bucket does not fit, the search is a hill climb (kgen/tune_search.py).
    `executor` is "local", "ray" or a callable mapping a list of task dicts to result dicts.
    `progress(event, state)` is called after each batch of measurements."""
    from kgen.build import select_backend

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


# ------------------------------------------------------------------ persistence

def save_results(results: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(results, indent=1, sort_keys=True, default=_json_default))


def _json_default(x):
    raise TypeError(f"not JSON data: {type(x).__name__}")


_REQUIRED = ("format", "kgen_version", "spec_hash", "device", "measurements", "winners", "buckets", "default_winner")


def check_results(results, where: str) -> dict:
    """Structural check of a results document; KgenUserError naming what is wrong."""
    if not isinstance(results, dict):
        raise KgenUserError(f"{where}: tuning results must be a JSON object")
    missing = [k for k in _REQUIRED if k not in results]
    if missing:
        raise KgenUserError(f"{where}: corrupt tuning results: missing {', '.join(missing)}")
    if results["format"] != FORMAT:
        raise KgenUserError(f"{where}: tuning results format {results['format']!r}; this kgen reads {FORMAT}")
    if not isinstance(results["winners"], dict) or not isinstance(results["measurements"], list):
        raise KgenUserError(f"{where}: corrupt tuning results: winners/measurements have the wrong type")
    for name, config in results["winners"].items():
        if not re.fullmatch(r"\d+x\d+", name) or not (config is None or isinstance(config, dict)):
            raise KgenUserError(f"{where}: corrupt tuning results: bad winner entry {name!r}")
    return results


def read_results(path: Path | str) -> dict:
    """Load and structurally check a results file (or a manifest.json holding "tuning")."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise KgenUserError(f"{path}: cannot read tuning results: {e.strerror}") from None
    except ValueError as e:
        raise KgenUserError(f"{path}: corrupt tuning results (not JSON: {e})") from None
    if isinstance(data, dict) and "tuning" in data and "spec_hash" in data and "measurements" not in data:
        if data["tuning"] is None:
            raise KgenUserError(f"{path}: this manifest holds no tuning results (build with --tune)")
        data = data["tuning"]
    return check_results(data, str(path))


def mismatches(results: dict, spec, info: dict) -> list[str]:
    """Why these results do not apply to `spec` on this device with this kgen (empty: they do)."""
    out = []
    if results.get("spec_hash") != spec.spec_hash():
        out.append("the spec changed since tuning (spec hash differs)")
    if results.get("kgen_version") != __version__:
        out.append(f"tuned with kgen {results.get('kgen_version')}, this is {__version__}")
    dev = results.get("device") or {}
    for key in ("backend", "name", "compute_capability", "driver", "nvrtc", "compiler"):
        if dev.get(key) != info.get(key):
            out.append(f"device {key}: tuned on {dev.get(key)!r}, this is {info.get(key)!r}")
    return out


def load_results(spec, backend: str = "auto", root: Path | None = None) -> dict | None:
    """This device's results for `spec`, or None with a TuningWarning saying why they are not used."""
    from kgen.build import select_backend

    info = device_info(select_backend(backend))
    path = results_path(spec, info, root)
    if not path.exists():
        others = sorted(p.name for p in path.parent.glob("*.json")) if path.parent.exists() else []
        if others:
            warnings.warn(f"{spec.name}: tuning results exist for {', '.join(others)} but not for this device "
                          f"({device_slug(info)}); using the untuned defaults (run `kgen tune`)", TuningWarning,
                          stacklevel=2)
        return None
    try:
        results = read_results(path)
    except KgenUserError as e:
        warnings.warn(f"{e}; using the untuned defaults (re-run `kgen tune`)", TuningWarning, stacklevel=2)
        return None
    problems = mismatches(results, spec, info)
    if problems:
        warnings.warn(f"{spec.name}: ignoring tuning results {path}: {'; '.join(problems)}; using the untuned "
                      "defaults (re-run `kgen tune`)", TuningWarning, stacklevel=2)
        return None
    return results
