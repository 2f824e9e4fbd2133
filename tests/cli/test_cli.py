"""The kgen command line, run as a real subprocess: exit codes, messages, files written."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from conftest import ROOT, reference_check, run_kgen, run_python
from conftest import write_spec as write

import kgen
from kgen.families.decode_cases import make_decode_case

LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"

GOOD = textwrap.dedent("""\
    kgen: 1
    name: tiny_decode
    kind: paged_decode
    attention:
      num_q_heads: 4
      num_kv_heads: 2
      head_dim: 32
    kv_cache:
      block_size: 8
      layout: separate
      order: NHD
      dtype: fp16
    dtype:
      q: fp16
    tail_masking: true
    targets: [sm_90]
    """)


# (description, spec text, expected line, expected words in the message)
BAD_SPECS = [
    ("unknown key", GOOD.replace("  head_dim: 32\n", "  head_dim: 32\n  head_dims: 32\n"), 8, ["head_dims", "did you mean"]),
    ("missing tail_masking", GOOD.replace("tail_masking: true\n", ""), 1, ["tail_masking"]),
    ("block_size 24", GOOD.replace("block_size: 8", "block_size: 24"), 9, ["block_size", "power of two", "24"]),
    ("head_dim 100", GOOD.replace("head_dim: 32", "head_dim: 100"), 7, ["head_dim", "100"]),
    ("heads 30/8", GOOD.replace("num_q_heads: 4", "num_q_heads: 30").replace("num_kv_heads: 2", "num_kv_heads: 8"),
     6, ["num_kv_heads", "30", "8"]),
    ("injected name", GOOD.replace("name: tiny_decode", "name: 'x; system(\"rm -rf /\")'"), 2, ["name"]),
    ("yaml syntax", GOOD.replace("  head_dim: 32\n", "  head_dim: [32\n"), None, []),
    ("empty file", "", 1, ["empty"]),
]


@pytest.mark.parametrize("what,text,line,words", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
@pytest.mark.parametrize("command", ["build", "validate"])
def test_bad_spec_exit_2_one_message_nothing_written(tmp_path, what, text, line, words, command):
    spec = write(tmp_path, text)
    out_dir = tmp_path / "out"
    args = [command, str(spec)] + (["-o", str(out_dir)] if command == "build" else [])
    r = run_kgen(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith(f"{spec}:"), first
    if line is not None:
        assert first.startswith(f"{spec}:{line}:"), first
    for word in words:
        assert word.lower() in r.stderr.lower(), (word, r.stderr)
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_missing_file_is_bad_input(tmp_path):
    r = run_kgen("build", str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert "not found" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_one_bad_spec_among_good_writes_nothing(tmp_path):
    good = write(tmp_path, GOOD, "good.yaml")
    bad = write(tmp_path, GOOD.replace("block_size: 8", "block_size: 24"), "bad.yaml")
    r = run_kgen("build", str(good), str(bad), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert f"{bad}:9:" in r.stderr
    assert not (tmp_path / "out").exists()


def test_unsupported_kind_refused_not_built(tmp_path):
    spec = write(tmp_path, GOOD.replace("kind: paged_decode", "kind: paged_prefill"))
    r = run_kgen("validate", str(spec))
    assert r.returncode == 2
    assert "not supported yet" in r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_build")
    spec = write(tmp, GOOD)
    r = run_kgen("build", str(spec), "-o", str(tmp / "generated"), "--backend", "cpu", "--seed", "7")
    return tmp, spec, r


def test_build_writes_generated_package(built):
    tmp, spec, r = built
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout and "tiny_decode" in r.stdout and "seed 7" in r.stdout
    pkg = tmp / "generated" / "tiny_decode"
    names = sorted(p.name for p in pkg.iterdir())
    assert names == ["__init__.py", "kernel.cu", "kernel.sm_90.cubin", "manifest.json"]
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["spec"]["name"] == "tiny_decode"
    assert manifest["verification"]["passed"] is True and manifest["verification"]["seed"] == 7
    assert manifest["cubins"]["sm_90"]["resources"]["tiny_decode"]["registers"] > 0
    assert (pkg / "kernel.sm_90.cubin").read_bytes()[:4] == b"\x7fELF"
    assert manifest["compilers"]["nvrtc"]


def test_generated_module_imports_and_runs_in_fresh_process(built):
    tmp, spec_path, _ = built
    code = textwrap.dedent("""
        import numpy as np
        from generated.tiny_decode import kernel
        from kgen.families.decode_cases import make_decode_case
        args = make_decode_case(kernel.spec, [1, 9, 17], np.random.default_rng(3))
        np.save("out.npy", kernel(**args))
    """)
    r = run_python(code, tmp, path=(tmp,))
    assert r.returncode == 0, r.stderr
    spec = kgen.load_spec(spec_path)
    args = make_decode_case(spec, [1, 9, 17], np.random.default_rng(3))  # the child's inputs, same seed
    check = reference_check(spec, args, np.load(tmp / "out.npy"))
    assert check.passed, (check.max_error, check.bound)


def test_rebuild_replaces_atomically(built):
    tmp, spec, _ = built
    before = (tmp / "generated" / "tiny_decode" / "manifest.json").read_text()
    bad = write(tmp, GOOD.replace("head_dim: 32", "head_dim: 100"), "bad.yaml")
    r = run_kgen("build", str(bad), "-o", str(tmp / "generated"))
    assert r.returncode == 2
    assert (tmp / "generated" / "tiny_decode" / "manifest.json").read_text() == before
    assert not [p for p in (tmp / "generated").iterdir() if p.name.startswith(".")]


def test_show_abi_schema(tmp_path):
    spec = write(tmp_path, GOOD)
    show = run_kgen("show", str(spec))
    assert show.returncode == 0
    assert 'extern "C" __global__' in show.stdout and "HEAD_DIM = 32" in show.stdout
    abi = run_kgen("abi", str(spec))
    assert abi.returncode == 0
    assert "block_tables" in abi.stdout and "tiny_decode(" in abi.stdout
    assert "[num_blocks, 8, 2, 32]" in abi.stdout  # NHD k_cache shape, specialised
    schema = run_kgen("schema")
    assert schema.returncode == 0
    data = json.loads(schema.stdout)
    assert "tail_masking" in data["required"]


def test_verify_command_reports_and_passes(tmp_path):
    spec = write(tmp_path, GOOD)
    r = run_kgen("verify", str(spec), "--backend", "cpu", "--json", "--seed", "11")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] and report["seed"] == 11
    assert {"len_1", "len_B-1", "len_B", "len_B+1", "len_2B+1", "long", "mixed_batch", "shared_prefix"} <= {
        c["name"] for c in report["cases"]}


def test_verify_handwritten_kernel_that_ignores_tail_fails(tmp_path):
    """A hand-written kernel (here: kgen's own source with the tail mask dropped) is caught: exit 1."""
    spec = write(tmp_path, GOOD)
    source = run_kgen("show", str(spec)).stdout
    broken = source.replace("TAIL_MASK = true", "TAIL_MASK = false")
    assert broken != source
    cu = write(tmp_path, broken, "hand.cu")
    r = run_kgen("verify", str(spec), "--source", str(cu), "--backend", "cpu", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    failed = {c["name"] for c in report["cases"] if not c["passed"]}
    assert "len_B-1" in failed and "len_B" not in failed
