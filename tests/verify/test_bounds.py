"""The derived bound, one per (sequence, head) row (kgen/verify/judge/bounds.py)."""

from __future__ import annotations

import numpy as np

from kgen.verify.judge.bounds import (
    EPS_FP32,
    check_lse,
    check_output,
    lse_floor,
    row_floor,
)


def test_floor_grows_with_the_length_and_the_logits_and_is_per_row():
    ref = np.ones((2, 3, 16))
    ref[1] *= 1e-3
    short = row_floor(ref, "fp32", [1, 1])
    long = row_floor(ref, "fp32", [10_000, 10_000])
    assert np.all(long > 5 * short)  # 64 + 4 sqrt(L) units of eps32
    assert short[1, 0] < 1e-2 * short[0, 0]  # a small row keeps a small floor
    logits = row_floor(ref, "fp32", [1, 1], magnitude=np.ones((2, 3)), logit_magnitude=np.full((2, 3), 500.0))
    assert np.all(logits > row_floor(ref, "fp32", [1, 1], magnitude=np.ones((2, 3))))
    assert np.all(lse_floor(np.full((1, 2), 600.0), [1]) >= 64 * EPS_FP32 * 600)


def test_lse_checked_per_row():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((3, 4)) * 5
    lowp = ref + 1e-5 * rng.standard_normal(ref.shape)
    ok = check_lse("l", [10, 20, 30], ref + 1e-6, ref, lowp)
    assert ok.passed
    bad = ref.copy()
    bad[2, 1] += 1e-3
    r = check_lse("l", [10, 20, 30], bad, ref, lowp)
    assert not r.passed and (r.first_failure["sequence"], r.first_failure["head"]) == (2, 1)
    assert r.first_failure["length"] == 30 and r.first_failure["dim"] is None
    bad[0, 0] = np.nan
    r = check_lse("l", [10, 20, 30], bad, ref, lowp)
    assert not r.passed and r.nan_count == 1


def test_reported_error_and_bound_are_the_worst_rows():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((2, 2, 8))
    lowp = ref + 1e-3 * rng.standard_normal(ref.shape)
    got = ref.copy()
    got[1, 0, 3] += 0.5
    r = check_output("w", [5, 5], got, ref, lowp, "fp16")
    assert not r.passed and np.isclose(r.max_error, 0.5)
    assert r.bound == r.first_failure["bound"] and r.first_failure["rows_failed"] == 1
