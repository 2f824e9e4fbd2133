"""Where the test suite's time goes, from pytest's JUnit XML (`pytest --junitxml=FILE`): per test file
and the slowest tests, as the markdown tables of docs/testing.md.

    python .ci/suite_times.py AFTER.xml                 # one run
    python .ci/suite_times.py BEFORE.xml AFTER.xml      # two runs side by side (per file)
    python .ci/suite_times.py RUN.xml --slowest 50      # how many of the slowest tests to list

A test's time is its setup, call and teardown (a module fixture's cost lands on the module's first test).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_times(path: Path) -> dict[str, float]:
    """{test id: seconds} of one JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"{path}: not a JUnit XML file pytest wrote ({e})") from None
    times = {}
    for case in root.iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/")
        times[f"{module}.py::{case.get('name')}"] = float(case.get("time") or 0.0)
    return times


def per_file(times: dict[str, float]) -> dict[str, tuple[int, float]]:
    files: dict[str, list[float]] = defaultdict(list)
    for test, seconds in times.items():
        files[test.split("::", 1)[0]].append(seconds)
    return {f: (len(s), sum(s)) for f, s in files.items()}


def file_table(runs: list[dict[str, float]]) -> list[str]:
    tables = [per_file(r) for r in runs]
    heads = ["tests, s"] if len(runs) == 1 else ["before: tests, s", "after: tests, s"]
    lines = ["| file | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    files = sorted(set().union(*tables), key=lambda f: -max(t.get(f, (0, 0.0))[1] for t in tables))
    for f in files:
        cells = [f"{t[f][0]}, {t[f][1]:.1f}" if f in t else "-" for t in tables]
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    totals = [f"{len(r)}, {sum(r.values()):.0f}" for r in runs]
    lines.append("| **all** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    return lines


def slowest_table(times: dict[str, float], n: int) -> list[str]:
    lines = ["| s | test |", "|---:|---|"]
    for test, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:n]:
        lines.append(f"| {seconds:.1f} | `{test}` |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="one or two JUnit XML files (before, after)")
    parser.add_argument("--slowest", type=int, default=50, help="how many of the slowest tests to list (default 50)")
    args = parser.parse_args(argv)
    if len(args.runs) > 2:
        parser.error("give one run, or two (before and after)")
    runs = [test_times(p) for p in args.runs]
    print("\n".join([*file_table(runs), "", f"The {args.slowest} slowest tests of {args.runs[-1].name}:", "",
                     *slowest_table(runs[-1], args.slowest)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
