"""Hand-written sources through the command line: what `kgen show` prints verifies and builds as
is (`kgen verify --source`, `kgen build --source`), for a decode and a prefill bundled spec;
a source of another kind, or one that fails, is refused with nothing written."""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import ROOT, run_kgen, write_spec

SPECS = ROOT / "specs"


# Each verifies twice over its family's matrix (decode ~1 min, prefill ~4.5 min): the full tier's. The default
# tier runs `kgen verify --source` and `kgen build --source` below and in tests/cli/test_cli.py, and verifies
# `kgen show` output in tests/verify/test_load_source.py.
@pytest.mark.parametrize("name", [pytest.param("llama3_8b_decode", marks=pytest.mark.full),
                                  pytest.param("llama3_8b_prefill", marks=pytest.mark.full)])
def test_kgen_show_output_verifies_and_builds_as_is(tmp_path, name):
    spec = SPECS / f"{name}.yaml"
    shown = run_kgen("show", str(spec))
    assert shown.returncode == 0, shown.stderr
    cu = tmp_path / "mine.cu"
    cu.write_text(shown.stdout)  # unedited: the starting point an assistant is handed

    r = run_kgen("verify", str(spec), "--source", str(cu), "--backend", "cpu", "--seed", "1", "--json")
    assert r.returncode == 0, r.stderr + r.stdout[-2000:]
    report = json.loads(r.stdout)
    assert report["passed"] and report["config"]["partition_size"] > 0  # the default (split-KV) config

    out = tmp_path / "generated"
    r = run_kgen("build", str(spec), "--source", str(cu), "-o", str(out), "--backend", "cpu", "--seed", "1")
    assert r.returncode == 0, r.stderr + r.stdout
    manifest = json.loads((out / name / "manifest.json").read_text())
    assert manifest["handwritten_source"] == str(cu) and manifest["verification"]["passed"]
    assert sorted(p.name for p in (out / name).iterdir()) == [
        "__init__.py", "kernel.cu", "kernel.sm_80.cubin", "kernel.sm_90.cubin", "manifest.json"]


TINY = textwrap.dedent("""\
    kgen: 1
    name: tiny_src
    kind: paged_decode
    attention: {num_q_heads: 4, num_kv_heads: 2, head_dim: 32}
    kv_cache: {block_size: 8, layout: separate, order: NHD, dtype: fp16}
    dtype: {q: fp16}
    tail_masking: true
    targets: [sm_90]
""")


def test_a_source_of_another_kind_is_refused_with_exit_2(tmp_path):
    decode = SPECS / "llama3_8b_decode.yaml"
    cu = tmp_path / "decode.cu"
    cu.write_text(run_kgen("show", str(decode)).stdout)
    out = tmp_path / "generated"
    for command in (("verify",), ("build", "-o", str(out))):
        r = run_kgen(*command, str(SPECS / "llama3_8b_prefill.yaml"), "--source", str(cu), "--backend", "cpu")
        assert r.returncode == 2, r.stderr
        assert "is a paged_decode kernel" in r.stderr and "llama3_8b_prefill is a paged_prefill spec" in r.stderr
        assert "Traceback" not in r.stderr
    assert not out.exists()


def test_build_source_that_fails_verification_exits_1_and_writes_nothing(tmp_path):
    spec = write_spec(tmp_path, TINY)
    source = run_kgen("show", str(spec), "--config", "partition_size=0").stdout
    cu = tmp_path / "broken.cu"
    cu.write_text(source.replace("TAIL_MASK = true", "TAIL_MASK = false"))
    out = tmp_path / "generated"
    r = run_kgen("build", str(spec), "--source", str(cu), "-o", str(out), "--backend", "cpu", "--seed", "1")
    assert r.returncode == 1, r.stderr
    assert "FAIL" in r.stdout and "nothing written" in r.stdout and "Traceback" not in r.stderr
    assert not (out / "tiny_src").exists()


def test_build_source_user_errors_exit_2(tmp_path):
    spec = write_spec(tmp_path, TINY)
    other = write_spec(tmp_path, TINY.replace("tiny_src", "tiny_other"), "other.yaml")
    out = tmp_path / "generated"
    cases = [
        (("build", str(spec), "--source", str(tmp_path / "missing.cu"), "-o", str(out)), "cannot read the kernel source"),
        (("build", str(spec), str(other), "--source", str(tmp_path / "x.cu"), "-o", str(out)), "one SPEC"),
        (("build", str(spec), "--tune", "--source", str(tmp_path / "x.cu"), "-o", str(out)), "leave out --tune"),
    ]
    for args, message in cases:
        r = run_kgen(*args, "--backend", "cpu")
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()
