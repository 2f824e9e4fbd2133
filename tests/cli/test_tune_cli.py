"""`kgen tune`, `kgen report` and `kgen build --tune` as real subprocesses on the CPU backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import TINY_DECODE, run_kgen, run_python, write_spec

TUNING = {"params": {"threads": [32, 64], "partition_size": [0, 32]},
          "constraints": ["threads >= 32 * group_size"], "buckets": {"batch": [1, 2], "context": [16, 48]}}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune_cli")
    write_spec(d, yaml.safe_dump({**TINY_DECODE, "name": "tiny_cli_tune", "tuning": TUNING}), "tiny.yaml")
    write_spec(d, yaml.safe_dump({**TINY_DECODE, "name": "tiny_cli_tune"}), "untunable.yaml")
    no_ray = d / "no_ray"  # shadows an installed Ray: a machine without the extra
    no_ray.mkdir()
    (no_ray / "ray.py").write_text('raise ImportError("No module named \'ray\'")\n')
    return d


def kgen(work: Path, *args: str, path: tuple[Path, ...] = ()):
    """The CLI in `work`, with the tuning results in a cache of this module's own."""
    return run_kgen(*args, cwd=work, path=path, env={"KGEN_CACHE_DIR": str(work / "cache")})


@pytest.fixture(scope="module")
def tuned(work):
    return kgen(work, "tune", "tiny.yaml", "--backend", "cpu", "--measure-s", "0.002", "--seed", "1")


def test_tune_prints_the_table_and_saves(work, tuned):
    assert tuned.returncode == 0, tuned.stderr
    assert "cpu-wall" in tuned.stdout and "2 pruned before compiling" in tuned.stdout
    assert "8 measurements in" in tuned.stdout  # what the budget allowed, and how long it took
    progress = [line for line in tuned.stderr.splitlines() if "output verified" in line]
    assert len(progress) == 8 and all("built in" in line and "timed" in line for line in progress), tuned.stderr
    saved = list((work / "cache" / "tuning" / "tiny_cli_tune").glob("*.json"))
    assert len(saved) == 1
    data = json.loads(saved[0].read_text())
    assert len(data["measurements"]) == 8 and set(data["winners"]) == {"1x16", "1x48", "2x16", "2x48"}


def test_report_renders_table_and_png(work, tuned):
    assert tuned.returncode == 0, tuned.stderr
    r = kgen(work, "report", "tiny.yaml", "--backend", "cpu", "--png", "plot.png")
    assert r.returncode == 0, r.stderr
    assert "1x48" in r.stdout and "*" in r.stdout
    assert (work / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_build_tune_writes_results_into_the_manifest(work, tuned):
    r = kgen(work, "build", "tiny.yaml", "--backend", "cpu", "--tune", "-o", "gen")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((work / "gen" / "tiny_cli_tune" / "manifest.json").read_text())
    assert manifest["tuning"]["winners"] and manifest["config"] == manifest["tuning"]["default_winner"]
    code = ("from generated_probe.tiny_cli_tune import kernel; k = kernel.load('cpu'); print(type(k).__name__, "
            "sorted(k.configs))")
    (work / "gen").rename(work / "generated_probe")
    probe = run_python(code, work, path=(work,), env={"KGEN_CACHE_DIR": str(work / "cache")})
    assert probe.returncode == 0, probe.stderr
    assert "TunedKernel ['1x16', '1x48', '2x16', '2x48']" in probe.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("tune", "untunable.yaml", "--backend", "cpu"), "nothing to tune"),
    (("tune", "tiny.yaml", "--backend", "cpu", "--buckets", "1,2"), "--buckets: expected BATCHES x CONTEXTS"),
    (("tune", "tiny.yaml", "--backend", "cpu", "--executor", "ray"), "kgen[ray]"),
    (("report", "tiny.yaml", "--results", "missing.json"), "cannot read tuning results"),
])
def test_bad_input_exits_2_with_a_message(work, args, message):
    r = kgen(work, *args, path=(work / "no_ray",))
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr


def test_report_refuses_a_corrupt_results_file(work):
    (work / "corrupt.json").write_text("{not json")
    r = kgen(work, "report", "tiny.yaml", "--results", "corrupt.json")
    assert r.returncode == 2 and "corrupt tuning results" in r.stderr
