"""The tuning space (pruning, errors) and the search strategies, on synthetic costs."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from conftest import ROOT, tiny_decode

from kgen.errors import KgenUserError
from kgen.spec.models import load_spec
from kgen.tune.search import (
    _neighbours,
    config_key,
    eval_constraint,
    exhaustive,
    expand_space,
    hill_climb,
    parse_buckets,
    resolve_buckets,
    search,
    winners,
)

LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"


def tiny(tuning: dict | None) -> object:
    return tiny_decode("tiny_search", tuning=tuning)


def test_llama_space_is_the_product_of_its_params():
    space = expand_space(load_spec(LLAMA))
    assert space.size == 9 and len(space.configs) == 9 and not space.pruned
    assert space.defaults == {"threads": 128, "partition_size": 64, "stages": 0, "heads_per_thread": 0, "mma_min_group": -1}


def test_constraints_and_template_checks_prune_with_reasons():
    spec = tiny({"params": {"threads": [32, 64, 2048], "partition_size": [0, 24, 32]},
                 "constraints": ["threads >= 32 * group_size"]})
    space = expand_space(spec)
    fixed = {"stages": 0, "heads_per_thread": 0, "mma_min_group": -1}  # the template's parameters the space leaves at their defaults
    assert space.configs == [{"threads": 64, "partition_size": 0, **fixed}, {"threads": 64, "partition_size": 32, **fixed}]
    reasons = {(p["config"]["threads"], p["config"]["partition_size"]): p["reason"] for p in space.pruned}
    assert "threads >= 32 * group_size" in reasons[(32, 0)]
    assert "multiple of 32 in 32..1024" in reasons[(2048, 0)]
    assert "multiple of 16 tokens" in reasons[(64, 24)]


def test_constraint_evaluation_uses_spec_names():
    assert eval_constraint("threads >= 32 * group_size and head_dim % 32 == 0", {"threads": 128, "group_size": 4,
                                                                                 "head_dim": 128})
    assert not eval_constraint("threads // 0 > 1", {"threads": 64})  # division by zero rejects, not crashes
    with pytest.raises(KgenUserError, match="unknown name 'warps'"):
        eval_constraint("warps > 1", {"threads": 64})


def test_no_tuning_section_is_a_clear_error():
    with pytest.raises(KgenUserError, match="nothing to tune"):
        expand_space(tiny(None))


def test_unknown_parameter_is_refused():
    spec = tiny({"params": {"threads": [64], "kv_blocks_per_iter": [1, 2]}})
    with pytest.raises(KgenUserError, match="kv_blocks_per_iter: not a parameter of the paged_decode"):
        expand_space(spec)


def test_constraint_rejecting_everything_is_an_error():
    spec = tiny({"params": {"threads": [64, 128]}, "constraints": ["threads > 1024"]})
    with pytest.raises(KgenUserError, match="every one of the 2 configs"):
        expand_space(spec)


def test_buckets_come_from_flag_then_spec_then_backend():
    spec = tiny({"params": {"threads": [64]}, "buckets": {"batch": [2, 1], "context": [64]}})
    assert resolve_buckets(spec, "cpu") == [(1, 64), (2, 64)]
    assert resolve_buckets(spec, "cpu", {"batch": [3], "context": [5, 7]}) == [(3, 5), (3, 7)]
    plain = tiny({"params": {"threads": [64]}})
    assert len(resolve_buckets(plain, "cuda")) == 16
    assert max(c for _, c in resolve_buckets(plain, "cpu")) <= 1024  # small on the fiber runtime


@pytest.mark.parametrize("text", ["1,8", "1,8x", "ax128", "1x2x3"])
def test_bad_bucket_flags(text):
    with pytest.raises(KgenUserError, match="--buckets"):
        parse_buckets(text)
    assert parse_buckets("1, 8 x 128,1024") == {"batch": [1, 8], "context": [128, 1024]}


def test_zero_bucket_refused():
    with pytest.raises(KgenUserError, match="positive"):
        resolve_buckets(tiny({"params": {"threads": [64]}}), "cpu", {"batch": [0], "context": [16]})


# ---- synthetic space with a known answer

CONFIGS = [{"t": t, "p": p} for t, p in itertools.product(range(8), range(8))]
BUCKETS = [(b, c) for b in (1, 8, 64, 256) for c in (128, 1024, 8192, 32768)]


def synthetic_cost(config: dict, bucket) -> float:
    """Separable bowl: the best t grows with batch, the best p with context; plus a few broken configs."""
    if config["t"] == 7 and config["p"] == 0:
        return math.inf  # e.g. a config that failed to compile
    bt = math.log2(bucket[0]) * 7 / 8
    bp = math.log2(bucket[1] / 128) * 7 / 8
    return bucket[0] * bucket[1] * (1 + (config["t"] - bt) ** 2) * (1 + 0.5 * (config["p"] - bp) ** 2)


def counting(cost):
    calls = []

    def evaluate(pairs):
        calls.extend(pairs)
        return [cost(c, b) for c, b in pairs]

    return evaluate, calls


def test_hill_climb_finds_the_exhaustive_optimum_with_fewer_measurements():
    ev, full_calls = counting(synthetic_cost)
    truth = winners(exhaustive(CONFIGS, BUCKETS, ev), BUCKETS)
    assert len(set(truth.values())) >= 8  # the optimum moves with the bucket: no single answer
    ev, calls = counting(synthetic_cost)
    measured = hill_climb(CONFIGS, BUCKETS, ev, max_evals=len(full_calls) // 2, start={"t": 3, "p": 3})
    assert winners(measured, BUCKETS) == truth
    assert len(calls) <= len(full_calls) // 2
    assert len({(config_key(c), b) for c, b in calls}) == len(calls)  # nothing measured twice


def test_hill_climb_beats_random_sampling_with_the_same_count():
    ev, _ = counting(synthetic_cost)
    truth = winners(exhaustive(CONFIGS, BUCKETS, ev), BUCKETS)
    ev, calls = counting(synthetic_cost)
    climbed = hill_climb(CONFIGS, BUCKETS, ev, 512, start={"t": 0, "p": 0})
    halving_hits = sum(w == truth[b] for b, w in winners(climbed, BUCKETS).items())
    pairs = [(c, b) for c in CONFIGS for b in BUCKETS]
    random_hits = []
    for seed in range(20):
        sample = random.Random(seed).sample(pairs, len(calls))
        measured = {(config_key(c), b): synthetic_cost(c, b) for c, b in sample}
        random_hits.append(sum(w == truth[b] for b, w in winners(measured, BUCKETS).items()))
    assert halving_hits == len(BUCKETS)
    assert max(random_hits) < len(BUCKETS)


def test_auto_picks_exhaustive_when_it_fits():
    ev, calls = counting(synthetic_cost)
    used, _ = search("auto", CONFIGS[:4], BUCKETS[:2], ev, max_evals=100)
    assert used == "exhaustive" and len(calls) == 8
    used, _ = search("auto", CONFIGS, BUCKETS, counting(synthetic_cost)[0], max_evals=100)
    assert used == "hillclimb"
    with pytest.raises(KgenUserError, match="strategy"):
        search("random", CONFIGS, BUCKETS, ev, 10)


def test_hill_climb_stops_within_the_budget():
    ev, calls = counting(synthetic_cost)
    hill_climb(CONFIGS, BUCKETS, ev, max_evals=40)
    assert len(BUCKETS) <= len(calls) <= 40


def test_neighbours_skip_pruned_holes():
    keys = [config_key(c) for c in CONFIGS if c["t"] != 4]  # t=4 pruned everywhere
    near = _neighbours(config_key({"t": 3, "p": 0}), keys)
    assert sorted(dict(k)["t"] for k in near if dict(k)["p"] == 0) == [2, 5]


def test_winner_is_none_where_every_config_failed():
    measured = {(config_key({"t": 1}), (1, 1)): math.inf, (config_key({"t": 1}), (2, 2)): 3.0}
    assert winners(measured, [(1, 1), (2, 2)]) == {(1, 1): None, (2, 2): config_key({"t": 1})}
