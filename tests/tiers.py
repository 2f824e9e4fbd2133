"""The suite's two tiers (docs/testing.md), as a pytest plugin (pyproject's addopts load it with `-p tiers`).

- **default** (`--tier default`, what the README's command and CI run): every test not marked
  `@pytest.mark.full`. It proves every family, cache format, kernel body and command at least once.
- **full** (`--tier full`, or `-m full`): only the tests marked `full`: the exhaustive matrix.
  `--full-shard K/N` keeps the K-th of N slices of it (a stable hash of the test id), so CI can
  run a rotating quarter of it on every landing (.ci/run).
- **all** (`--tier all`): both.

A test declares its tier where it is written: `@pytest.mark.full` on the function,
`pytestmark = pytest.mark.full` for a module, or `pytest.param(..., marks=pytest.mark.full)` for
one parameter. A `-m` expression that names `full` selects by itself (the tier is then `all`).
A failed run ends with the command that reruns each failed test alone, in its tier.
"""

from __future__ import annotations

import argparse
import zlib

import pytest

TIERS = ("default", "full", "all")
MARK = "full"


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 0 <= K < N; argparse's usage error (exit 4) otherwise."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N with 0 <= K < N (for example 1/4)")
    return k, n


def shard_of(nodeid: str, shards: int) -> int:
    """Which of `shards` slices a test belongs to: stable across runs, machines and Python versions."""
    return zlib.crc32(nodeid.encode()) % shards


def pytest_addoption(parser):
    group = parser.getgroup("kgen", "kgen's test tiers (docs/testing.md)")
    group.addoption("--tier", choices=TIERS, default="default",
                    help="default: the tests not marked `full` (the README's command); full: only those "
                         "marked `full` (the exhaustive matrix); all: both. Default: default")
    group.addoption("--full-shard", type=parse_shard, default=None, metavar="K/N",
                    help="only the K-th of N slices of the full tier (0 <= K < N); with --tier full or all")


def _tier(config) -> str:
    tier = config.getoption("tier")
    if tier == "default" and MARK in (config.option.markexpr or "").replace("-", " ").split():
        return "all"  # `-m full` (or any expression naming it) does the selecting
    return tier


def pytest_configure(config):
    if config.getoption("full_shard") is not None and _tier(config) == "default":
        raise pytest.UsageError("--full-shard K/N slices the full tier: use it with --tier full or --tier all")


def is_full(item) -> bool:
    return item.get_closest_marker(MARK) is not None


def pytest_collection_modifyitems(config, items):
    tier, shard = _tier(config), config.getoption("full_shard")
    keep, drop = [], []
    for item in items:
        full = is_full(item)
        wanted = {"default": not full, "full": full, "all": True}[tier]
        if wanted and full and shard is not None:
            wanted = shard_of(item.nodeid, shard[1]) == shard[0]
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def rerun_command(report) -> str:
    tier = " --tier full" if MARK in getattr(report, "keywords", {}) else ""  # a collection error has none
    return f".venv/bin/python -m pytest{tier} '{report.nodeid}'"


def pytest_terminal_summary(terminalreporter):
    failed = [r for key in ("failed", "error") for r in terminalreporter.stats.get(key, [])
              if getattr(r, "nodeid", None)]
    if not failed:
        return
    terminalreporter.section("rerun a failed test alone")
    for command in dict.fromkeys(rerun_command(r) for r in failed):
        terminalreporter.write_line(command)
