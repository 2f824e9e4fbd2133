"""Judging a large case on a sample (kgen/verify/judge/sample.py, docs/verification.md 3.2): the
reference of the sampled units is the full reference's, every sequence is sampled, the judge
ignores only the unsampled rows' values, and every row is still checked for NaN, a pre-fill left in
place and values no attention can produce. Numpy only, no kernel runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kgen
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.reference import attention_reference, value_hull
from kgen.families.attention.serving import Serving, prefill_output
from kgen.verify.judge.bounds import check_output
from kgen.verify.judge.report import CaseResult
from kgen.verify.judge.sample import (
    REF_BUDGET,
    check_every_row,
    draw_units,
    per_query_head,
)

SPECS = Path(__file__).parents[2] / "specs"


@pytest.fixture(scope="module")
def spec():
    return kgen.load_spec(SPECS / "llama3_8b_decode.yaml")


@pytest.fixture(scope="module")
def case(spec):
    rng = np.random.default_rng(5)
    lens = [int(n) for n in rng.integers(1, 400, size=24)]
    args = make_decode_case(spec, lens, rng, serving=Serving(fill="stale", q_dist="outliers"))
    return lens, args, attention_reference(spec, args["q"], args)


def test_every_sequence_is_sampled_and_the_share_follows_the_budget():
    rng = np.random.default_rng(0)
    row_seq = np.repeat(np.arange(50), 3)  # 50 sequences of 3 rows
    units = draw_units(rng, row_seq, np.full(row_seq.size, 2000), num_kv_heads=8, group=4)
    for s in range(50):
        assert units[row_seq == s].any()
    cost = row_seq.size * 2000 * 8 * 4
    assert units.mean() == pytest.approx(REF_BUDGET / cost, abs=0.05)
    small = draw_units(rng, np.arange(4), np.full(4, 10), num_kv_heads=8, group=4)
    assert small.all()  # a case within the budget is judged whole


def test_the_reference_of_a_sample_is_the_full_references_there(spec, case):
    lens, args, full = case
    units = draw_units(np.random.default_rng(1), np.arange(len(lens)), lens, 8, 4, budget=20000)
    assert 0 < units.sum() < units.size
    part = attention_reference(spec, args["q"], args, units=units)
    judged = per_query_head(units, spec.group_size)
    np.testing.assert_array_equal(part.out[judged], full.out[judged])
    np.testing.assert_array_equal(part.lse[judged], full.lse[judged])
    assert (part.out[~judged] == 0).all() and np.isneginf(part.lse[~judged]).all()  # not computed


def test_the_judge_sees_the_sample_and_nan_anywhere(spec, case):
    lens, args, ref = case
    units = draw_units(np.random.default_rng(2), np.arange(len(lens)), lens, 8, 4, budget=20000)
    judged = per_query_head(units, spec.group_size)
    out = ref.out.copy()
    r, h = (int(i) for i in np.argwhere(~judged)[0])
    out[r, h] += 1.0  # wrong where nothing is sampled: the bound cannot see it
    assert check_output("c", lens, out, ref.out, ref.out, "fp16", judged=judged).passed
    out[r, h, 0] = np.nan  # NaN is seen in every row
    assert not check_output("c", lens, out, ref.out, ref.out, "fp16", judged=judged).passed
    r, h = (int(i) for i in np.argwhere(judged)[0])
    out = ref.out.copy()
    out[r, h] += 1.0
    assert not check_output("c", lens, out, ref.out, ref.out, "fp16", judged=judged).passed


def _row_check(spec, args, out, before):
    lo, hi = value_hull(spec, args)
    result = CaseResult("c", [], 0.0, 0.0, True)
    return check_every_row(result, "out", out, before, np.arange(out.shape[0]), lo, hi, spec.group_size,
                           ("fp16", "fp16"))


def test_every_row_is_checked_for_nan_prefill_and_impossible_values(spec, case):
    lens, args, ref = case
    rng = np.random.default_rng(3)
    before = prefill_output(ref.out.shape, np.float16, rng)
    good = ref.out.astype(np.float16)
    assert _row_check(spec, args, good, before).passed  # the true output lies within its V values
    stale = np.argwhere(np.isfinite(before.astype(np.float32)).all(axis=-1) & (before != 0).any(axis=-1))[0]
    for why, edit in (("never written", lambda o: o.__setitem__(tuple(stale), before[tuple(stale)])),
                      ("NaN", lambda o: o.__setitem__((3, 5, 7), np.nan)),
                      ("outside the range", lambda o: o.__setitem__((4, 2, 9), 1e3))):
        out = good.copy()
        edit(out)
        result = _row_check(spec, args, out, before)
        assert not result.passed and why in result.note, (why, result.note)
