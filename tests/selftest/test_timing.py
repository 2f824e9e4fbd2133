"""kgen/selftest/timing.py's verdict over measured rows and its removal of CPU wall-clock times."""

from __future__ import annotations

import math

from kgen.selftest.outcome import Outcome
from kgen.selftest.timing import SDPA_SANITY, judge, untimed


def test_judge_fails_a_kgen_failure_a_disagreement_and_nan():
    good = {"spec": "s", "path": "p", "max_abs_kgen_vs_sdpa": SDPA_SANITY / 2}
    assert judge(Outcome(), [good]).status == "passed"
    assert judge(Outcome(), [dict(good, max_abs_kgen_vs_sdpa=SDPA_SANITY * 2)]).status == "failed"
    nan = judge(Outcome(), [dict(good, max_abs_kgen_vs_sdpa=math.nan)])
    assert nan.status == "failed" and "nan" in nan.reason
    broken = judge(Outcome(), [good, {"spec": "s", "path": "p", "skipped": "kgen failed: RuntimeError: x"}])
    assert broken.status == "failed" and "kgen failed" in broken.reason
    budget = judge(Outcome(), [good, {"spec": "s", "path": "all", "skipped": "the step's time budget is spent"}])
    assert budget.status == "passed"  # shapes the budget did not reach are listed, not failed


def test_untimed_drops_every_time_and_keeps_the_rest():
    row = {"spec": "s", "kgen_s": 1.0, "kgen_host_s": 1.0, "sdpa_s": 2.0, "flashinfer_fa2_s": 3.0, "copy_bw": 1e9,
           "flashinfer": "not importable", "max_abs_kgen_vs_sdpa": 1e-3}
    assert untimed(row) == {"spec": "s", "flashinfer": "not importable", "max_abs_kgen_vs_sdpa": 1e-3}
