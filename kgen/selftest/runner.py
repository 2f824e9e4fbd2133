"""Run the steps, each in its own process within its budget (a hung or crashed step, or a sticky CUDA
error, ends that step only; and the GPU's memory is free again for the next, which vLLM needs), and
decide the exit status: 0 when every step that ran passed, 1 when one failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kgen.selftest.outcome import Context, Outcome
from kgen.selftest.steps import STEPS, Step
from kgen.settings import child_environment

GRACE_S = 20  # past a step's budget before its process is killed (it stops itself a little before)
SAVE_MARGIN_S = 5  # a step's own deadline: its budget less this


def run_step(step: Step, ctx: Context) -> dict:
    """The step's result: its Outcome (as saved by its process) with its seconds and budget."""
    budget = step.budget(ctx.backend)
    out = Path(ctx.out_dir)
    result, log = out / "logs" / f"{step.name}.json", out / "logs" / f"{step.name}.log"
    result.unlink(missing_ok=True)
    mine = Context(**{**asdict(ctx), "deadline": time.time() + budget - SAVE_MARGIN_S, "result_file": str(result)})
    cmd = [sys.executable, "-m", "kgen.selftest.child", step.name, json.dumps(asdict(mine))]
    t0 = time.perf_counter()
    killed = False
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=child_environment(),
                                start_new_session=True)  # its own process group: its workers end with it
        try:
            code = proc.wait(timeout=budget + GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, killed = proc.wait(), True
    seconds = time.perf_counter() - t0
    outcome = Outcome(**json.loads(result.read_text())) if result.is_file() else Outcome()
    if killed:
        outcome.fail(f"stopped at its budget of {budget} s (killed; what it had saved is kept)")
    elif code != 0 or not result.is_file():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-600:]
        outcome.fail(f"its process ended with exit {code} before saving a result: {tail}")
    return {"name": step.name, "title": step.title, **asdict(outcome), "seconds": round(seconds, 1),
            "budget_s": budget, "log": str(log)}


def run(ctx: Context, names: list[str] | None = None, progress=None) -> list[dict]:
    """Every step (or those in `names`, in that order; the environment first in any case)."""
    (Path(ctx.out_dir) / "logs").mkdir(parents=True, exist_ok=True)
    chosen = [s for s in STEPS if s.name == "environment"]
    chosen += [next(s for s in STEPS if s.name == n) for n in names if n != "environment"] if names else STEPS[1:]
    results = []
    for step in chosen:
        if progress:
            progress(step, None)
        results.append(run_step(step, ctx))
        if progress:
            progress(step, results[-1])
    return results


def exit_status(results: list[dict]) -> int:
    return 1 if any(r["status"] == "failed" for r in results) else 0
