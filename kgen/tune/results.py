"""Tuning results on disk: the device record they were measured on, where they live,
and the checks that keep results from another device, spec or kgen from being used.

    load_results(spec, "cpu")      # None + a TuningWarning on any mismatch

Results live in <cache dir>/tuning/<spec name>/<device slug>.json (and in
generated/<name>/manifest.json under "tuning"). They record the device (GPU name and
compute capability, or CPU model), driver/NVRTC/compiler versions, spec hash and kgen
version; results whose record differs from the current one are never used silently.
"""

from __future__ import annotations

import json
import os
import platform
import re
import warnings
from pathlib import Path

from kgen.build import select_backend
from kgen.compile.host import compiler, compiler_version
from kgen.compile.nvrtc import nvrtc_version
from kgen.errors import KgenUserError
from kgen.fileio import atomic_write_text
from kgen.runtime.cuda import require_gpu
from kgen.settings import cache_dir
from kgen.version import __version__

FORMAT = 1


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
        info |= {"name": _cpu_model(), "machine": platform.machine(), "cpus": os.cpu_count(),
                 "compiler": compiler_version(compiler()).splitlines()[0]}
    return info


def device_slug(info: dict) -> str:
    text = f"{info['backend']}-{info['name']}-{info.get('compute_capability', info.get('machine', ''))}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:120]


def results_path(spec, info: dict, root: Path | None = None) -> Path:
    return Path(root or cache_dir()) / "tuning" / spec.name / f"{device_slug(info)}.json"


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
