"""Hand-written kernels are verified isolated: a crash, an abort or a hang is the failed verdict of
the case that triggered it (named with the signal or the timeout), `kgen verify --source` exits 1,
and the verifier lives on. A correct kernel still passes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kgen
from kgen.render import render
from kgen.runtime.isolated import IsolatedCpuModule
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "kgen": 1, "name": "iso_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
SPEC_YAML = """kgen: 1
name: iso_decode
kind: paged_decode
attention: {num_q_heads: 8, num_kv_heads: 2, head_dim: 64}
kv_cache: {block_size: 16, layout: separate, order: NHD, dtype: fp16}
dtype: {q: fp16}
tail_masking: true
targets: [sm_90]
"""
BODY = "  kgen::paged_decode_body<Cfg>("
# Each fault strikes only in the case with the 300-token sequence ('long'), after the short cases passed.
NULL_DEREF = "  if (seq_lens[blockIdx.y] == 300) *(volatile int*)nullptr = 1;\n"
ENDLESS = "  if (seq_lens[blockIdx.y] == 300) { volatile int x = 0; for (;;) x = x + 1; }\n"
# abort() itself is refused by the source policy; a division by zero is kernel code that still crashes
DIVIDE = ("  if (seq_lens[blockIdx.y] == 300) { volatile int z = seq_lens[blockIdx.y] - 300;"
          " out[0] = (Cfg::out_t)(float)(7 / z); }\n")


@pytest.fixture(scope="module")
def spec():
    return kgen.spec_from_dict(SPEC)


@pytest.fixture(scope="module")
def source(spec):
    src = render(spec, {"partition_size": 0, "mma_min_group": 0}).source
    assert src.count(BODY) == 1
    return src


def planted(source: str, fault: str) -> str:
    return source.replace(BODY, fault + BODY)


def test_correct_handwritten_kernel_passes_isolated(spec, source):
    kern = kernel_from_source(spec, source, backend="cpu", archs=[])
    assert isinstance(kern.module, IsolatedCpuModule)
    report = verify(kern, seed=7)
    assert report.passed, report.summary()
    kern.module.close()


def test_fused_cache_reached_by_address_passes_isolated():
    """A fused cache reaches the kernel as two addresses inside it (not as arrays): the isolated child
    maps it at the caller's addresses (Launch.reached), so they hold there."""
    spec = kgen.spec_from_dict(SPEC).with_overrides(**{"kv_cache.layout": "fused", "kv_cache.order": "HND"})
    kern = kernel_from_source(spec, render(spec, {"partition_size": 0, "mma_min_group": 0}).source, backend="cpu", archs=[])
    report = verify(kern, seed=8)
    assert report.passed, report.summary()
    kern.module.close()


@pytest.mark.parametrize("fault,verdict", [(NULL_DEREF, "SIGSEGV"), (DIVIDE, "SIGFPE")], ids=["null", "divide"])
def test_crash_fails_the_case_that_triggered_it(spec, source, fault, verdict):
    kern = kernel_from_source(spec, planted(source, fault), backend="cpu", archs=[])
    report = verify(kern, seed=7)
    assert not report.passed
    passed = [c.name for c in report.cases if c.passed]
    assert {"len_1", "len_B", "len_2B+1"} <= set(passed)
    (bad,) = report.failed_cases
    assert bad.name == "long" and bad.sizes == [300]
    assert verdict in bad.note and "'long'" in bad.note
    assert bad.name in report.summary()
    kern.module.close()


def run_kgen(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "kgen.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


# An endless kernel meets the wall-clock limit or, on a loaded machine, the CPU-time one first.
@pytest.mark.parametrize("fault,verdict", [(NULL_DEREF, "SIGSEGV"), (ENDLESS, "timed out after|CPU-time limit")],
                         ids=["null", "endless"])
def test_cli_verify_source_exits_1_naming_the_case_and_the_verdict(tmp_path, source, fault, verdict):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC_YAML)
    cu = tmp_path / "hand.cu"
    cu.write_text(planted(source, fault))
    r = run_kgen("verify", str(spec_path), "--source", str(cu), "--backend", "cpu", "--json", "--seed", "3")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # a verdict, not a signal of the verifier
    report = json.loads(r.stdout)
    failed = [c for c in report["cases"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["long"]
    assert re.search(verdict, failed[0]["note"]), failed[0]["note"]
    assert not report["passed"]
