"""The steps that run another program: the `gpu`-marked tests (pytest over a source checkout's tests)
and the vLLM comparison (`python -m kgen.vllm.compare MODEL --gpu`; `--dry-run` on the CPU backend,
its stand-in on vLLM's CPU build). Each is a child process bounded by what is left of the step's
budget; its output goes to the step's log."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from kgen.selftest.outcome import Context, Outcome
from kgen.settings import child_environment
from kgen.vllm.tiny_models import write_model

MARGIN_S = 10  # left of the step's budget for reading and saving the child's result
RESULT = re.compile(r"^(tests/\S+::\S+).*?\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _run(cmd: list[str], ctx: Context, log: Path, cwd: str | None = None) -> tuple[int | None, str]:
    """(exit status, or None when the budget ran out; the output) of `cmd`, its output also in `log`.
    It runs in a process group of its own, killed whole at the budget (vLLM's serving children too,
    which would otherwise keep the GPU's memory)."""
    timeout = max(1.0, ctx.seconds_left() - MARGIN_S)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=child_environment(), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log.read_text(errors="replace")


def gpu_tests(ctx: Context) -> Outcome:
    if ctx.repo is None:
        return Outcome.skipped("tests not installed (an installed kgen carries none; run from a source checkout)")
    if ctx.backend != "cuda":
        return Outcome.skipped("no GPU: the gpu-marked tests need one (--backend cpu)")
    log = Path(ctx.out_dir) / "logs" / "gpu-tests.pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "--tier", "all", "-v", "-rfE", "-p", "no:cacheprovider",
           "tests"]
    code, text = _run(cmd, ctx, log, cwd=ctx.repo)
    counts: dict[str, int] = {}
    failed = []
    for line in text.splitlines():
        m = RESULT.match(line)
        if m:
            counts[m.group(2).lower()] = counts.get(m.group(2).lower(), 0) + 1
            if m.group(2) in ("FAILED", "ERROR"):
                failed.append(m.group(1))
    summary = next((line.strip("= ") for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed|skipped|deselected)", line)), "")
    outcome = Outcome(figures={"counts": counts, "failed": failed, "summary": summary, "exit": code,
                               "log": str(log)})
    if code is None:
        return outcome.fail(f"pytest did not finish within the step's budget ({sum(counts.values())} tests had run)")
    if failed or code not in (0, 5):  # 5: no test was selected
        return outcome.fail(f"{len(failed)} gpu test(s) failed (pytest exit {code}): {', '.join(failed[:5])}")
    if not counts.get("passed"):
        outcome.status, outcome.reason = "skipped", f"no gpu test ran ({summary or 'none collected'})"
    return outcome


def tiny_model(folder: Path) -> Path:
    """The tiny Llama the vLLM tests serve (random weights, written here: nothing is downloaded)."""
    return write_model("llama", folder, "float32")


def vllm_comparison(ctx: Context) -> Outcome:
    out = Path(ctx.out_dir)
    if ctx.model is not None and not (Path(ctx.model) / "config.json").is_file():
        return Outcome().fail(f"--model {ctx.model}: no config.json there (a Hugging Face checkpoint folder is needed)")
    if importlib.util.find_spec("vllm") is None:
        return Outcome.skipped("vLLM is not installed (pip install 'kgen[vllm]', or vllm itself on a GPU machine)")
    if ctx.model is None:
        for package in ("torch", "transformers"):
            if importlib.util.find_spec(package) is None:
                return Outcome.skipped(f"{package} is not installed: it writes the tiny model served here and runs "
                                       "the float64 reference (or give --model)")
    model = Path(ctx.model) if ctx.model else tiny_model(out / "model")
    report = out / "vllm-compare.json"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kgen.vllm.compare", str(model), "--gpu", "--json", str(report)]
    if ctx.backend == "cpu":
        cmd.append("--dry-run")
    code, text = _run(cmd, ctx, out / "logs" / "vllm.compare.log")
    figures = {"model": str(model), "dry_run": ctx.backend == "cpu", "command": " ".join(cmd[1:]), "exit": code,
               "summary": [line for line in text.splitlines() if line.startswith(("kgen in place", "  "))][-8:]}
    if report.is_file():
        figures["report"] = json.loads(report.read_text())
    if ctx.backend == "cpu":  # vLLM's CPU build's start-up and tokens/s are no figures of kgen on a GPU
        figures["summary"] = [line.split("; start-up")[0] for line in figures["summary"]]
        figures.get("report", {}).pop("timing", None)
    outcome = Outcome(figures=figures)
    if code is None:
        return outcome.fail("the comparison did not finish within the step's budget")
    if code != 0:
        tail = text.strip().splitlines()[-3:]
        return outcome.fail(f"the comparison failed (exit {code}): " + " | ".join(tail)[-600:])
    return outcome
