"""benchmarks/gpu_prefill.py: its refusal without a GPU (nothing measured, nothing invented), its
CPU-side parts (shapes, FLOP, arguments, kgen's paths, the mixed line), its pipeline on the CPU
backend against SDPA, and on a GPU a small run of the real thing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kgen.bench.prefill
from benchmarks import gpu_prefill as gp
from benchmarks import static_prefill as sp
from kgen.perf import prefill_model as pf
from kgen.runtime.cuda import gpu_available
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "specs" / "llama3_8b_prefill.yaml"


def _script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_prefill", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible: the script would measure")
def test_refuses_without_a_gpu():
    run = _script("--shapes", "64@64")
    assert run.returncode == 2
    assert "no CUDA GPU" in run.stderr and "nothing was measured" in run.stderr
    assert "|" not in run.stdout  # no table: nothing invented


def test_arguments_and_shapes():
    assert _script("--help").returncode == 0
    bad = _script("--shapes", "512x512")
    assert bad.returncode == 2 and "bad shape '512x512'" in bad.stderr
    assert _script("--shapes", "300@200").returncode == 2  # a chunk longer than its sequence
    assert _script("--gqa", "4,x").returncode == 2
    assert gp.parse_shapes("512@512, 8x256@4096+56x1@4096") == [
        ("512@512", [(512, 512)]), ("8x256@4096+56x1@4096", [(256, 4096)] * 8 + [(1, 4096)] * 56)]
    assert gp.parse_ints("4,8") == [4, 8]
    shapes = dict(gp.default_shapes())
    assert all(shapes[label] == seqs for label, seqs in sp.SHAPES)  # the static table's shapes, then the parts
    parts = [seqs for label, seqs in gp.default_shapes() if " part: " in label]
    assert parts == [[(256, 4096)] * 8, [(1, 4096)] * 56]
    args = gp.parser().parse_args([])
    assert (args.gqa, args.shapes, args.flashinfer_backends) == ([4, 8], None, "fa2,fa3")


def test_flop_and_gqa_specs():
    """4 x 128 x query heads x visible pairs: a 4K prompt sees 4096 x 4097 / 2 pairs; GQA 8 doubles the heads."""
    spec = load_spec(LLAMA)
    assert gp.flop([(4096, 4096)], spec) == 4 * 128 * 32 * 4096 * 4097 // 2
    g8 = gp.with_gqa(spec, 8)
    assert (g8.attention.num_q_heads, g8.attention.num_kv_heads, g8.group_size) == (64, 8, 8)
    assert gp.with_gqa(spec, 4) is spec
    assert gp.flop([(256, 33024)], g8) == pf.causal_flop([(256, 33024)], 128, 64)
    assert gp.set_bytes(spec, [(16, 20)]) == 32 * 8 * 256 * 2 + 16 * 32 * 128 * 2  # 2 blocks of K and V, q


def test_kgen_paths_are_probed_from_the_family(monkeypatch):
    spec = load_spec(LLAMA)
    # the prefill family's `path`: each body once (mma.sync, the Hopper wgmma path), not `auto`
    assert gp.prefill_paths(spec) == [("path=mma", {"path": 1}), ("path=wgmma", {"path": 2})]
    # the specs are retargeted to the device's arch, where the Hopper path can build
    (only,) = gp.specs(gp.parser().parse_args(["--spec", str(LLAMA), "--gqa", "4"]), "sm_90")
    assert only.targets == ["sm_90"] and "sm_80" in spec.targets

    class Family:
        params = {"warps": None, "mma_path": None}

        def default_space(self, spec):
            return {"warps": [2, 4], "mma_path": [1, 0, 2]}

    monkeypatch.setattr(kgen.bench.prefill, "family_for", lambda s: Family())  # where the probing lives
    assert gp.prefill_paths(spec) == [("mma_path=0", {"mma_path": 0}), ("mma_path=1", {"mma_path": 1}),
                                      ("mma_path=2", {"mma_path": 2})]


def test_mixed_line_and_table_from_rows():
    mixed = sp.mixed_shape()[0]
    shapes = gp.default_shapes()
    labels = [label for label, _ in shapes if label.startswith(mixed)]
    rows = [{"spec": "s", "gqa": 4, "path": "p", "shape": label, "kgen_s": t, "flop": 1e9}
            for label, t in zip(labels, (1.2e-3, 0.5e-3, 0.5e-3), strict=True)]
    (line,) = gp.mixed_lines(rows, shapes)
    assert "1.20x (MISSED" in line
    rows[0]["kgen_s"] = 1.05e-3
    assert "1.05x (met" in gp.mixed_lines(rows, shapes)[0]
    assert gp.mixed_lines(rows[:2], shapes) == []  # a part missing: no line
    text = gp.table([*rows, {"spec": "s", "gqa": 4, "path": "all", "shape": "x", "skipped": "budget"}], ["fa2"])
    assert "skipped: budget" in text and "1.0" in text  # 1e9 FLOP / 1.05 ms = 1.0 TFLOP/s


def test_cpu_dry_run_agrees_with_sdpa(tmp_path):
    """The whole pipeline on the CPU backend: a chunk after a prefix (SDPA's mask aligned bottom-right) and
    a mixed batch of chunks and single rows, each within fp16 rounding of SDPA."""
    pytest.importorskip("torch")
    out = tmp_path / "rows.json"
    run = _script("--cpu-dry-run", "--no-verify", "--gqa", "4", "--spec", str(LLAMA), "--shapes",
                  "16@100,2x16@64+3x1@64", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    # both bodies of the sm_90 retargeted spec, each on both shapes
    assert sorted((r["path"], r["shape"]) for r in rows) == [
        (path, shape) for path in ("path=mma", "path=wgmma") for shape in ("16@100", "2x16@64+3x1@64")]
    for r in rows:
        assert r["max_abs_kgen_vs_sdpa"] < 1e-2 and r["sdpa_s"] > 0 and r["kgen_s"] > 0


@pytest.mark.gpu
def test_small_run_on_the_gpu(tmp_path):
    """Both bundled specs at GQA 4 on small shapes: every row timed and within fp16 rounding of SDPA;
    FlashInfer's fa2 path timed or its reason given (the static tables' SDPA check stands either way)."""
    out = tmp_path / "rows.json"
    run = _script("--gqa", "4", "--shapes", "512@512,256@4352,4x256@2048+12x1@2048", "--budget-ms", "20",
                  "--no-verify", "--flashinfer-backends", "fa2", "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["spec"] for r in rows} == {"llama3_8b_prefill", "prefill_fp8_e4m3"} and len(rows) >= 6
    for r in rows:
        assert r["kgen_s"] > 0 and r["sdpa_s"] > 0 and r["max_abs_kgen_vs_sdpa"] < 2e-2
        assert r.get("flashinfer_fa2_s", 0) > 0 or r["flashinfer_fa2"]
    assert "| llama3_8b_prefill" in run.stdout
