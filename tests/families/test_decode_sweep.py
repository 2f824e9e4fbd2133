"""A covering sweep of the decode kernel on the CPU backend: every value of every axis
appears, and every pair of the risky axes is covered (kv dtype x layout, element width x
head_dim, layout x block size, quantized dtype x scale, scale x layout, q dtype x kv dtype),
instead of the full cross product. The design is built greedily (AETG-style) with a fixed
seed, preferring cheap rows; its coverage is itself tested."""

from __future__ import annotations

import itertools
import random

import pytest

import kgen

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
    need = set()
    for kv, layout, hd, block, q in itertools.product(KV, LAYOUTS, HEAD_DIMS, BLOCKS, Q):
        for scale in SCALES:
            row = {"kv": kv, "layout": layout, "group": 1, "kv_heads": 1, "block": block, "head_dim": hd,
                   "q": q, "scale": scale, "split": False}
            need |= {p for p in _pairs(row) if p[0] != "value"}
    need |= {("value", axis, v) for axis, vals in AXES.items() for v in vals}
    return need


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
FAST = 16  # the first rows cover the most pairs; the rest run with -m slow


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


def test_design_covers_every_value_and_required_pair():
    covered = set().union(*(_pairs(r) for r in DESIGN))
    assert _required() <= covered
    assert len(DESIGN) < 60  # far below the cross product (~1.5e5 rows)
    assert {r["group"] for r in DESIGN} == set(GROUPS) and {r["kv_heads"] for r in DESIGN} == {1, 2}


@pytest.mark.parametrize("i", [pytest.param(i, marks=[pytest.mark.slow] if i >= FAST else [], id=_id(r))
                               for i, r in enumerate(DESIGN)])
def test_sweep_row_verifies(i):
    row = DESIGN[i]
    spec = _spec(row, i)
    config = {"partition_size": max(2 * row["block"], 32)} if row["split"] else None
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], seed=1000 + i)
    assert kernel.report.passed, kernel.report.summary()
