"""kgen's verification report as FlashInfer-Bench Traces, one per case (`kgen verify --trace FILE.jsonl`).

Status: a passed case is PASSED; a case whose numbers are off is INCORRECT_NUMERICAL; a case that did
not run to completion is TIMEOUT (the isolated run hit its time limit) or RUNTIME_ERROR (a crash or
abort); a case that broke its inputs or a guard region is RUNTIME_ERROR (FlashInfer-Bench has no
status for a memory-safety violation; the log says which). A source that does not compile gives one
COMPILE_ERROR trace. kgen's verification times nothing: a PASSED trace's performance fields are 0
and its log says they were not measured.
"""

from __future__ import annotations

import json
import math
import platform
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy

from kgen.fib.convert import definition_name, input_names
from kgen.fib.schema import Trace, parse
from kgen.tune.results import device_info
from kgen.verify.judge.report import describe_failure
from kgen.version import __version__

NOT_TIMED = "not timed: kgen verify measures correctness only (performance fields are 0, not a measurement)"


def status_of(case) -> str:
    if case.passed:
        return "PASSED"
    note = case.note or ""
    if "did not run to completion" in note:
        return "TIMEOUT" if "timed out" in note else "RUNTIME_ERROR"
    failure = case.first_failure or {}
    if "input" in failure or "buffer" in failure:
        return "RUNTIME_ERROR"
    return "INCORRECT_NUMERICAL"


def _error(x: float) -> float | str:
    return "NaN" if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def environment(backend: str) -> dict[str, Any]:
    hardware = "CPU (kgen's SIMT runtime)"
    if backend == "cuda":
        try:
            info = device_info("cuda")
            hardware = f"{info['name']} ({info['compute_capability']})"
        except Exception:  # noqa: BLE001 - the trace still says it ran on a GPU
            hardware = "CUDA GPU"
    return {"hardware": hardware, "libs": {"kgen": __version__, "numpy": numpy.__version__,
                                           "python": platform.python_version()}}


def workload(spec, sizes: list[int], key: str) -> dict[str, Any]:
    """The case's axes as far as its sizes (the sequences' KV lengths) tell them."""
    block = spec.kv_cache.block_size
    pages = sum(-(-int(n) // block) for n in sizes)
    axes = {"len_indptr": len(sizes) + 1, "num_kv_indices": pages, "batch_size": len(sizes)}
    inputs: dict[str, Any] = {name: {"type": "random"} for name in input_names(spec) if name != "sm_scale"}
    inputs["sm_scale"] = {"type": "scalar", "value": spec.softmax_scale_value}
    return {"axes": axes, "inputs": inputs, "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, key))}


def case_traces(report, spec, solution: str) -> list[dict]:
    stamp = datetime.now(UTC).isoformat()
    env = environment(report.backend)
    traces = []
    for case in report.cases:
        status = status_of(case)
        log = f"kgen case '{case.name}' (seed {report.seed}; replay with `kgen verify --seed {report.seed}`)"
        if not case.passed:
            log += f": {describe_failure(case) or case.note}"
        evaluation: dict[str, Any] = {"status": status, "environment": env, "timestamp": stamp, "log": log}
        if status in ("PASSED", "INCORRECT_NUMERICAL"):
            evaluation["correctness"] = {
                "max_absolute_error": _error(case.max_error), "max_relative_error": "NaN",
                "extra": {"kgen_bound": _error(case.bound), "kgen_nan_count": case.nan_count,
                          "note": "max_absolute_error is kgen's error of the worst (sequence, head) row against "
                                  "its float64 reference, judged against kgen_bound (docs/verification.md); "
                                  "relative error is not computed"}}
        if status == "PASSED":
            evaluation["performance"] = {"latency_ms": 0.0, "reference_latency_ms": 0.0, "speedup_factor": 0.0}
            evaluation["log"] += f"; {NOT_TIMED}"
        key = f"kgen:{spec.spec_hash()}:{report.seed}:{case.name}"
        traces.append({"definition": definition_name(spec), "workload": workload(spec, case.sizes, key),
                       "solution": solution, "evaluation": evaluation})
    return traces


def compile_error_trace(spec, solution: str, message: str, backend: str) -> dict:
    return {"definition": definition_name(spec),
            "workload": workload(spec, [], f"kgen:{spec.spec_hash()}:compile:{solution}"),
            "solution": solution,
            "evaluation": {"status": "COMPILE_ERROR", "environment": environment(backend),
                           "timestamp": datetime.now(UTC).isoformat(), "log": message[-4000:]}}


def append_traces(path: Path, traces: list[dict]) -> None:
    """Check each trace against the schema, then append them as JSON lines."""
    for t in traces:
        parse(Trace, t, f"{path} (trace of {t.get('solution')})")
    lines = "".join(json.dumps(t, allow_nan=False) + "\n" for t in traces)
    with open(path, "a", encoding="utf-8") as f:
        f.write(lines)
