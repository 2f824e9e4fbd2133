""".ci/suite_times.py: the per-file and slowest-test tables of docs/testing.md, from pytest's JUnit XML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "suite_times.py"


def junit(path: Path, cases: list[tuple[str, str, float]]) -> Path:
    body = "".join(f'<testcase classname="{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_files_are_summed_and_ordered_by_time_and_the_slowest_tests_listed(tmp_path):
    before = junit(tmp_path / "before.xml", [("tests.a", "test_x", 3.0), ("tests.a", "test_y", 4.0),
                                             ("tests.b.c", "test_z[1]", 10.0)])
    after = junit(tmp_path / "after.xml", [("tests.a", "test_x", 1.0), ("tests.b.c", "test_z[1]", 2.5)])
    r = run(before, after, "--slowest", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2] == "| `tests/b/c.py` | 1, 10.0 | 1, 2.5 |"
    assert lines[3] == "| `tests/a.py` | 2, 7.0 | 1, 1.0 |"
    assert lines[4] == "| **all** | **3, 17** | **2, 4** |"
    assert lines[-1] == "| 2.5 | `tests/b/c.py::test_z[1]` |"


def test_a_file_that_is_not_junit_xml_is_named(tmp_path):
    bad = tmp_path / "log.txt"
    bad.write_text("1887 passed")
    r = run(bad)
    assert r.returncode == 1 and f"{bad}: not a JUnit XML file pytest wrote" in r.stderr and "Traceback" not in r.stderr
