"""benchmarks/code_census.py: lines per body and per shared part, and repeated runs of six or more
code lines, counted by the script itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.code_census import body_functions, census, code_lines, repeated_runs

ROOT = Path(__file__).resolve().parents[2]
BLOCK = [f"  acc{i} += x[{i}] * w[{i}];" for i in range(7)]


def _source(block: list[str], before: int) -> str:
    """A C++ text: `before` unique lines, then `block` with a comment and a blank line inside it."""
    head = [f"int unique_{before}_{i} = {i};" for i in range(before)]
    return "\n".join([*head, *block[:3], "  // a comment inside", "", *block[3:], "}"]) + "\n"


def test_a_block_written_twice_is_two_runs_with_its_source_lines():
    files = {"a.cuh": _source(BLOCK, 2), "b.cuh": _source(BLOCK, 5), "c.cuh": "int only_here = 1;\n" * 3}
    runs = sorted(repeated_runs(files), key=lambda r: r.path)
    assert [(r.path, r.first, r.last, r.lines) for r in runs] == [("a.cuh", 3, 11, 7), ("b.cuh", 6, 14, 7)]


def test_runs_shorter_than_the_minimum_and_prose_do_not_count():
    five = BLOCK[:5]
    assert repeated_runs({"a.cuh": _source(five, 1), "b.cuh": _source(five, 4)}) == []
    assert len(repeated_runs({"a.cuh": _source(five, 1), "b.cuh": _source(five, 4)}, min_lines=5)) == 2
    prose = "\n".join(f"// the same comment, line {i}" for i in range(10)) + '\n#include "kgen/x.cuh"\n'
    assert repeated_runs({"a.cuh": prose, "b.cuh": prose}) == []
    doc = '"""\n' + "\n".join(f"same docstring line {i}" for i in range(10)) + '\n"""\nx = 1\n'
    assert code_lines(doc, python=True) == [(13, "x = 1")]
    names = "from kgen.x import (\n" + "".join(f"    name_{i},\n" for i in range(8)) + ")\ny = 2\n"
    assert code_lines(names, python=True) == [(11, "y = 2")]


def test_body_functions_measure_definitions_not_calls():
    text = ("template <class Cfg>\n__device__ void paged_x_body(const Params& p) {\n  if (p.n) {\n    go();\n  }\n}\n"
            "__global__ void k(Params p) { paged_x_body<Cfg>(p); paged_y_body(p); }\n")
    assert body_functions(text) == {"paged_x_body": 5}


def test_the_census_lists_every_body_and_part_with_its_lines():
    c = census()
    bodies = sorted(ROOT.glob("templates/common/paged_*.cuh"))
    parts = sorted(ROOT.glob("templates/common/attention/*.cuh"))
    assert list(c["bodies"]) == [str(p.relative_to(ROOT)) for p in bodies]
    assert list(c["parts"]) == [str(p.relative_to(ROOT)) for p in parts]
    for p in bodies + parts:
        row = {**c["bodies"], **c["parts"]}[str(p.relative_to(ROOT))]
        assert row["lines"] == len(p.read_text().splitlines()) > row["code_lines"] > 0
    assert "paged_decode_body" in c["bodies"]["templates/common/paged_decode.cuh"]["bodies"]
    assert set(c["repeats"]) == {"templates/", "kgen/"}


def test_the_script_prints_the_census():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_census.py"), "--most", "2"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT)}).stdout
    assert "templates/common/paged_decode.cuh" in out and "repeated runs of 6+ code lines in kgen/" in out
