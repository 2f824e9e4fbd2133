"""The README's Python block runs as written: extracted from README.md, executed in a fresh
process from the repository root (the paths in it are relative to it)."""

from __future__ import annotations

import re

from conftest import ROOT, run_python


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)


def test_readme_python_example_runs_as_written():
    blocks = python_blocks()
    assert len(blocks) == 1, f"expected the README's one Python example, found {len(blocks)} python blocks"
    r = run_python(blocks[0], cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"llama3_8b_decode: verified (\d+)/\1 cases on cpu", r.stdout), r.stdout
    assert re.search(r"\(2, 32, 128\) float16 max \|out - numpy\|: [0-9.e-]+\n", r.stdout), r.stdout
