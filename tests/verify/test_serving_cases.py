"""The serving look of the attention cases (kgen/families/attention/serving.py, docs/verification.md 3.1):
nothing in a case marks it as a test. Inputs only, no kernel runs (the corpus's cheat_* kernels,
tests/verify/test_corpus.py, check that the look catches kernels that cheat while watched)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgen import load_spec
from kgen.families.attention import decode_cases, prefill_cases
from kgen.families.attention.decode_cases import (
    _case_inputs,
    _outputs,
    make_decode_case,
)
from kgen.families.attention.prefill_cases import make_prefill_case
from kgen.families.attention.reference import attention_reference
from kgen.families.attention.serving import (
    FILLS,
    MAX_BATCH,
    PADDINGS,
    Q_DISTS,
    Serving,
    prefix_groups,
)

SPECS = __import__("pathlib").Path(__file__).parents[2] / "specs"


@pytest.fixture(scope="module")
def decode_spec():
    return load_spec(SPECS / "llama3_8b_decode.yaml")


@pytest.fixture(scope="module")
def prefill_spec():
    return load_spec(SPECS / "llama3_8b_prefill.yaml")


def _decode(spec, seed):
    return {c.name: c for c in decode_cases.matrix_cases(spec, {"partition_size": 0}, np.random.default_rng(seed))}


def _prefill(spec, seed):
    return {c.name: c for c in prefill_cases.matrix_cases(spec, {"partition_size": 0}, np.random.default_rng(seed))}


def _ways(serving: Serving) -> int:
    return max((len(m) for m, _ in serving.groups), default=1)


def test_decode_keeps_every_classic_name_and_adds_the_serving_cases(decode_spec):
    cases = _decode(decode_spec, 1)
    assert {"len_1", "len_B-1", "len_B", "len_B+1", "len_2B+1", "long", "mixed_batch", "shared_prefix",
            "padded_pool", "strided_q_out", "large_logits", "long_uniform", "long_32k", "huge_pool"} <= set(cases)
    assert {"serving_batch", "serving_small", "serving_prefix_tree", "serving_steps"} <= set(cases)


@pytest.mark.parametrize("seed", range(8))
def test_decode_serving_cases_vary_what_a_test_used_to_fix(decode_spec, seed):
    cases = _decode(decode_spec, seed)
    batch = cases["serving_batch"].params
    assert 10 <= len(batch["seq_lens"]) <= MAX_BATCH  # past the old menu's 9 sequences
    assert _ways(batch["serving"]) >= 3 and _ways(cases["serving_prefix_tree"].params["serving"]) >= 4
    assert 2 <= len(cases["serving_small"].params["seq_lens"]) <= 9
    assert 24 <= cases["serving_steps"].params["steps"] <= 40  # launches past any small fixed count
    looks = [c.params["serving"] for n, c in cases.items() if n.startswith("serving_")]
    assert {s.fill for s in looks} == set(FILLS)  # every filler, padding and query distribution each run
    assert {s.padding for s in looks} == set(PADDINGS)
    assert {s.q_dist for s in looks} == set(Q_DISTS)
    assert "zero" in (batch["serving"].padding, cases["serving_prefix_tree"].params["serving"].padding)
    classic = [c.params["serving"] for c in cases.values() if "serving" in c.params]
    assert len({s.spare_cols for s in classic}) > 1  # not always one spare table column


def test_the_largest_batch_is_drawn_sometimes(decode_spec):
    sizes = {len(_decode(decode_spec, seed)["serving_batch"].params["seq_lens"]) for seed in range(16)}
    assert MAX_BATCH in sizes and min(sizes) < MAX_BATCH


def test_a_seed_replays_its_case_exactly(decode_spec):
    a, b = _decode(decode_spec, 7)["serving_batch"], _decode(decode_spec, 7)["serving_batch"]
    x = _case_inputs(decode_spec, a, np.random.default_rng(3))[0]
    y = _case_inputs(decode_spec, b, np.random.default_rng(3))[0]
    for name in x:
        np.testing.assert_array_equal(x[name], y[name])
    other = _decode(decode_spec, 8)["serving_batch"].params["seq_lens"]
    assert other != a.params["seq_lens"]


@pytest.mark.parametrize("fill", FILLS)
def test_unread_slots_hold_the_cases_filler_and_the_reference_ignores_them(decode_spec, fill):
    rng = np.random.default_rng(4)
    lens = [5, 37, 16, 70]
    serving = Serving(fill=fill, padding="zero", spare_cols=3, pool_spare=0.5, q_dist="normal")
    args = make_decode_case(decode_spec, lens, rng, serving=serving)
    B = decode_spec.kv_cache.block_size
    k = args["k_cache"].astype(np.float32)
    tails = [k[args["block_tables"][i, n // B], n % B:] for i, n in enumerate(lens) if n % B]
    nan_share = np.mean([np.isnan(t).all() for t in tails])
    if fill == "nan":
        assert nan_share == 1.0
    elif fill in ("stale", "plausible"):
        assert nan_share == 0.0 and all(np.isfinite(t).all() for t in tails)
    assert (args["block_tables"][:, -3:] == 0).all()  # zero padding in the spare columns
    ref = attention_reference(decode_spec, args["q"], args)
    assert np.isfinite(ref.out).all()


def test_prefix_groups_share_full_blocks_three_ways_and_more(decode_spec):
    rng = np.random.default_rng(2)
    lens = [int(n) for n in rng.integers(1, 200, size=20)]
    groups = prefix_groups(rng, lens, 16, 3)
    args = make_decode_case(decode_spec, lens, rng, serving=Serving(groups=groups, fill="mixed"))
    members, blocks = groups[0]
    assert len(members) >= 3
    first = args["block_tables"][members, :blocks]
    assert (first == first[0]).all()


def test_queries_and_outputs_look_like_serving(decode_spec):
    cases = _decode(decode_spec, 3)
    rng = np.random.default_rng(0)
    big = 0.0
    for name in ("serving_batch", "serving_small", "serving_prefix_tree", "serving_steps"):
        args, _ = _case_inputs(decode_spec, cases[name], rng)
        big = max(big, float(np.abs(args["q"].astype(np.float32)).max()))
    assert big > 8.0
    args, _ = _case_inputs(decode_spec, cases["mixed_batch"], rng)
    outs = {g.name: g.view.astype(np.float32) for g in _outputs(decode_spec, cases["mixed_batch"], args, None, rng)}
    for name in ("out", "lse"):
        x = outs[name]
        assert np.isnan(x).any() and (x == 0).any() and (np.isfinite(x) & (x != 0)).any(), name


@pytest.mark.parametrize("seed", range(6))
def test_prefill_serving_cases(prefill_spec, seed):
    cases = _prefill(prefill_spec, seed)
    assert {"chunk_1", "chunk_150", "mixed_batch", "shared_prefix", "padded_pool", "decode_equivalence",
            "serving_batch", "serving_long_chunk"} <= set(cases)
    batch = cases["serving_batch"].params
    assert len(batch["seq_lens"]) > 10 and _ways(batch["serving"]) >= 3
    long = cases["serving_long_chunk"].params
    assert max(long["q_lens"]) >= 256 and 1 in long["q_lens"]  # a long chunk in one launch with decode rows
    for p in (batch, long):
        assert all(q <= n for q, n in zip(p["q_lens"], p["seq_lens"], strict=True))


def test_prefill_out_is_prefilled_with_a_mix(prefill_spec):
    rng = np.random.default_rng(1)
    args = make_prefill_case(prefill_spec, [40, 30, 20], [40, 1, 5], rng, serving=Serving(fill="mixed"))
    out = args["out"].astype(np.float32)
    assert np.isnan(out).any() and (out == 0).any()
    assert math.isfinite(float(np.nanmax(np.abs(out))))
