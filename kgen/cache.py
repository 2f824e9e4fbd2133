"""Content-addressed on-disk cache of compiled artifacts.

An entry is a directory `<root>/<namespace>/<key[:2]>/<key>/` holding the artifact
files plus `entry.json` (the sha256 of every file). The key hashes only content
(source, options, arch, compiler and kgen versions), never paths or mtimes.

Build protocol (as in FlashInfer's JIT): take the per-key file lock, look again,
build into a temporary directory next to the entry, then move it into place
(kgen.fileio). `filelock` uses OS locks, so a lock held by a killed process is released
by the kernel and the next builder proceeds. A corrupt entry (missing file, hash
mismatch, unreadable index) is replaced by a fresh build, never loaded. A cache
directory that cannot be written is a KgenUserError that says which and what to do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

from kgen.errors import KgenUserError
from kgen.fileio import atomic_write_bytes, make_temp_dir, remove_path, replace_dir
from kgen.settings import KGEN_CACHE_DIR, cache_dir
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


def _file_in_the_way(path: Path) -> Path | None:
    """The first component of `path` that exists and is not a directory, if any."""
    for p in reversed((path, *path.parents)):
        try:
            if p.exists() and not p.is_dir():
                return p
        except OSError:
            return None
    return None


class ArtifactCache:
    def __init__(self, root: Path | str | None = None):
        if root is not None:
            self.root, self._origin = Path(root), "given by the caller"
        else:
            self.root = cache_dir()
            self._origin = ("from KGEN_CACHE_DIR" if KGEN_CACHE_DIR.source() == "environment"
                            else "the default; KGEN_CACHE_DIR is unset")

    def entry_dir(self, namespace: str, key: str) -> Path:
        return self.root / namespace / key[:2] / key

    def unusable(self, error: OSError) -> KgenUserError:
        """The message for a cache directory kgen cannot write (missing parent, a file in the way,
        read-only file system, no permission)."""
        where = f" ({error.filename})" if error.filename else ""
        blocker = _file_in_the_way(Path(error.filename)) if error.filename else None
        why = f"{blocker} is a file, not a directory" if blocker else f"{error.strerror or error}{where}"
        return KgenUserError(
            f"kgen's cache directory {self.root} ({self._origin}) cannot be used: {why}. "
            "Set KGEN_CACHE_DIR to a directory you can write "
            "(it is created if missing), e.g. KGEN_CACHE_DIR=$HOME/.cache/kgen"
        )

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

    @contextmanager
    def _locked(self, final: Path) -> Iterator[None]:
        """Hold the entry's file lock (creating its directory)."""
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(final) + ".lock", timeout=LOCK_TIMEOUT_S)
            lock.acquire()
        except OSError as e:
            raise self.unusable(e) from None
        try:
            yield
        finally:
            lock.release()

    def get_or_build(self, namespace: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
        """Return (entry dir, hit). On a miss, `build(tmpdir)` writes the artifact files into tmpdir."""
        entry = self.lookup(namespace, key)
        if entry is not None:
            return entry, True
        final = self.entry_dir(namespace, key)
        with self._locked(final):
            entry = self.lookup(namespace, key)  # another process may have built it meanwhile
            if entry is not None:
                return entry, True
            try:
                tmp = make_temp_dir(final.parent, f".{key[:8]}-")
            except OSError as e:
                raise self.unusable(e) from None
            try:
                build(tmp)
                files = {p.name: _sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                try:
                    (tmp / ENTRY_INDEX).write_text(json.dumps({"key": key, "files": files}, indent=1))
                    replace_dir(tmp, final)  # a corrupt leftover at `final` is replaced whole
                except OSError as e:
                    raise self.unusable(e) from None
            finally:
                remove_path(tmp)
        return final, False

    def discard(self, namespace: str, key: str) -> None:
        """Remove an entry that passed its hash check but cannot be used (see compile.host.rebuild_host)."""
        final = self.entry_dir(namespace, key)
        with self._locked(final):
            remove_path(final)

    def put_file(self, namespace: str, name: str, data: bytes) -> Path:
        """`<root>/<namespace>/<name>` holding `data`, written once: `name` must identify the content."""
        path = self.root / namespace / name
        try:
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, data)
        except OSError as e:
            raise self.unusable(e) from None
        return path
