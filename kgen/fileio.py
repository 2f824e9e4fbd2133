"""Atomic writes of files and directories: a reader sees the old content or the new, never half.

Everything is written under a unique hidden name next to its destination and `os.replace`d
into place (atomic within one file system). New files and directories get the user's
normal permissions (the umask applies), not the 0600/0700 that `tempfile` gives, because
what kgen writes (generated modules, cache entries, tuning results) is the user's.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def _sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    """Write `data` to `path` atomically (the directory must exist)."""
    path = Path(path)
    tmp = _sibling(path, "tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def make_temp_dir(parent: Path | str, prefix: str) -> Path:
    """A new empty directory in `parent`, to fill and then move into place with replace_dir."""
    parent = Path(parent)
    while True:
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue


def remove_path(path: Path) -> None:
    """Remove a directory tree, a file or a symlink (not what it points at); nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace_dir(staged: Path, final: Path) -> None:
    """Move the directory `staged` to `final`, replacing whatever is there (the caller decides
    whether that may be replaced). What was at `final` is put back if the move fails."""
    old = None
    if final.exists() or final.is_symlink():
        old = _sibling(final, "old")
        os.replace(final, old)  # rename(2) cannot replace a non-empty directory in one step
    try:
        os.replace(staged, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        remove_path(old)
