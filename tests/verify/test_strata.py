"""The joint shapes of serving batches (kgen/families/attention/strata.py, docs/verification.md 3.2):
a fixed design whose every stratum is a case of every run, so no seed can miss a (feature, stratum)
cell. Inputs only, and cheap: the corpus's cheat_wrong_large_and_long / cheat_wrong_all_long
(tests/verify/corpus, full tier) are the whole-run claims; here, each cheat's condition holds in some
case of every seed and fails in every case of the matrix before the strata (the classic, adversarial
and serving cases that remain)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kgen
from kgen.families.attention import decode_cases, prefill_cases
from kgen.families.attention.serving import PREFILL_BATCH
from kgen.families.attention.strata import (
    ALL_LONG,
    LARGE,
    LONG,
    VERY_LONG,
    coverage,
    required_cells,
    shape_table,
)

SPECS = Path(__file__).parents[2] / "specs"
STRATA = {"serving_large_long", "serving_long_small", "serving_one_long", "serving_one_short"}
# decode and prefill, block sizes 16 and 32, tail masking off (every length a multiple of the block)
SPEC_NAMES = ("llama3_8b_decode", "llama3_8b_prefill", "bf16_decode_b32", "decode_vllm_layout")


def _cases(spec, seed):
    module = prefill_cases if spec.kind == "paged_prefill" else decode_cases
    return module.matrix_cases(spec, {"partition_size": 0}, np.random.default_rng(seed))


def _serving(cases):
    return [(c.name, c.params["seq_lens"], c.params["serving"]) for c in cases if c.name.startswith("serving_")]


def _large_and_long(lens):  # cheat_wrong_large_and_long's condition
    return len(lens) >= LARGE and max(lens) >= VERY_LONG


def _all_long(lens):  # cheat_wrong_all_long's condition
    return len(lens) >= 2 and min(lens) >= ALL_LONG


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_every_seed_covers_every_feature_with_long_contexts_and_large_batches(name):
    spec = kgen.load_spec(SPECS / f"{name}.yaml")
    need = required_cells(spec.tail_masking)
    for seed in range(12):
        cells = coverage(_serving(_cases(spec, seed)), spec.kv_cache.block_size)
        missing = need - set(cells)
        assert not missing, f"{name}, seed {seed}: no case holds {sorted(missing)}"
        strata_only = coverage([c for c in _serving(_cases(spec, seed)) if c[0] in STRATA], spec.kv_cache.block_size)
        # the strata alone hold every feature on a long context: not left to the other cases' draws
        assert {c for c in need if c.endswith("@long")} <= set(strata_only), name


@pytest.mark.parametrize("name", ("llama3_8b_decode", "llama3_8b_prefill"))
def test_every_seed_shows_the_joint_shapes(name):
    spec = kgen.load_spec(SPECS / f"{name}.yaml")
    for seed in range(12):
        cases = {c.name: c.params for c in _cases(spec, seed)}
        lens = {n: p["seq_lens"] for n, p in cases.items()}
        assert STRATA <= set(cases)
        assert len(lens["serving_large_long"]) >= LARGE and _all_long(lens["serving_large_long"])
        assert sum(n >= LONG for n in lens["serving_large_long"]) >= 4
        assert _all_long(lens["serving_long_small"]) and len(lens["serving_long_small"]) < LARGE
        one = sorted(lens["serving_one_long"])  # one very long among many short
        assert len(one) >= 16 and one[-1] >= VERY_LONG and one[-2] < 256 and _large_and_long(one)
        rev = sorted(lens["serving_one_short"])  # the reverse: one short among long ones
        assert rev[0] < 256 and rev[1] >= ALL_LONG
        assert all(cases[n]["sample"] for n in STRATA)  # judged on a sample of rows
        if spec.kind == "paged_prefill":
            assert PREFILL_BATCH[0] <= len(lens["serving_batch"]) <= PREFILL_BATCH[1] and PREFILL_BATCH[0] >= 128
            assert 24 <= cases["serving_steps"]["steps"] <= 40
            for n in STRATA:
                assert all(q <= s for q, s in zip(cases[n]["q_lens"], lens[n], strict=True))


@pytest.mark.parametrize("name", ("llama3_8b_decode", "llama3_8b_prefill"))
def test_the_cases_without_the_strata_never_show_what_the_cheats_wait_for(name):
    """Why the corpus's two cheats passed before: no other case meets their conditions, whatever the seed."""
    spec = kgen.load_spec(SPECS / f"{name}.yaml")
    for seed in range(40):
        for c in _cases(spec, seed):
            if c.name not in STRATA:
                lens = c.params["seq_lens"]
                assert not _large_and_long(lens) and not _all_long(lens), (seed, c.name)


def test_the_shape_table_has_long_sequences_in_large_batches():
    spec = kgen.load_spec(SPECS / "llama3_8b_decode.yaml")
    table = shape_table([(c.name, c.params["seq_lens"]) for c in _cases(spec, 0)])
    assert "serving_large_long" in table[("10-63", "1024-4095")] and "serving_large_long" in table[("10-63", "256-1023")]
    assert "serving_one_long" in table[("10-63", "1-255")] and "serving_one_long" in table[("10-63", "4096+")]
    assert "serving_long_small" in table[("2-9", "256-1023")] | table.get(("2-9", "1024-4095"), set())
