"""The content-addressed artifact cache: keys, hits, corruption, locks left by killed processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kgen.cache import ArtifactCache, content_key

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
