"""Atomic writes (kgen.fileio): all or nothing, nothing left behind, the user's permissions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kgen.fileio import (
    atomic_write_bytes,
    atomic_write_text,
    make_temp_dir,
    replace_dir,
)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_write_replaces_and_leaves_nothing_behind(tmp_path, umask_022):
    path = tmp_path / "results.json"
    atomic_write_text(path, "old")
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert path.stat().st_mode & 0o777 == 0o644  # not tempfile's 0600


def test_failed_write_keeps_the_old_content(tmp_path):
    path = tmp_path / "results.json"
    atomic_write_text(path, "old")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_temp_dir_has_the_users_permissions(tmp_path, umask_022):
    d = make_temp_dir(tmp_path, ".x-")
    assert d.is_dir() and d.name.startswith(".x-") and d.stat().st_mode & 0o777 == 0o755  # not 0700
    assert make_temp_dir(tmp_path, ".x-") != d


def _staged(tmp_path: Path, text: str) -> Path:
    d = make_temp_dir(tmp_path, ".stage-")
    (d / "f").write_text(text)
    return d


def test_replace_dir_replaces_a_directory_file_or_symlink(tmp_path):
    final = tmp_path / "out"
    replace_dir(_staged(tmp_path, "1"), final)  # nothing there yet
    (final / "extra").write_text("x")
    replace_dir(_staged(tmp_path, "2"), final)  # a non-empty directory
    assert sorted(p.name for p in final.iterdir()) == ["f"] and (final / "f").read_text() == "2"
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("k")
    for kind in ("file", "symlink"):
        final_other = tmp_path / f"out_{kind}"
        if kind == "file":
            final_other.write_text("a file")
        else:
            final_other.symlink_to(target)
        replace_dir(_staged(tmp_path, kind), final_other)
        assert final_other.is_dir() and not final_other.is_symlink() and (final_other / "f").read_text() == kind
    assert (target / "keep").read_text() == "k"  # a symlink's target is never touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out_file", "out_symlink", "target"]
