"""kgen/selftest/steps.py: the GPU budgets fit the 8-minute run, and docs/selftest.md states the same."""

from __future__ import annotations

import re
from pathlib import Path

from kgen.selftest.steps import GPU_TOTAL_S, STEPS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "selftest.md").read_text()


def test_budgets_fit_eight_minutes_and_every_step_has_both():
    assert GPU_TOTAL_S == 8 * 60 and sum(s.gpu_budget_s for s in STEPS) <= GPU_TOTAL_S
    assert all(s.gpu_budget_s > 0 and s.cpu_budget_s > 0 for s in STEPS)
    assert STEPS[0].name == "environment" and len({s.name for s in STEPS}) == len(STEPS)


def test_the_documented_budgets_are_the_code_s():
    documented = dict(re.findall(r"^\| ([\w-]+) \| .* \| (\d+) s \|$", DOC, re.M))
    assert {name: int(s) for name, s in documented.items()} == {s.name: s.gpu_budget_s for s in STEPS}
