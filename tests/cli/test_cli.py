"""The kgen command line, run as a real subprocess: exit codes, messages, files written."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import (
    ROOT,
    SPILLY_PREFILL,
    full_tier_except,
    reference_check,
    run_kgen,
    run_python,
)
from conftest import write_spec as write

import kgen
from kgen.families.attention.decode_cases import make_decode_case

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


def test_unsupported_spec_refused_not_built(tmp_path):
    spec = write(tmp_path, GOOD.replace("head_dim: 32", "head_dim: 40").replace("layout: separate\n  order: NHD",
                 "layout: vllm").replace("dtype: fp16\n", "dtype: int8\n  scale: per_head\n", 1))
    r = run_kgen("validate", str(spec))
    assert r.returncode == 2
    assert "packs K in runs of x = 16" in r.stderr


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
        from kgen.families.attention.decode_cases import make_decode_case
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
    source = run_kgen("show", str(spec), "--config", "partition_size=0").stdout  # the ABI 1 (single-pass) launch
    broken = source.replace("TAIL_MASK = true", "TAIL_MASK = false")
    assert broken != source
    cu = write(tmp_path, broken, "hand.cu")
    r = run_kgen("verify", str(spec), "--source", str(cu), "--backend", "cpu", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    failed = {c["name"] for c in report["cases"] if not c["passed"]}
    assert "len_B-1" in failed and "len_B" not in failed


# --- kgen build -o DIR: nothing of the user's is lost --------------------------------------------------

KGEN_FILES = ["__init__.py", "kernel.cu", "kernel.sm_90.cubin", "manifest.json"]


def build_into(tmp_path: Path, out: Path, *extra: str, umask: int = -1) -> subprocess.CompletedProcess:
    spec = tmp_path / "spec.yaml"
    if not spec.exists():
        spec.write_text(GOOD)
    return run_kgen("build", str(spec), "-o", str(out), "--backend", "cpu", "--seed", "1", *extra, umask=umask)


def snapshot(path: Path) -> dict[str, object]:
    """Everything under `path` (itself included): links by target, files by content, folders by name."""
    paths = [path, *sorted(path.rglob("*"))] if path.is_dir() and not path.is_symlink() else [path]
    return {str(p.relative_to(path.parent)): ("link", os.readlink(p)) if p.is_symlink()
            else ("file", p.read_bytes()) if p.is_file() else ("dir",) for p in paths}


def test_two_builds_leave_only_what_kgen_wrote(tmp_path):
    out = tmp_path / "out"
    for _ in range(2):
        r = build_into(tmp_path, out)
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["__init__.py", "tiny_decode"]
    assert sorted(os.listdir(out / "tiny_decode")) == KGEN_FILES


def edit_added_file(pkg: Path) -> None:
    (pkg / "notes.txt").write_text("mine")


def edit_kernel_source(pkg: Path) -> None:
    (pkg / "kernel.cu").write_text((pkg / "kernel.cu").read_text() + "// my tweak\n")


def edit_manifest_gone(pkg: Path) -> None:
    (pkg / "manifest.json").unlink()


def replace_with_file(pkg: Path) -> None:
    shutil.rmtree(pkg)
    pkg.write_text("my notes, not a package")


def replace_with_link(pkg: Path) -> None:
    shutil.rmtree(pkg)
    (pkg.parent.parent / "elsewhere").mkdir()
    (pkg.parent.parent / "elsewhere" / "keep.txt").write_text("mine")
    pkg.symlink_to(pkg.parent.parent / "elsewhere")


def replace_with_user_dir(pkg: Path) -> None:
    shutil.rmtree(pkg)
    pkg.mkdir()
    (pkg / "work.py").write_text("x = 1\n")


USER_EDITS = [edit_added_file, edit_kernel_source, edit_manifest_gone, replace_with_file, replace_with_link,
              replace_with_user_dir]


# By default one edit of each kind (a file put in the way, kgen's own source edited); every edit in the full tier.
@pytest.mark.parametrize("edit", full_tier_except(USER_EDITS, {i for i, e in enumerate(USER_EDITS)
                                                               if e.__name__ in ("replace_with_file", "edit_kernel_source")}),
                         ids=[e.__name__ for e in USER_EDITS])
def test_build_refuses_to_replace_what_is_not_its_own_unless_forced(tmp_path, edit):
    out = tmp_path / "out"
    assert build_into(tmp_path, out).returncode == 0
    pkg = out / "tiny_decode"
    edit(pkg)
    before = snapshot(pkg)
    elsewhere = snapshot(tmp_path / "elsewhere") if (tmp_path / "elsewhere").exists() else None

    r = build_into(tmp_path, out)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith(f"{pkg}:") and "--force" in r.stderr, r.stderr
    assert snapshot(pkg) == before
    assert sorted(os.listdir(out)) == ["__init__.py", "tiny_decode"]

    r = build_into(tmp_path, out, "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["__init__.py", "tiny_decode"]
    assert not pkg.is_symlink() and sorted(os.listdir(pkg)) == KGEN_FILES
    if elsewhere is not None:  # --force replaces the link, never what it points at
        assert snapshot(tmp_path / "elsewhere") == elsewhere


def test_rebuild_after_the_package_was_imported(tmp_path):
    """Importing the package leaves Python's __pycache__ in it: still kgen's own output."""
    out = tmp_path / "out"
    assert build_into(tmp_path, out).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    r = subprocess.run([sys.executable, "-c", "from out.tiny_decode import kernel; print(kernel)"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (out / "tiny_decode" / "__pycache__").is_dir()
    r = build_into(tmp_path, out)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out / "tiny_decode")) == KGEN_FILES


def test_users_package_init_is_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "__init__.py").write_text("from .helpers import *  # my package\n")
    assert build_into(tmp_path, out).returncode == 0
    assert (out / "__init__.py").read_text() == "from .helpers import *  # my package\n"


def test_dangling_package_init_link_is_not_written_through(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "__init__.py").symlink_to(tmp_path / "somewhere.py")
    assert build_into(tmp_path, out).returncode == 0
    assert not (tmp_path / "somewhere.py").exists() and (out / "__init__.py").is_symlink()


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_generated_files_get_the_users_permissions(tmp_path, umask):
    out = tmp_path / "out"
    r = build_into(tmp_path, out, umask=umask)
    assert r.returncode == 0, r.stderr
    pkg = out / "tiny_decode"
    for folder in (out, pkg):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask, folder
    for file in [out / "__init__.py", *(pkg / name for name in KGEN_FILES)]:
        assert stat.S_IMODE(os.stat(file).st_mode) == 0o666 & ~umask, file


def taken_file(tmp_path: Path) -> Path:
    (tmp_path / "taken").write_text("mine")
    return tmp_path / "taken"


def dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    return tmp_path / "link"


# (description, how to make the -o path from tmp_path, words the message must hold)
BAD_OUTPUTS = [
    ("existing file", taken_file, ["taken", "not a directory"]),
    ("under a file", lambda t: taken_file(t) / "sub", ["taken", "not a directory"]),
    ("dangling link", dangling_link, ["link", "missing"]),
    ("empty", lambda t: "", ["-o", "empty"]),
]


@pytest.mark.parametrize("what,make,words", BAD_OUTPUTS, ids=[b[0] for b in BAD_OUTPUTS])
def test_unusable_output_is_bad_input_and_nothing_is_written(tmp_path, what, make, words):
    spec = write(tmp_path, GOOD)
    output = make(tmp_path)
    before = snapshot(tmp_path)
    r = run_kgen("build", str(spec), "-o", str(output), "--backend", "cpu", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    for word in words:
        assert word in r.stderr, (word, r.stderr)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["build", "verify", "tune"])
def test_negative_seed_is_bad_input(tmp_path, command):
    spec = write(tmp_path, GOOD + "tuning:\n  params:\n    threads: [64, 128]\n")
    extra = ["-o", str(tmp_path / "out")] if command == "build" else []
    r = run_kgen(command, str(spec), "--backend", "cpu", "--seed", "-1", *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "--seed" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.full  # verifies a d128 prefill on the CPU backend (about 30 s); tests/compile/test_advisories.py
# proves the same advisories reach Kernel.resources in the default tier
def test_build_reports_ptxas_advisories_and_writes_them_to_the_manifest(tmp_path):
    spec = tmp_path / "spilly.yaml"
    spec.write_text(yaml.safe_dump(SPILLY_PREFILL))
    r = run_kgen("build", str(spec), "-o", str(tmp_path / "out"), "--backend", "cpu", "--seed", "1")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ptxas ")]
    assert [ln.split(":", 1)[0] for ln in lines] == ["ptxas sm_80 spilly_prefill"] * 2, r.stdout
    assert "spill " in lines[0] and "bytes spill stores" in lines[0] and "stack " in lines[1]
    assert "2 ptxas advisories" in r.stdout
    manifest = json.loads((tmp_path / "out" / "spilly_prefill" / "manifest.json").read_text())
    assert [a["code"] for a in manifest["cubins"]["sm_80"]["resources"]["spilly_prefill"]["advisories"]] == [
        "spill", "stack"]


# ---- each arch's body (kgen/bodies.py) -------------------------------------------------------------
PREFILL = textwrap.dedent("""\
    kgen: 1
    name: tiny_prefill
    kind: paged_prefill
    attention: {num_q_heads: 4, num_kv_heads: 2, head_dim: 64}
    kv_cache: {block_size: 16, layout: separate, order: NHD, dtype: fp16}
    dtype: {q: fp16}
    tail_masking: true
    targets: [sm_90]
    tuning:
      params: {warps: [4], kv_tile: [16], partition_size: [0]}
      defaults: {warps: 4, kv_tile: 16, partition_size: 0}
