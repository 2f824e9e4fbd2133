"""The content-addressed artifact cache: keys, hits, corruption, locks left by killed processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kgen.cache import ArtifactCache, content_key
from kgen.errors import KgenUserError

ROOT = Path(__file__).resolve().parents[1]


def test_key_depends_on_every_part_and_boundaries():
    assert content_key("a", "b") == content_key("a", "b")
    assert content_key("a", "b") != content_key("a", "c")
    assert content_key("ab", "c") != content_key("a", "bc")
    assert content_key(b"x") == content_key("x")


def test_miss_then_hit(tmp_path):
    cache = ArtifactCache(tmp_path)
    calls = []

    def build(d: Path):
        calls.append(1)
        (d / "artifact.bin").write_bytes(b"payload")

    entry, hit = cache.get_or_build("ns", content_key("k"), build)
    assert not hit and (entry / "artifact.bin").read_bytes() == b"payload"
    entry2, hit2 = cache.get_or_build("ns", content_key("k"), build)
    assert hit2 and entry2 == entry and len(calls) == 1


def test_corrupt_or_partial_entry_is_rebuilt(tmp_path):
    cache = ArtifactCache(tmp_path)
    key = content_key("k2")
    entry, _ = cache.get_or_build("ns", key, lambda d: (d / "a.bin").write_bytes(b"good"))
    (entry / "a.bin").write_bytes(b"bad!")
    assert cache.lookup("ns", key) is None
    entry, hit = cache.get_or_build("ns", key, lambda d: (d / "a.bin").write_bytes(b"good"))
    assert not hit and (entry / "a.bin").read_bytes() == b"good"
    (entry / "entry.json").write_text("{not json")
    assert cache.lookup("ns", key) is None


def test_failed_build_leaves_nothing(tmp_path):
    cache = ArtifactCache(tmp_path)
    key = content_key("fails")

    def build(d: Path):
        (d / "half.bin").write_bytes(b"x")
        raise RuntimeError("compiler crashed")

    try:
        cache.get_or_build("ns", key, build)
    except RuntimeError:
        pass
    assert cache.lookup("ns", key) is None
    leftovers = [p for p in (tmp_path / "ns").rglob("*") if p.is_dir() and p.name.startswith(".")]
    assert leftovers == []


def test_lock_of_killed_process_is_recovered(tmp_path):
    cache = ArtifactCache(tmp_path)
    key = content_key("locked")
    lock = str(cache.entry_dir("ns", key)) + ".lock"
    Path(lock).parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); l.acquire(); "
        "print('held', flush=True); time.sleep(60)"), lock], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    entry, hit = cache.get_or_build("ns", key, lambda d: (d / "a").write_text("ok"))
    assert not hit and (entry / "a").read_text() == "ok"
    assert time.monotonic() - start < 30  # not stuck behind the dead holder's lock


def _build_in_child(root: str, marker: str) -> None:
    cache = ArtifactCache(root)

    def build(d: Path):
        with open(marker, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        (d / "a").write_text("ok")

    cache.get_or_build("ns", content_key("shared"), build)


def test_concurrent_builders_build_once(tmp_path):
    marker = tmp_path / "marker"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path / "c"), str(marker))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert marker.read_text().count("built") == 1


# ---- a cache directory kgen cannot use: a message that says where and what to do, never a traceback

def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory in which nothing can be created: chmod 0500 (root ignores modes: use sysfs,
    which refuses new entries to everyone)."""
    if os.geteuid() != 0:
        d = tmp_path / "readonly"
        d.mkdir()
        d.chmod(0o500)
        return d
    return Path("/sys/kgen-cache-test")


def _bad_cache_dirs(tmp_path: Path) -> dict[str, Path]:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    return {
        "under a regular file": a_file / "cache",
        "is a regular file": a_file,
        "not writable": _unwritable_dir(tmp_path) / "cache",
        "not creatable": tmp_path / ("x" * 300) / "cache",
    }


def test_unusable_cache_dir_is_a_user_error_naming_it(tmp_path, monkeypatch):
    for what, root in _bad_cache_dirs(tmp_path).items():
        monkeypatch.setenv("KGEN_CACHE_DIR", str(root))
        cache = ArtifactCache()
        try:
            cache.get_or_build("ns", content_key(what), lambda d: (d / "a").write_text("ok"))
        except KgenUserError as e:
            text = str(e)
        else:
            raise AssertionError(f"{what}: no error")
        assert str(root) in text and "from KGEN_CACHE_DIR" in text and "Set KGEN_CACHE_DIR" in text, (what, text)
        with pytest.raises(KgenUserError, match="cannot be used"):
            cache.put_file("loaded", "x.cubin", b"data")


def test_unusable_cache_dir_exits_2_without_traceback(tmp_path):
    spec = ROOT / "specs" / "llama3_8b_decode.yaml"
    for what, root in _bad_cache_dirs(tmp_path).items():
        env = dict(os.environ, PYTHONPATH=str(ROOT), KGEN_CACHE_DIR=str(root))
        res = subprocess.run([sys.executable, "-m", "kgen.cli", "build", str(spec), "-o", str(tmp_path / "gen"),
                              "--backend", "cpu"], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 2, (what, res.stderr)
        assert "Traceback" not in res.stderr and str(root) in res.stderr and "KGEN_CACHE_DIR" in res.stderr, what


def test_read_only_cache_with_the_entry_is_still_read(tmp_path):
    cache = ArtifactCache(tmp_path)
    entry, _ = cache.get_or_build("ns", content_key("ro"), lambda d: (d / "a").write_text("ok"))
    if os.geteuid() != 0:  # (root can always write; the point is that a hit writes nothing)
        for p in (tmp_path, *tmp_path.rglob("*")):
            if p.is_dir():
                p.chmod(0o500)
    again, hit = cache.get_or_build("ns", content_key("ro"), lambda d: 1 / 0)
    assert hit and again == entry


def test_a_file_where_the_entry_belongs_is_replaced(tmp_path):
    cache = ArtifactCache(tmp_path)
    key = content_key("file-in-the-way")
    final = cache.entry_dir("ns", key)
    final.parent.mkdir(parents=True)
    final.write_text("leftover")
    entry, hit = cache.get_or_build("ns", key, lambda d: (d / "a").write_text("ok"))
    assert not hit and entry == final and (entry / "a").read_text() == "ok"
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name, final.name + ".lock"]


def test_entries_get_the_users_normal_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        entry, _ = ArtifactCache(tmp_path).get_or_build("ns", content_key("perm"), lambda d: (d / "a").write_text("x"))
        loaded = ArtifactCache(tmp_path).put_file("loaded", "k.cubin", b"x")
    finally:
        os.umask(old)
    assert entry.stat().st_mode & 0o777 == 0o755
    assert loaded.stat().st_mode & 0o777 == 0o644


def test_discard_removes_an_entry(tmp_path):
    cache = ArtifactCache(tmp_path)
    cache.get_or_build("ns", content_key("d"), lambda d: (d / "a").write_text("ok"))
    cache.discard("ns", content_key("d"))
    assert cache.lookup("ns", content_key("d")) is None
