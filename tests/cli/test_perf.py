"""`kgen perf` and `kgen verify --source ... --require-speed`: the static model's figures on the command
line, consistent with benchmarks/static_perf.py; a deliberately serialised kernel fails the speed check
while kgen's own source passes it."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from conftest import ROOT, TINY_DECODE, inline_provided, run_kgen, write_spec
from sass_tools import needs_sass

from benchmarks import static_perf as sp
from benchmarks.tables import fmt_cell
from kgen.cli import perf as perf_cli
from kgen.cli.main import main
from kgen.errors import KgenUserError
from kgen.perf import model as pm
from kgen.perf.mla_model import BATCHES, CONTEXTS
from kgen.perf.sass import usable_cuobjdump

LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"
PREFILL = ROOT / "specs" / "llama3_8b_prefill.yaml"
WAIT = "      cp_async_wait<(STAGES >= 2 ? STAGES - 2 : 0)>();  // this thread's copies of `tile` have landed\n"
SERIAL = ("      cp_async_wait<0>();  // serialised: every copy in flight lands before the tile is used\n"
          "      __syncthreads();\n")
NEXT = "    StageRing<STAGES>::next(tile, ntiles, [&](int t) { issue(t, prev); });"  # the CUDA-core body's ring step
READ = "\n    if (*(volatile const int*)(p.seq_lens + seq) < 0) return;  // a dependent global read per tile"


@needs_sass
def test_perf_table_matches_static_perf():
    r = run_kgen("perf", str(LLAMA))
    assert r.returncode == 0, r.stderr
    assert "Resources on sm_90" in r.stdout and "ESTIMATE" in r.stdout and "| 64x4096" in r.stdout
    subject = sp.kgen_subject(LLAMA, usable_cuobjdump(), None)
    for b, c in pm.SHAPES:
        est, _ = subject.estimate(b, c)
        row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {b}x{c} "))
        assert fmt_cell(est) in row  # the same cell static_perf prints, e.g. "76% (issue)"


@needs_sass
def test_perf_json_parses_and_agrees():
    r = run_kgen("perf", str(LLAMA), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    (subject,) = rep["subjects"]
    assert rep["arch"] == "sm_90" and rep["device"]["sms"] == 132 and rep["note"] is None
    assert [(c["batch"], c["context"]) for c in subject["grid"]] == pm.SHAPES
    est, _ = sp.kgen_subject(LLAMA, usable_cuobjdump(), None).estimate(64, 4096)
    cell = next(c for c in subject["grid"] if (c["batch"], c["context"]) == (64, 4096))
    assert cell["fraction"] == pytest.approx(est.fraction) and cell["bound"] == est.bound
    (main_launch,) = [x for x in subject["resources"] if x["streams_kv"]]
    assert main_launch["registers"] > 0 and main_launch["blocks_per_sm"] >= 1


@needs_sass
def test_perf_sm80_preset_and_prefill_note():
    r = run_kgen("perf", str(LLAMA), "--arch", "sm_80", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["device"]["sms"] == 108 and "A100" in rep["device"]["name"]
    r = run_kgen("perf", str(PREFILL))
    assert r.returncode == 0, r.stderr
    assert "issue 22" in r.stdout and "Resources on sm_90" in r.stdout and "| 64x4096" not in r.stdout


def test_perf_refuses_bad_input_with_exit_2():
    r = run_kgen("perf", str(LLAMA), "--arch", "sm_86")
    assert r.returncode == 2 and "no device preset" in r.stderr and "Traceback" not in r.stderr
    r = run_kgen("perf", str(ROOT / "specs" / "copy_blocks_fp16.yaml"))
    assert r.returncode == 2 and "paged_decode and paged_prefill" in r.stderr


def test_perf_asks_the_family_for_its_model():
    """The family names the static model (kgen/families/base.py PerfModel): MLA decode's latent-row model
    (kgen/perf/mla_model.py, NVRTC registers only: no SASS tools needed); MLA prefill has none (exit 2)."""
    r = CliRunner().invoke(main, ["perf", str(ROOT / "specs" / "deepseek_v3_mla_prefill.yaml")])
    assert r.exit_code == 2 and "no static model of this kernel" in r.output, r.output
    r = CliRunner().invoke(main, ["perf", str(ROOT / "specs" / "deepseek_v3_mla_decode.yaml"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert len(rep["estimates"]) == len(BATCHES) * len(CONTEXTS) and "partitions" in rep["estimates"][0]
    assert all(res["registers"] > 0 for res in rep["resources"].values())


def test_perf_without_sass_tools_names_the_install(monkeypatch):
    monkeypatch.setattr("kgen.perf.sass.usable_cuobjdump", lambda: None)
    monkeypatch.setattr("kgen.perf.sass.find_cuobjdump", lambda: None)
    r = CliRunner().invoke(main, ["perf", str(LLAMA)])
    assert r.exit_code == 2
    assert "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm" in r.output and r.exception is not None


def test_margin_parsing_and_slower_cells():
    assert perf_cli.parse_margin("10%") == pytest.approx(0.1) and perf_cli.parse_margin("0.25") == 0.25
    with pytest.raises(KgenUserError, match="margin"):
        perf_cli.parse_margin("fast")
    kgen_grid = [{"batch": 1, "context": 512, "fraction": 0.5}, {"batch": 1, "context": 4096, "fraction": 0.8}]
    mine = [{"fraction": 0.46}, {"fraction": 0.70}]
    assert perf_cli.slower_cells(kgen_grid, mine, 0.1) == ["1x4096: 70.0% vs kgen's 80.0%"]


@needs_sass
def test_require_speed_fails_a_serialised_kernel_and_passes_kgens_own(tmp_path):
    spec = write_spec(tmp_path, yaml.safe_dump(TINY_DECODE))
    own = run_kgen("show", str(spec), "--config", "partition_size=0")  # the ABI's single-pass launch
    assert own.returncode == 0, own.stderr
    ring = inline_provided(own.stdout, "kgen/attention/stage_ring.cuh")  # its wait, as kernel code
    assert ring.count(WAIT) == 1 and ring.count(NEXT) == 1
    (tmp_path / "own.cu").write_text(own.stdout)
    (tmp_path / "slow.cu").write_text(ring.replace(WAIT, SERIAL).replace(NEXT, NEXT + READ))
    r = run_kgen("verify", str(spec), "--source", str(tmp_path / "own.cu"), "--backend", "cpu", "--require-speed")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "time ratio kgen (ABI launch) / source" in r.stdout and "| 64x4096" in r.stdout
    r = run_kgen("verify", str(spec), "--source", str(tmp_path / "slow.cu"), "--backend", "cpu",
                 "--require-speed", "10%")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verified" in r.stdout  # correct: it fails on speed alone
    assert "estimated slower than kgen's kernel (same ABI launch) by more than 10%" in r.stderr and "Traceback" not in r.stderr


def test_require_speed_needs_a_source(tmp_path):
    spec = write_spec(tmp_path, yaml.safe_dump(TINY_DECODE))
    r = run_kgen("verify", str(spec), "--require-speed")
    assert r.returncode == 2 and "give --source" in r.stderr


@needs_sass
def test_require_speed_refuses_prefill_before_running(tmp_path):
    r = run_kgen("verify", str(PREFILL), "--source", str(tmp_path / "never_read.cu"), "--require-speed")
    assert r.returncode == 2 and "issue 22" in r.stderr and "Traceback" not in r.stderr