""")


def test_build_arch_beyond_an_sm_90_only_prefill_spec_gives_each_arch_its_body(tmp_path):
    """`--arch sm_80 --arch sm_90` on a spec targeting sm_90 alone once failed (the wgmma body compiled for
    sm_80: a static assertion); each arch now gets its body, both verified, named, written and loadable."""
    spec = write(tmp_path, PREFILL)
    r = run_kgen("build", str(spec), "--arch", "sm_80", "--arch", "sm_90", "--backend", "cpu", "--seed", "5",
                 "-o", str(tmp_path / "generated"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "body sm_80: mma.sync (not the Hopper body: no wgmma before sm_90)" in r.stdout
    assert "body sm_90: wgmma (Hopper body: head_dim 64, fp16 q" in r.stdout and "compiled for sm_90a)" in r.stdout
    out = tmp_path / "generated" / "tiny_prefill"
    assert {p.name for p in out.iterdir()} >= {"kernel.cu", "kernel.sm_80.cu", "kernel.sm_80.cubin", "kernel.sm_90.cubin"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["arch"] == "sm_90"
    assert {a: (b["body"], b["source"], b["arch_specific"]) for a, b in manifest["bodies"].items()} == {
        "sm_80": ("mma.sync", "kernel.sm_80.cu", False), "sm_90": ("wgmma", "kernel.cu", True)}
    labels = {c["name"].split("]")[0] + "]" for c in manifest["verification"]["cases"]}
    assert labels == {"[sm_90 wgmma]", "[sm_80 mma.sync]"} and manifest["verification"]["passed"]
    assert "paged_prefill_body<Cfg>" in (out / "kernel.sm_80.cu").read_text()
    # the generated module's CPU load runs kernel.cu's body, with its geometry
    from kgen.generated import GeneratedKernel
    loaded = GeneratedKernel(out).load("cpu")
    assert loaded.arch == "sm_90" and "paged_prefill_wgmma_body<Cfg>" in loaded.source


def test_abi_and_show_name_each_arch_s_body(tmp_path):
    spec = write(tmp_path, PREFILL.replace("targets: [sm_90]", "targets: [sm_80, sm_90]"))
    abi = run_kgen("abi", str(spec))
    assert abi.returncode == 0, abi.stderr
    assert " *   sm_80: mma.sync (not the Hopper body: no wgmma before sm_90)\n" in abi.stdout
    assert " *   sm_90: wgmma (Hopper body: head_dim 64" in abi.stdout
    assert "per target arch" in abi.stdout and "block (128)" in abi.stdout  # the hand-written launch: mma.sync's
    shown = {arch: run_kgen("show", str(spec), "--arch", arch).stdout for arch in ("sm_80", "sm_90")}
    assert "paged_prefill_body<Cfg>" in shown["sm_80"] and "paged_prefill_wgmma_body<Cfg>" in shown["sm_90"]
    assert run_kgen("show", str(spec)).stdout == shown["sm_80"]  # the oldest target's by default: every target compiles it
    bad = run_kgen("show", str(spec), "--arch", "sm_91")
    assert bad.returncode == 2 and "sm_91 not supported" in bad.stderr
