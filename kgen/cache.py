"""Content-addressed on-disk cache of compiled artifacts.

An entry is a directory `<root>/<namespace>/<key[:2]>/<key>/` holding the artifact
files plus `entry.json` (the sha256 of every file). The key hashes only content
(source, options, arch, compiler and kgen versions), never paths or mtimes.

Build protocol (as in FlashInfer's JIT): take the per-key file lock, look again,
build into a temporary directory next to the entry, then `os.replace` it into
place. `filelock` uses OS locks, so a lock held by a killed process is released
by the kernel and the next builder proceeds. A corrupt entry (missing file, hash
mismatch, unreadable index) is deleted and rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from kgen import settings
from kgen.version import __version__

ENTRY_INDEX = "entry.json"
LOCK_TIMEOUT_S = 600


def content_key(*parts: str | bytes) -> str:
    """sha256 over the parts (length-prefixed, so ("ab","c") != ("a","bc")) and kgen's version."""
    h = hashlib.sha256()
    for part in (__version__, *parts):
        data = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class ArtifactCache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else settings.cache_dir()

    def entry_dir(self, namespace: str, key: str) -> Path:
        return self.root / namespace / key[:2] / key

    def lookup(self, namespace: str, key: str) -> Path | None:
        """The entry's directory if present and intact, else None (never raises on a bad entry)."""
        entry = self.entry_dir(namespace, key)
        try:
            index = json.loads((entry / ENTRY_INDEX).read_text())
            for name, digest in index["files"].items():
                if _sha256_file(entry / name) != digest:
                    return None
            return entry
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def get_or_build(self, namespace: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
        """Return (entry dir, hit). On a miss, `build(tmpdir)` writes the artifact files into tmpdir."""
        entry = self.lookup(namespace, key)
        if entry is not None:
            return entry, True
        final = self.entry_dir(namespace, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(final) + ".lock", timeout=LOCK_TIMEOUT_S):
            entry = self.lookup(namespace, key)  # another process may have built it meanwhile
            if entry is not None:
                return entry, True
            tmp = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-", dir=final.parent))
            try:
                build(tmp)
                files = {p.name: _sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                (tmp / ENTRY_INDEX).write_text(json.dumps({"key": key, "files": files}, indent=1))
                if final.exists():  # corrupt leftover: replace it whole
                    shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        return final, False


def default_cache() -> ArtifactCache:
    return ArtifactCache()
