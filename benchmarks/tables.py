"""The benchmark tables: Markdown tables, their cells, and writing them between a page's markers."""

from __future__ import annotations

import math
from pathlib import Path

from kgen.perf.model import Estimate
from kgen.perf.prefill_model import PrefillEstimate


def md_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def fmt_pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def fmt_cell(e: Estimate | None) -> str:
    """A table cell: fraction of the copy bandwidth and the binding term, e.g. `77% (issue)`."""
    return "n/a" if e is None else f"{fmt_pct(e.fraction)} ({e.bound})"


def fmt_tflops(e: PrefillEstimate | None) -> str:
    return "n/a" if e is None else f"{e.tflops / 1e12:.0f} ({100 * e.fraction:.0f}%, {e.bound})"


def replace_between(path: Path, text: str, begin: str, end: str) -> None:
    """Write `text` between the markers `begin` and `end` of the page at `path` (each benchmark its own)."""
    old = path.read_text() if path.exists() else f"# Performance\n\n{begin}\n{end}\n"
    if begin not in old or end not in old:
        raise SystemExit(f"{path}: no {begin} ... {end} markers to replace")
    head, rest = old.split(begin, 1)
    path.write_text(head + f"{begin}\n{text}{end}" + rest.split(end, 1)[1])
