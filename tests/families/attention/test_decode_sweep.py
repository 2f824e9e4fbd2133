"""A covering sweep of the decode kernel on the CPU backend: every value of every axis
appears, and every pair of the risky axes is covered (kv dtype x layout, element width x
head_dim, layout x block size, quantized dtype x scale, scale x layout, q dtype x kv dtype),
instead of the full cross product. The design is built greedily (AETG-style) with a fixed
seed, preferring cheap rows. Its coverage is tested on what actually runs: the pairs are
read back from the specs and configs the rows build, against the required pairs spelled
out as cross products of the axes (not from the builder's own bookkeeping).
The default tier runs the rows that together exercise every value of every axis but the GQA group
size (default_tier_rows, checked below); the full tier runs every row, which makes the pairwise claim."""

from __future__ import annotations

import itertools
import random

import pytest

import kgen
from kgen.formats.dtypes import dtype
from kgen.spec.models import QUANTIZED_KV_DTYPES

KV = ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"]
LAYOUTS = ["separate/NHD", "separate/HND", "fused/NHD", "fused/HND", "vllm"]
GROUPS = list(range(1, 17))
BLOCKS = [1, 8, 16, 32, 128, 256]
HEAD_DIMS = [32, 64, 80, 96, 112, 128, 192, 256, 512]
Q = ["fp16", "bf16", "fp32"]
SCALES = ["per_tensor", "per_head", "per_token_head"]
AXES = {"kv": KV, "layout": LAYOUTS, "group": GROUPS, "kv_heads": [1, 2], "block": BLOCKS,
        "head_dim": HEAD_DIMS, "q": Q, "scale": SCALES, "split": [False, True]}
WIDTH = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


def _pairs(row: dict) -> set[tuple]:
    """The required pairs a row covers (the scale axis only counts for quantized caches)."""
    quant = WIDTH[row["kv"]] == 1
    out = {("kv-layout", row["kv"], row["layout"]), ("width-hd", WIDTH[row["kv"]], row["head_dim"]),
           ("layout-block", row["layout"], row["block"]), ("q-kv", row["q"], row["kv"])}
    if quant:
        out |= {("kv-scale", row["kv"], row["scale"]), ("scale-layout", row["scale"], row["layout"])}
    out |= {("value", axis, row[axis]) for axis in AXES if axis != "scale" or quant}
    return out


def _required() -> set[tuple]:
    """The builder's target, from its own row bookkeeping (_pairs)."""
    need = set()
    for kv, layout, hd, block, q in itertools.product(KV, LAYOUTS, HEAD_DIMS, BLOCKS, Q):
        for scale in SCALES:
            row = {"kv": kv, "layout": layout, "group": 1, "kv_heads": 1, "block": block, "head_dim": hd,
                   "q": q, "scale": scale, "split": False}
            need |= {p for p in _pairs(row) if p[0] != "value"}
    need |= {("value", axis, v) for axis, vals in AXES.items() for v in vals}
    return need


QUANT_KV = [k for k in KV if k in QUANTIZED_KV_DTYPES]
# What the sweep must cover, written out independently of _pairs.
REQUIRED = (
    {("value", axis, v) for axis, vals in AXES.items() for v in vals}
    | {("kv-layout", k, lay) for k in KV for lay in LAYOUTS}
    | {("width-hd", w, d) for w in {dtype(k).itemsize for k in KV} for d in HEAD_DIMS}
    | {("layout-block", lay, b) for lay in LAYOUTS for b in BLOCKS}
    | {("q-kv", q, k) for q in Q for k in KV}
    | {("kv-scale", k, sc) for k in QUANT_KV for sc in SCALES}
    | {("scale-layout", sc, lay) for sc in SCALES for lay in LAYOUTS}
)


def _cost(row: dict) -> float:
    """CPU-backend work of the verifier's matrix, roughly: query heads x head_dim x long context."""
    return row["group"] * row["kv_heads"] * row["head_dim"] * max(5 * row["block"] + 3, 300)


def covering_design(seed: int = 7, trials: int = 400) -> list[dict]:
    rnd = random.Random(seed)
    todo, rows = _required(), []
    while todo:
        best, best_score = None, -1.0
        for _ in range(trials):
            row = {axis: rnd.choice(vals) for axis, vals in AXES.items()}
            gain = len(_pairs(row) & todo)
            score = gain - _cost(row) / 2e6
            if gain and score > best_score:
                best, best_score = row, score
        if best is None:  # the leftovers are rare: build a row around one of them
            kind, a, b = sorted(todo, key=str)[0]
            best = {axis: rnd.choice(vals) for axis, vals in AXES.items()}
            if kind == "value":
                best[a] = b
        todo -= _pairs(best)
        rows.append(best)
    return rows


DESIGN = covering_design()


def _config(row: dict) -> dict | None:
    return {"partition_size": max(2 * row["block"], 32)} if row["split"] else None


