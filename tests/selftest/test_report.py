"""kgen/selftest/report.py: the JSON document's fields and the Markdown of every step, for the rows a
GPU run produces (shaped as kgen/bench's run_spec returns them; the numbers here are placeholders for
the formatting, not figures of any device) and for the CPU backend's untimed rows."""

from __future__ import annotations

import json

from kgen.selftest.report import document, markdown, write
from kgen.selftest.steps import STEPS


def step(name: str, status: str = "passed", reason: str = "", **figures) -> dict:
    return {"name": name, "title": name, "status": status, "reason": reason, "seconds": 1.0, "budget_s": 10,
            "figures": figures, "log": f"logs/{name}.log"}


def test_gpu_shaped_rows_render_with_the_benchmark_tables(tmp_path):
    decode_row = {"spec": "d", "path": "p", "batch": 1, "context": 512, "kv_bytes": 1e6, "sets": 1, "grid": "8",
                  "planning": "x", "kgen_s": 1e-5, "kgen_host_s": 1e-6, "copy_bw": 3e12, "sdpa_s": 2e-5,
                  "flashinfer": "not importable (ModuleNotFoundError)", "max_abs_kgen_vs_sdpa": 1e-3}
    prefill_row = {"spec": "p", "gqa": 4, "shape": "prompt 4K", "path": "path=mma", "seqs": 1, "q_tokens": 4096,
                   "flop": 1e12, "sets": 1, "grid": "64", "kgen_s": 2e-3, "sdpa_s": 3e-3, "flashinfer_fa2_s": 2.5e-3,
                   "flashinfer_fa3": "failed: x", "max_abs_kgen_vs_sdpa": 1e-3}
    results = [step("environment", kgen="0", device={"name": "GPU", "arch": "sm_90"}),
               step("specs", bodies=[{"spec": "s", "body": "as written", "status": "failed", "reason": "2 case(s) failed",
                                      "seconds": 1.0}], arch="sm_90", specs=1, seed=1),
               step("decode", timed=True, device="GPU", copy_bw=3e12, rows=[decode_row, {
                   "spec": "d", "path": "all", "batch": 256, "context": 32768, "kv_bytes": 0,
                   "skipped": "the step's time budget is spent"}]),
               step("prefill", timed=True, device="GPU", backends=["fa2", "fa3"], rows=[prefill_row], mixed=[]),
               step("vllm", "failed", "the comparison failed (exit 1)", command="x", summary=["kgen in place of ..."]),
               step("gpu-tests", "skipped", "no GPU")]
    doc = document(results, "cuda", False, "2026-01-01T00:00:00+00:00", 12.0, 1)
    assert doc["environment"]["device"]["arch"] == "sm_90" and doc["quick_leaves_out"] == {}
    assert doc["gpu_budget_s"] == {s.name: s.gpu_budget_s for s in STEPS}
    text = markdown(doc)
    assert "could not be rendered" not in text
    assert text.startswith("# kgen selftest: a step failed") and "device GPU (sm_90)" in text
    lines = [" ".join(line.split()) for line in text.splitlines()]  # the tables pad their columns
    assert any(line.startswith("| d | p | 1x512 |") for line in lines)  # decode's table
    assert "skipped: the step's time budget is spent" in text
    assert any(line.startswith("| p | 4 | path=mma | prompt 4K |") for line in lines) and "failed: x" in text
    assert "**FAILED**" in text and "2 case(s) failed" in text
    report, data = write(tmp_path, doc)
    assert json.loads(data.read_text())["steps"][2]["figures"]["rows"][0]["kgen_s"] == 1e-5
    assert report.read_text() == text


def test_a_figure_that_cannot_be_rendered_leaves_the_rest_of_the_report():
    results = [step("environment"), step("decode", timed=True, rows=[{"spec": "d"}])]  # a row missing its fields
    text = markdown(document(results, "cuda", True, "t", 1.0, 0))
    assert "these figures could not be rendered" in text and "## decode" in text
