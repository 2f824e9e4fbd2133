"""The derived bound, one per (sequence, head) row (kgen/verify/judge/bounds.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.spec.models import spec_from_dict
from kgen.verify.judge.bounds import (
    EPS_FP32,
    check_lse,
    check_output,
    head_dims,
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
    logits = row_floor(ref, "fp32", [1, 1], magnitude=np.ones((2, 3)), logit_magnitude=np.full((2, 3), 500.0),
                       head_dim=16)
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


def _logit_floor(width: int, head_dim: int) -> np.ndarray:
    """row_floor of an output `width` wide whose rows all have the same magnitudes and logits."""
    ref = np.ones((2, 3, width))
    return row_floor(ref, "fp32", [7, 7], magnitude=np.ones((2, 3)), logit_magnitude=np.full((2, 3), 300.0),
                     head_dim=head_dim, v_head_dim=width)


def test_logit_term_scales_with_head_dim_not_the_output_width():
    # q . k runs over head_dim; the output is v_head_dim wide. Same head_dim, different output widths:
    # the same floor (the old bound took the output's width as the dot-product length).
    np.testing.assert_array_equal(_logit_floor(64, head_dim=256), _logit_floor(256, head_dim=256))
    np.testing.assert_array_equal(_logit_floor(192, head_dim=128), _logit_floor(128, head_dim=128))
    # and a longer dot product gets a larger floor at one output width
    assert np.all(_logit_floor(128, head_dim=192) > _logit_floor(128, head_dim=128))
    lse = np.full((2, 3), 5.0)
    assert np.all(lse_floor(lse, [7], np.full((2, 3), 300.0), head_dim=192)
                  > lse_floor(lse, [7], np.full((2, 3), 300.0), head_dim=64))


def test_bounds_refuse_a_missing_head_dim_and_a_wrong_width():
    ref = np.ones((1, 2, 128))
    with pytest.raises(ValueError, match="head_dim: the logit error term needs"):
        row_floor(ref, "fp16", [3], magnitude=np.ones((1, 2)), logit_magnitude=np.ones((1, 2)))
    with pytest.raises(ValueError, match="head_dim: the logit error term needs"):
        lse_floor(np.zeros((1, 2)), [3], np.ones((1, 2)))
    with pytest.raises(ValueError, match="v_head_dim: the reference output's last axis is 128, not"):
        check_output("o", [3], ref, ref, ref, "fp16", v_head_dim=192)


def test_head_dims_of_a_spec():
    data = {"kgen": 1, "name": "d", "kind": "paged_decode",
            "attention": {"num_q_heads": 2, "num_kv_heads": 2, "head_dim": 192, "v_head_dim": 128},
            "kv_cache": {"block_size": 16, "layout": "separate", "dtype": "bf16"}, "dtype": {"q": "bf16"},
            "tail_masking": True}
    assert head_dims(spec_from_dict(data)) == {"head_dim": 192, "v_head_dim": 128}
    del data["attention"]["v_head_dim"]
    assert head_dims(spec_from_dict(data)) == {"head_dim": 192, "v_head_dim": 192}
