"""examples/generate.py at its smallest, as a user runs it: a subprocess on the CPU backend. It
serves 8 requests through kgen's block manager and its cache_write, paged_prefill and paged_decode
kernels (fp16 and fp8 KV caches) and compares the greedy tokens with torch SDPA on contiguous K/V."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.full  # ~35 s; the kernels it serves with are each verified by default in tests/families/
def test_generate_smallest_matches_the_contiguous_reference():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), "--smallest"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    fp16 = [m for line in lines if (m := re.fullmatch(r"greedy tokens match the contiguous reference: (\d+)/(\d+) "
                                                       r"requests", line))]
    assert len(fp16) == 1, r.stdout
    assert fp16[0][1] == fp16[0][2] and int(fp16[0][2]) >= 8, fp16[0][0]
    fp8 = [line for line in lines if line.startswith("fp8: greedy tokens match the contiguous reference: ")]
    assert len(fp8) == 1, r.stdout
    # With K/V rounded as the fp8 cache stores them, the contiguous reference must agree exactly too.
    same = re.search(r"as the fp8 cache stores them: (\d+)/(\d+) requests", fp8[0])
    assert same and same[1] == same[2], fp8[0]
    # Both runs exercised what the example is for: every kernel verified, preemption, shared prefix blocks.
    assert sum(line.startswith("  built ") and "verified" in line for line in lines) == 6, r.stdout
    preempted = [int(m[1]) for line in lines if (m := re.search(r"preemptions: (\d+)", line))]
    hits = [int(m[1]) for line in lines if (m := re.search(r"prefix-cache hits: (\d+) of", line))]
    shared = [int(m[1]) for line in lines if (m := re.search(r", (\d+) read from blocks the prefix cache", line))]
    assert len(preempted) == len(hits) == len(shared) == 2, r.stdout
    assert min(preempted) >= 1 and min(hits) >= 1 and min(shared) >= 16, r.stdout
    assert len(re.findall(r"tokens/s", r.stdout)) == 2 and r.stdout.count("KV utilisation: ") == 2
