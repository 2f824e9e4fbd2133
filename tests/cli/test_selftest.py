"""`kgen selftest`: exit 2 without a GPU unless --backend cpu; real steps writing REPORT.md and
selftest.json, a failing step reported while the others go on; a step past its budget stopped and
said so; and (full tier) the whole quick run on the CPU backend."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kgen.runtime.cuda import gpu_available
from kgen.selftest.outcome import Context
from kgen.selftest.runner import run_step
from kgen.selftest.steps import BY_NAME, STEPS

ROOT = Path(__file__).resolve().parents[2]
STEP_FIELDS = {"name", "title", "status", "reason", "seconds", "budget_s", "figures", "log"}


def selftest(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "kgen.cli", "selftest", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible: the selftest would run on it")
def test_without_a_gpu_it_exits_2_and_says_why(tmp_path):
    out = tmp_path / "report"
    r = selftest("-o", str(out))
    assert r.returncode == 2
    assert "no usable CUDA GPU" in r.stderr and "--backend cpu" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()  # nothing ran, nothing written


def test_a_failing_step_is_reported_and_the_others_go_on(tmp_path):
    """The vLLM step fails (the folder given as the model holds no checkpoint); the specs step after
    it still builds and verifies its spec; REPORT.md and selftest.json carry every step."""
    out, model = tmp_path / "report", tmp_path / "not-a-model"
    model.mkdir()
    spec = ROOT / "specs" / "cache_write_fp8_e4m3.yaml"
    r = selftest("--backend", "cpu", "--quick", "-o", str(out), "--step", "vllm", "--step", "specs",
                 "--model", str(model), "--spec", str(spec))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed steps: vllm" in r.stderr
    doc = json.loads((out / "selftest.json").read_text())
    assert doc["schema"] == "kgen-selftest/1" and doc["exit_status"] == 1 and doc["backend"] == "cpu" and doc["quick"]
    assert [s["name"] for s in doc["steps"]] == ["environment", "vllm", "specs"]
    assert all(STEP_FIELDS <= set(s) and s["seconds"] >= 0 for s in doc["steps"])
    env, vllm, built = doc["steps"]
    assert env["status"] == "passed" and doc["environment"] == env["figures"]
    for fact in ("kgen", "cupy", "cuda_runtime", "cuda_driver_supports", "nvrtc", "cuda_line", "device", "driver",
                 "torch", "vllm", "flashinfer"):
        assert doc["environment"][fact], fact
    assert vllm["status"] == "failed" and "config.json" in vllm["reason"]
    assert built["status"] == "passed", built["reason"]
    rows = built["figures"]["bodies"]
    assert [(r["spec"], r["status"]) for r in rows] == [("cache_write_fp8_e4m3", "passed")]
    cases = rows[0]["cases"]
    assert cases > 0 and f"verified {cases}/{cases} cases" in rows[0]["summary"]
    assert doc["gpu_budget_s"] == {s.name: s.gpu_budget_s for s in STEPS} and sum(doc["gpu_budget_s"].values()) <= 480
    assert doc["quick_leaves_out"]["specs"]
    report = (out / "REPORT.md").read_text()
    assert report.startswith("# kgen selftest: a step failed")
    for text in ("## vllm", "**FAILED**", "config.json", "## specs", "cache_write_fp8_e4m3", "Budgets on one H100/H200",
                 "What --quick leaves out", "nvrtc"):
        assert text in report, text
    assert (out / "logs" / "specs.log").is_file()


def test_a_step_past_its_budget_is_stopped_and_says_so(tmp_path):
    """The real specs step given a 1-second budget: nothing starts, the step fails saying why, at once."""
    step = dataclasses.replace(BY_NAME["specs"], cpu_budget_s=1)
    (tmp_path / "logs").mkdir()
    ctx = Context(backend="cpu", quick=True, out_dir=str(tmp_path), specs=[str(ROOT / "specs" / "copy_blocks_fp16.yaml")],
                  model=None, repo=None)
    result = run_step(step, ctx)
    assert result["status"] == "failed" and "budget" in result["reason"] and result["budget_s"] == 1
    assert result["figures"]["bodies"][0]["status"] == "skipped"


@pytest.mark.full  # minutes: every step on the CPU backend, the vLLM dry-run comparison among them
def test_quick_selftest_on_the_cpu_backend(tmp_path):
    out = tmp_path / "report"
    r = selftest("--backend", "cpu", "--quick", "-o", str(out), timeout=1800)
    doc = json.loads((out / "selftest.json").read_text())
    status = {s["name"]: s for s in doc["steps"]}
    assert r.returncode == 0, {n: s["reason"] for n, s in status.items()}
    assert list(status) == [s.name for s in STEPS]
    assert status["specs"]["status"] == "passed" and len(status["specs"]["figures"]["bodies"]) >= 4
    for name in ("decode", "prefill"):
        assert status[name]["status"] == "passed", status[name]["reason"]
        rows = status[name]["figures"]["rows"]
        assert rows and all(r["max_abs_kgen_vs_sdpa"] <= 2e-2 for r in rows)
        assert not any(k.endswith("_s") or k == "copy_bw" for r in rows for k in r)  # no CPU time posing as a figure
    assert status["gpu-tests"]["status"] == "skipped" and "no GPU" in status["gpu-tests"]["reason"]
    vllm = status["vllm"]
    assert vllm["status"] == "passed" or (vllm["status"] == "skipped" and "not installed" in vllm["reason"])
    if vllm["status"] == "passed":
        assert vllm["figures"]["dry_run"] and vllm["figures"]["report"]["ok"]
    assert "What --quick leaves out" in (out / "REPORT.md").read_text()
