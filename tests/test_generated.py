"""kgen.generated: the manifest records what kgen wrote, and only that output is replaced without --force.
(The command-line behaviour is in tests/cli/test_cli.py; these pin the rules behind it.)"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kgen.build import build
from kgen.errors import KgenUserError
from kgen.generated import (
    MANIFEST,
    _replace,
    _replace_by_renames,
    check_output,
    load_generated,
    write_generated,
)
from kgen.spec.models import parse_spec

SPEC = """\
kgen: 1
name: tiny_gen
kind: paged_decode
attention: {num_q_heads: 4, num_kv_heads: 2, head_dim: 32}
kv_cache: {block_size: 8, layout: separate, order: NHD, dtype: fp16}
dtype: {q: fp16}
tail_masking: true
targets: [sm_90]
"""


@pytest.fixture(scope="module")
def kernel():
    return build(parse_spec(SPEC), backend="cpu", verify=False)


@pytest.fixture
def written(tmp_path, kernel) -> Path:
    return write_generated(kernel, tmp_path / "out")


def test_manifest_lists_every_file_kgen_wrote_with_its_hash(written):
    manifest = json.loads((written / MANIFEST).read_text())
    assert manifest["generator"] == "kgen"
    files = manifest["files"]
    assert sorted(files) == ["__init__.py", "kernel.cu", "kernel.sm_90.cubin"]
    assert sorted(files) + [MANIFEST] == sorted(os.listdir(written))
    for name, digest in files.items():
        assert hashlib.sha256((written / name).read_bytes()).hexdigest() == digest, name
    assert load_generated(written).manifest["name"] == "tiny_gen"


def test_own_output_is_replaceable_even_with_a_file_of_it_deleted(written):
    check_output(written.parent, ["tiny_gen"])
    (written / "kernel.sm_90.cubin").unlink()  # nothing of the user's is in a file kgen wrote
    check_output(written.parent, ["tiny_gen"])


def refuses(out: Path, *words: str) -> None:
    with pytest.raises(KgenUserError) as e:
        check_output(out, ["tiny_gen"])
    assert str(e.value).startswith(f"{out / 'tiny_gen'}: ") and "--force" in str(e.value)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    check_output(out, ["tiny_gen"], force=True)


def test_changed_cubin_is_named(written):
    (written / "kernel.sm_90.cubin").write_bytes(b"\x7fELF patched")
    refuses(written.parent, "kernel.sm_90.cubin changed")


def test_pycache_holding_more_than_python_wrote_is_the_users(written):
    (written / "__pycache__").mkdir()
    (written / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"")
    check_output(written.parent, ["tiny_gen"])
    (written / "__pycache__" / "notes.txt").write_text("mine")
    refuses(written.parent, "__pycache__")


@pytest.mark.parametrize("text", ["not json", "[]", '{"files": {}}', '{"generator": "kgen", "files": ["kernel.cu"]}'],
                         ids=["garbage", "list", "no marker", "files not a mapping"])
def test_manifest_that_does_not_mark_kgen_output(written, text):
    (written / MANIFEST).write_text(text)
    refuses(written.parent, MANIFEST)


def test_manifest_listing_a_path_outside_its_folder(written):
    """Only plain names count: a listed '../x' would make kgen judge (and hash) files elsewhere."""
    manifest = json.loads((written / MANIFEST).read_text())
    (written.parent.parent / "elsewhere").write_text("x")
    manifest["files"]["../../elsewhere"] = hashlib.sha256(b"x").hexdigest()
    (written / MANIFEST).write_text(json.dumps(manifest))
    refuses(written.parent, MANIFEST)


def test_every_refused_name_is_reported_at_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("mine")
    (out / "b").mkdir()
    with pytest.raises(KgenUserError) as e:
        check_output(out, ["a", "b", "c"])
    lines = str(e.value).splitlines()
    assert [line.split(": ")[0] for line in lines] == [str(out / "a"), str(out / "b")]


@pytest.mark.parametrize("replace", [_replace, _replace_by_renames], ids=["exchange", "renames"])
@pytest.mark.parametrize("old", ["dir", "file", "link"])
def test_replace_leaves_only_the_new_output(tmp_path, replace, old):
    final, new = tmp_path / "pkg", tmp_path / ".pkg-new"
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("kept")
    if old == "dir":
        final.mkdir()
        (final / "old.txt").write_text("old")
    elif old == "file":
        final.write_text("old")
    else:
        final.symlink_to(tmp_path / "target")
    new.mkdir()
    (new / "new.txt").write_text("new")
    replace(new, final)
    assert sorted(os.listdir(tmp_path)) == ["pkg", "target"]
    assert not final.is_symlink() and os.listdir(final) == ["new.txt"]
    assert (tmp_path / "target" / "keep").read_text() == "kept"


# ---- each arch's body ------------------------------------------------------------------------------
PREFILL = """\
kgen: 1
name: tiny_gen_prefill
kind: paged_prefill
attention: {num_q_heads: 4, num_kv_heads: 2, head_dim: 64}
kv_cache: {block_size: 16, layout: separate, order: NHD, dtype: fp16}
dtype: {q: fp16}
tail_masking: true
targets: [sm_80, sm_90]
"""
SMALL = {"kv_tile": 16, "warps": 4, "partition_size": 0}


def test_each_arch_s_body_is_written_and_the_manifest_says_which(tmp_path):
    kernel = build(parse_spec(PREFILL), backend="cpu", verify=False, config=SMALL)
    out = write_generated(kernel, tmp_path / "out")
    manifest = json.loads((out / MANIFEST).read_text())
    bodies = manifest["bodies"]
    assert manifest["arch"] == "sm_90" and bodies["sm_90"]["source"] == "kernel.cu"
    for arch, body in bodies.items():  # each file is its arch's own body, hashed
        text = (out / body["source"]).read_text()
        assert text == kernel.artifacts["bodies"][arch].source
        assert hashlib.sha256(text.encode()).hexdigest() == body["source_sha256"] == manifest["files"].get(
            body["source"], body["source_sha256"])
    assert bodies["sm_80"]["source"] == "kernel.sm_80.cu" and "kernel.sm_80.cu" in manifest["files"]
    # an edited body blocks replacing the output without --force
    (out / "kernel.sm_80.cu").write_text("// edited\n")
    with pytest.raises(KgenUserError, match="kernel.sm_80.cu changed"):
        check_output(tmp_path / "out", ["tiny_gen_prefill"])


@pytest.mark.gpu
def test_a_generated_module_loads_the_body_and_cubin_of_the_device_s_arch(tmp_path):
    from kgen.bodies import dispatch
    from kgen.generated import GeneratedKernel
    from kgen.runtime.cuda import device_arch

    kernel = build(parse_spec(PREFILL), backend="cuda", config=SMALL, seed=5)
    assert kernel.report.passed, kernel.report.summary()
    assert kernel.arch == device_arch()  # the build verified this GPU's body; the other is named as not run
    if device_arch() == "sm_90":
        assert kernel.source == kernel.artifacts["bodies"]["sm_90"].source
        assert any(n.startswith("sm_80 mma.sync: not run on this sm_90 GPU") for n in kernel.notes), kernel.notes
    out = write_generated(kernel, tmp_path / "out")
    manifest = json.loads((out / MANIFEST).read_text())
    loaded = GeneratedKernel(out).load("cuda")
    expected = dispatch({a: b["arch_specific"] for a, b in manifest["bodies"].items()}, device_arch())
    assert loaded.arch == expected
    if expected is not None:
        assert loaded.source == kernel.artifacts["bodies"][expected].source
