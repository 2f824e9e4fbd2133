"""The build-and-verify step: every bundled spec built and its verification matrix run on the
device, each body the device can run, several specs at once (one worker process each: a fault in
one cannot take the others down, and the float64 references use the machine's cores).

A spec's bodies (`bodies`): the spec as written (kgen.build: on a GPU the body of the device's
arch, on the CPU backend every body of its targets, kgen/bodies.py) and, on a GPU, each other
target's body that the device can run too (an older arch's portable body, such as the mma.sync
prefill body on an sm_90 GPU whose own body is the Hopper one), compiled for the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kgen.bodies import dispatch
from kgen.build import body_lines, build
from kgen.compile.nvrtc import compile_arch
from kgen.errors import CompileError, KgenUserError
from kgen.render import render
from kgen.runtime.cuda import device_arch
from kgen.selftest.outcome import Context, Outcome
from kgen.settings import child_environment
from kgen.spec.models import load_spec

# --quick: one spec per kind, these where present (the cheapest of their kind to verify on the CPU
# backend), else the first of the kind by name, so a new kind is covered too.
QUICK_PICKS = ("bf16_decode_b32", "cache_write_fp8_e4m3", "copy_blocks_fp16", "prefill_sliding_window")
CPU_ARCH = "sm_90"  # the CPU backend stands in for an H100/H200: the bodies such a device would run
SEED = 1


def choose(paths: list[Path], quick: bool) -> list[Path]:
    """The spec files to build: all of them, or with `quick` one per kind."""
    if not quick:
        return paths
    by_kind: dict[str, list[Path]] = {}
    for path in sorted(paths):
        by_kind.setdefault(load_spec(path).kind, []).append(path)
    return [next((p for p in group if p.stem in QUICK_PICKS), group[0]) for group in by_kind.values()]


def bodies(spec, arch: str, quick: bool, cpu: bool = False) -> list[tuple[str, str | None]]:
    """(label, body_arch or None) per body to build and verify on a device of `arch`: the spec as
    written (its `arch` body; on the CPU backend, `cpu`, every target's), then (not with `quick`, not
    on the CPU) each other target whose body differs and runs on `arch` (kgen.bodies.dispatch)."""
    found: list[tuple[str, str | None]] = [(f"as written (targets {', '.join(spec.targets)})", None)]
    if quick or cpu:
        return found
    try:
        own = render(spec, None, arch).source
        others = {t: render(spec, None, t) for t in spec.targets if t != arch}
    except KgenUserError:
        return found  # a target the config cannot build: the as-written build reports it
    for target, rendered in sorted(others.items()):
        portable = compile_arch(rendered.source, target) == target
        if rendered.source != own and dispatch({target: not portable}, arch) == target:
            found.append((f"{target}'s body ({rendered.body or 'its own'}) on {arch}", target))
    return found


def verify_one(job: dict) -> dict:
    """Build and verify one body (in a worker process): its verdict, the report's summary and
    failed cases, kgen's notes on the body chosen, registers and spills per arch."""
    t0 = time.perf_counter()
    spec = load_spec(job["spec"])
    row = {"spec": spec.name, "body": job["body"]}
    try:
        kernel = build(spec, backend=job["backend"], verify=True, seed=SEED, body_arch=job.get("body_arch"))
    except KgenUserError as e:  # the family refuses this body here: not a failure of kgen's kernels
        return row | {"status": "skipped", "reason": f"refused: {e}"[:400], "seconds": time.perf_counter() - t0}
    except CompileError as e:
        return row | {"status": "failed", "reason": f"compile error: {e}"[:2000], "seconds": time.perf_counter() - t0}
    report = kernel.report
    return row | {
        "status": "passed" if report.passed else "failed",
        "reason": "" if report.passed else f"{len(report.failed_cases)} case(s) failed",
        "summary": report.summary(),
        "cases": len(report.cases),
        "failed_cases": [c.name for c in report.failed_cases],
        "notes": body_lines(kernel) + list(getattr(kernel, "notes", [])),  # each arch's body and why, first
        "resources": {arch: {"registers": max(r["registers"] for r in res.values()),
                             "spills": max(r["spill_stores"] for r in res.values())}
                      for arch, res in kernel.resources.items()},
        "seconds": time.perf_counter() - t0,
    }


def _run_worker(job: dict, timeout: float) -> dict:
    """verify_one in a fresh process (`python -m kgen.selftest.child --verify-one JOB`)."""
    row = {"spec": job["name"], "body": job["body"]}
    if timeout <= 1:
        return row | {"status": "skipped", "reason": "the step's time budget was spent before it started",
                      "seconds": 0.0}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "kgen.selftest.child", "--verify-one", json.dumps(job), "--result", str(out)]
        try:
            proc = subprocess.run(cmd, env=child_environment(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return row | {"status": "failed", "reason": f"not finished within the step's budget ({timeout:.0f} s left)",
                          "seconds": time.perf_counter() - t0}
        if out.is_file():
            return json.loads(out.read_text())
        return row | {"status": "failed", "seconds": time.perf_counter() - t0,
                      "reason": f"the worker died (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}"}


def workers(backend: str) -> int:
    """Concurrent workers: on a GPU the CPU cores (float64 references, compiles), up to 8; on the CPU
    backend, whose kernels already use the cores, 2."""
    return max(1, min(8 if backend == "cuda" else 2, os.cpu_count() or 1))


def build_and_verify(ctx: Context) -> Outcome:
    paths = choose([Path(p) for p in ctx.specs], ctx.quick)
    arch = device_arch() if ctx.backend == "cuda" else CPU_ARCH
    loaded = {p: load_spec(p) for p in paths}
    jobs = [{"spec": str(p), "name": spec.name, "backend": ctx.backend, "body": label, "body_arch": body_arch}
            for p, spec in loaded.items()
            for label, body_arch in bodies(spec, arch, ctx.quick, cpu=ctx.backend == "cpu")]
    outcome = Outcome(figures={"arch": arch, "backend": ctx.backend, "specs": len(paths), "bodies": [], "seed": SEED})
    rows: list[dict] = outcome.figures["bodies"]
    with ThreadPoolExecutor(workers(ctx.backend)) as pool:
        for row in pool.map(lambda job: _run_worker(job, ctx.seconds_left()), jobs):
            rows.append(row)
            ctx.save(outcome)
    failed = [f"{r['spec']} ({r['body']})" for r in rows if r["status"] == "failed"]
    late = [r for r in rows if r["status"] == "skipped" and "budget" in r.get("reason", "")]
    if failed:
        outcome.fail(f"{len(failed)} of {len(rows)} bodies failed: {', '.join(failed)}")
    if late:
        outcome.fail(f"{len(late)} of {len(rows)} bodies not verified within the step's budget")
    return outcome
