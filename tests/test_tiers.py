"""tests/tiers.py, the default and full tiers, run as pytest runs them: a small suite in a temporary
directory, collected and run by a real pytest process with the plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiers import parse_shard, shard_of

TESTS = Path(__file__).resolve().parent

SUITE = '''
import pytest

def test_plain():
    pass

@pytest.mark.full
def test_marked():
    pass

@pytest.mark.parametrize("n", [0, pytest.param(1, marks=pytest.mark.full), 2, pytest.param(3, marks=pytest.mark.full),
                               pytest.param(4, marks=pytest.mark.full), pytest.param(5, marks=pytest.mark.full)])
def test_matrix(n):
    assert n != 5, "the full tier's failing entry"
'''
DEFAULT = {"test_plain", "test_matrix[0]", "test_matrix[2]"}
FULL = {"test_marked", "test_matrix[1]", "test_matrix[3]", "test_matrix[4]", "test_matrix[5]"}


def pytest_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    full: the full tier\naddopts = --strict-markers\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tiers", "-p", "no:cacheprovider", "-q", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})


def selected(tmp_path: Path, *args: str) -> set[str]:
    run = pytest_run(tmp_path, "--collect-only", *args)
    assert run.returncode in (0, 5), run.stdout + run.stderr  # 5: nothing selected (an empty shard)
    return {line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line}


def test_the_default_tier_leaves_out_what_is_marked_full(tmp_path):
    assert selected(tmp_path) == DEFAULT


@pytest.mark.parametrize("args", [("--tier", "full"), ("-m", "full")])
def test_the_full_tier_is_what_is_marked_full(tmp_path, args):
    assert selected(tmp_path, *args) == FULL


def test_tier_all_is_both(tmp_path):
    assert selected(tmp_path, "--tier", "all") == DEFAULT | FULL


def test_the_shards_split_the_full_tier_without_overlap(tmp_path):
    shards = [selected(tmp_path, "--tier", "full", "--full-shard", f"{k}/3") for k in range(3)]
    assert set().union(*shards) == FULL and sum(map(len, shards)) == len(FULL)
    assert selected(tmp_path, "--tier", "all", "--full-shard", "0/3") == DEFAULT | shards[0]


def test_a_shard_is_a_stable_hash_of_the_test_id():
    assert shard_of("tests/x.py::test_a[1]", 4) == shard_of("tests/x.py::test_a[1]", 4) < 4
    assert parse_shard("3/4") == (3, 4)


@pytest.mark.parametrize("args,words", [
    (("--tier", "exhaustive"), ["--tier: invalid choice: 'exhaustive'", "'default', 'full', 'all'"]),
    (("--tier", "full", "--full-shard", "4/4"), ["--full-shard", "'4/4' is not K/N with 0 <= K < N"]),
    (("--tier", "full", "--full-shard", "half"), ["'half' is not K/N"]),
    (("--full-shard", "1/4"), ["--full-shard K/N slices the full tier: use it with --tier full or --tier all"]),
])
def test_a_wrong_tier_option_is_a_usage_error_naming_what_is_accepted(tmp_path, args, words):
    run = pytest_run(tmp_path, *args)
    assert run.returncode == 4, run.stdout + run.stderr
    for w in words:
        assert w in run.stderr, run.stderr


def test_a_marker_nobody_registered_stays_an_error(tmp_path):
    (tmp_path / "test_typo.py").write_text("import pytest\n\n@pytest.mark.ful\ndef test_x():\n    pass\n")
    run = pytest_run(tmp_path, "test_typo.py")
    assert run.returncode != 0 and "'ful' not found in `markers`" in run.stdout, run.stdout


def test_a_failure_ends_with_the_command_that_reruns_it_alone(tmp_path):
    run = pytest_run(tmp_path, "--tier", "full")
    assert run.returncode == 1, run.stdout
    assert "rerun a failed test alone" in run.stdout
    assert ".venv/bin/python -m pytest --tier full 'test_suite.py::test_matrix[5]'" in run.stdout