def _spec(row: dict, i: int):
    layout, _, order = row["layout"].partition("/")
    quant = WIDTH[row["kv"]] == 1
    hkv = row["kv_heads"]
    return kgen.spec_from_dict({
        "kgen": 1, "name": f"sweep_{i}", "kind": "paged_decode",
        "attention": {"num_q_heads": row["group"] * hkv, "num_kv_heads": hkv, "head_dim": row["head_dim"]},
        "kv_cache": {"block_size": row["block"], "layout": layout, "dtype": row["kv"],
                     "scale": row["scale"] if quant else "none", **({"order": order} if order else {})},
        "dtype": {"q": row["q"]}, "tail_masking": True, "targets": ["sm_90"],
    })


def _id(row: dict) -> str:
    scale = f"-{row['scale']}" if WIDTH[row["kv"]] == 1 else ""
    return (f"{row['kv']}{scale}-{row['layout'].replace('/', '')}-g{row['group']}x{row['kv_heads']}"
            f"-b{row['block']}-d{row['head_dim']}-q{row['q']}{'-split' if row['split'] else ''}")


def exercised(spec, config: dict | None) -> set[tuple]:
    """The values and pairs one row exercises, read back from the spec it builds and the
    config it runs with."""
    kv, a = spec.kv_cache, spec.attention
    layout = "vllm" if kv.layout == "vllm" else f"{kv.layout}/{kv.resolved_order}"
    values = {"kv": kv.dtype, "layout": layout, "group": spec.group_size, "kv_heads": a.num_kv_heads,
              "block": kv.block_size, "head_dim": a.head_dim, "q": spec.dtype.q,
              "split": bool(config and config.get("partition_size"))}
    out = {("kv-layout", kv.dtype, layout), ("width-hd", dtype(kv.dtype).itemsize, a.head_dim),
           ("layout-block", layout, kv.block_size), ("q-kv", spec.dtype.q, kv.dtype)}
    if kv.dtype in QUANTIZED_KV_DTYPES:  # the scale axis means something only for quantized caches
        values["scale"] = kv.scale
        out |= {("kv-scale", kv.dtype, kv.scale), ("scale-layout", kv.scale, layout)}
    return out | {("value", axis, v) for axis, v in values.items()}


def coverage_gaps(design: list[dict]) -> set[tuple]:
    """Required values and pairs that no row of `design` exercises."""
    covered = set().union(*(exercised(_spec(r, i), _config(r)) for i, r in enumerate(design)))
    return REQUIRED - covered


def test_design_covers_every_value_and_required_pair():
    assert _required() == REQUIRED  # the builder aimed at the right target
    assert not coverage_gaps(DESIGN)
    assert len(DESIGN) < 60  # far below the cross product (~1.5e5 rows)
    assert {r["group"] for r in DESIGN} == set(GROUPS) and {r["kv_heads"] for r in DESIGN} == {1, 2}


def test_coverage_check_finds_what_a_deficient_design_misses():
    assert coverage_gaps(DESIGN[:-1])  # the greedy builder adds a row only for something new
    no_vllm = [{**r, "layout": "fused/NHD"} if r["layout"] == "vllm" else r for r in DESIGN]
    gaps = coverage_gaps(no_vllm)
    assert ("value", "layout", "vllm") in gaps and ("kv-layout", "int8", "vllm") in gaps
    unquantized = [{**r, "kv": "fp16"} if r["kv"] == "int8" else r for r in DESIGN]
    assert {("kv-scale", "int8", sc) for sc in SCALES} <= coverage_gaps(unquantized)


def default_tier_rows(design: list[dict]) -> set[int]:
    """The rows of the default tier: chosen greedily (most values not yet seen, then the earlier row)
    until every value of every axis but the group size is exercised, read back as coverage_gaps reads it."""
    values = {i: {p for p in exercised(_spec(r, i), _config(r)) if p[0] == "value"} for i, r in enumerate(design)}
    need = {p for p in REQUIRED if p[0] == "value" and p[1] != "group"}
    chosen: set[int] = set()
    while need:
        best = max(values, key=lambda i: (len(values[i] & need), -i))
        if not values[best] & need:
            break  # the design lacks a value: test_default_tier_rows_cover_every_value_but_the_group says so
        chosen.add(best)
        need -= values[best]
    return chosen


DEFAULT_TIER_ROWS = default_tier_rows(DESIGN)


def test_default_tier_rows_cover_every_value_but_the_group():
    covered = set().union(*(exercised(_spec(DESIGN[i], i), _config(DESIGN[i])) for i in DEFAULT_TIER_ROWS))
    missing = {p for p in REQUIRED if p[0] == "value" and p[1] != "group"} - covered
    assert not missing and len(DEFAULT_TIER_ROWS) < len(DESIGN) / 2, (missing, sorted(DEFAULT_TIER_ROWS))


@pytest.mark.parametrize("i", [pytest.param(i, id=_id(r), marks=() if i in DEFAULT_TIER_ROWS else pytest.mark.full)
                               for i, r in enumerate(DESIGN)])
def test_sweep_row_verifies(i):
    row = DESIGN[i]
    spec = _spec(row, i)
    config = _config(row)
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], seed=1000 + i)
    assert kernel.report.passed, kernel.report.summary()
