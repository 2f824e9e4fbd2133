"""benchmarks/call_overhead.py runs and prints its table (the figures are docs/performance.md's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_call_overhead_prints_both_rows(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), KGEN_CACHE_DIR=os.environ.get("KGEN_CACHE_DIR", str(tmp_path)))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "call_overhead.py"), "--seqs", "4",
                          "--repeats", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| with")]
    assert [r.split("|")[1].strip() for r in rows] == ["without a plan", "with a plan"]
    assert all(float(r.split("|")[2]) > 0 for r in rows), run.stdout
