"""The prefill K/V pipeline and its call-time split (kgen/families/attention/prefill.py,
templates/common/paged_prefill.cuh): the planner's grids, plans reused across calls, bad plans
refused, every stage count and K/V path verified, and a tile read before its copies land fails."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import inline_prefill_body, inline_provided, tiny_decode

import kgen
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.attention.prefill_cases import check, make_prefill_case, references
from kgen.families.attention.prefill_geometry import (
    kv_path,
    prefill_geometry,
    smem_bytes,
)
from kgen.families.base import resolve_config
from kgen.plan import BLOCKS_PER_SM
from kgen.plan.arch import smem_limit
from kgen.plan.split import STEP_TOKENS
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {
    "kgen": 1, "name": "pipe_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 6, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
LLAMA = {**BASE, "name": "pipe_llama", "attention": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}}
MMA = {"path": 1}  # the mma.sync body (these specs target sm_90 alone, where auto takes the Hopper body)


def _spec(base=BASE, **overrides):
    return kgen.spec_from_dict(base).with_overrides(**overrides)


def _check(spec, args, out):
    ref, lowp = references(spec, args)
    return check("call", spec, args, out, ref, lowp)[0]


def _indptr(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


# ---- the planner (no kernel built) ---------------------------------------------------------------
def test_a_16_token_chunk_over_a_32k_prefix_fills_the_gpu():
    """Llama 3 8B shapes: 16 tokens x 4 heads = one row tile per KV head, 8 blocks unsplit; the plan
    splits the prefix into partitions that give >= 2 blocks per SM of 132 with keys, in whole waves."""
    spec = _spec(LLAMA)
    config = resolve_config(PAGED_PREFILL, spec, None)
    lens, q_lens = np.array([32768 + 16]), [16]
    target = BLOCKS_PER_SM * 132
    sizes, kernels = PAGED_PREFILL.schedule(spec, config, {"seq_lens": lens, "q_indptr": _indptr(q_lens)}, target)
    P, parts = sizes["partition_tokens"], sizes["max_partitions"]
    assert P % STEP_TOKENS == 0 and P >= config["partition_size"] and parts == -(-int(lens[0]) // P)
    assert len(kernels) == 2 and sizes["q_tiles"] == 1 + 1  # one row tile (+ one spare block per sequence)
    assert 8 * parts >= target
    # one whole wave (whole_waves): the largest size reaching the target, 992, gives 34 partitions (272 blocks)
    assert 8 * parts == target and P == 1008


def test_a_big_prompt_batch_is_not_split():
    spec = _spec(LLAMA)
    config = resolve_config(PAGED_PREFILL, spec, None)
    sizes, kernels = PAGED_PREFILL.schedule(spec, config, {"seq_lens": np.array([2048] * 8),
                                                          "q_indptr": _indptr([2048] * 8)}, BLOCKS_PER_SM * 132)
    assert sizes["max_partitions"] == 1 and sizes["partition_tokens"] == 0 and len(kernels) == 1


def test_a_mixed_batch_splits_only_as_far_as_it_needs():
    """One long prompt's many row tiles count: a small chunk next to it is split less than alone."""
    spec = _spec(LLAMA)
    config = resolve_config(PAGED_PREFILL, spec, None)
    alone, _ = PAGED_PREFILL.schedule(spec, config, {"seq_lens": np.array([32784]), "q_indptr": _indptr([16])},
                                      BLOCKS_PER_SM * 132)
    mixed, _ = PAGED_PREFILL.schedule(spec, config, {"seq_lens": np.array([32784, 256]),
                                                "q_indptr": _indptr([16, 256])}, BLOCKS_PER_SM * 132)
    assert 1 < mixed["max_partitions"] < alone["max_partitions"]


def test_a_256_token_chunk_over_a_32k_prefix_splits_in_whole_waves():
    """8 row tiles of 128 rows x 8 KV heads: the largest partition reaching 264 blocks would make 5
    partitions (320 blocks, a second wave of 56); prefill rounds to 4 (256 blocks, one wave)."""
    spec = _spec(LLAMA)
    config = resolve_config(PAGED_PREFILL, spec, MMA)  # an sm_90-only spec: auto would take the Hopper body
    assert prefill_geometry(spec, config).m_tiles == 2
    lens = np.array([32768 + 256])
    sizes, _ = PAGED_PREFILL.schedule(spec, config, {"seq_lens": lens, "q_indptr": _indptr([256])},
                                      BLOCKS_PER_SM * 132)
    assert sizes["max_partitions"] == 4 and sizes["q_tiles"] == 8 + 1
    assert sizes["partition_tokens"] == -(-int(lens[0]) // (4 * STEP_TOKENS)) * STEP_TOKENS


def test_automatic_m_tiles():
    """2 m tiles a warp for 16-bit q, head dims up to 128, v_head_dim + kv_tile <= 160 (registers) and
    tiles of 32+ keys under 96 KiB; else 1. The Hopper body's warpgroups own 64 rows: 1 there."""
    def auto(config=None, **overrides):
        spec = _spec(LLAMA, **overrides)
        return prefill_geometry(spec, resolve_config(PAGED_PREFILL, spec, {**MMA, **(config or {})})).m_tiles
    geo = prefill_geometry(_spec(LLAMA), MMA)
    assert auto() == 2 and (geo.warps, geo.kv_tile) == (4, 32)
    assert prefill_geometry(_spec(LLAMA), resolve_config(PAGED_PREFILL, _spec(LLAMA), {"path": 2})).m_tiles == 1
    assert auto(**{"dtype.q": "fp32"}) == 1  # the FMA path
    assert auto(**{"attention.head_dim": 192}) == 1  # the output rows would not fit twice
    assert auto({"kv_tile": 64}) == 1  # 192 accumulators a lane: spills
    assert auto(**{"attention.head_dim": 64}) == 2
    assert auto({"m_tiles": 1}) == 1
    rendered = render(_spec(LLAMA), {"partition_size": 0, **MMA})
    assert "M_TILES = 2;" in rendered.source
    with pytest.raises(kgen.KgenUserError, match="m_tiles must be 0"):
        render(_spec(LLAMA), {"m_tiles": 3, **MMA})


# ---- planned calls ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kern():
    return kgen.build(_spec(), backend="cpu", config={"partition_size": 32, "kv_tile": 16, "warps": 2}, archs=[],
                      verify=False)


def test_planned_call_gives_the_reference_and_keeps_its_scratch(kern):
    args = make_prefill_case(kern.spec, [300, 33, 90], [16, 1, 90], np.random.default_rng(1))
    plan = kern.plan(args["seq_lens"], q_indptr=args["q_indptr"], partition_tokens=32)
    assert plan.sizes["max_partitions"] == 10 and [ln.kernel for ln in plan.launches] == ["pipe_prefill",
                                                                                          "pipe_prefill_merge"]
    out = kern(**args, plan=plan)
    result = _check(kern.spec, args, out)
    assert result.passed, result.note
    scratch = dict(plan.workspace)
    assert np.array_equal(kern(**dict(args, out=None), plan=plan), out) and plan.workspace == scratch


def test_plan_for_the_largest_batch_serves_fewer_sequences_and_longer_lengths(kern):
    plan = kern.plan([200, 200, 200], q_indptr=_indptr([16, 16, 16]), partition_tokens=32)
    for lens, q_lens in (([200, 40], [16, 8]), ([700, 100, 65], [16, 16, 16]), ([400], [48])):
        args = make_prefill_case(kern.spec, lens, q_lens, np.random.default_rng(len(lens)))
        result = _check(kern.spec, args, kern(**args, plan=plan))
        assert result.passed, (lens, result.note)


def test_a_plan_with_one_partition_launches_no_merge(kern):
    args = make_prefill_case(kern.spec, [30, 20], [30, 20], np.random.default_rng(3))
    plan = kern.plan(args["seq_lens"], q_indptr=args["q_indptr"])
    assert plan.sizes["max_partitions"] == 1 and len(plan.launches) == 1
    assert _check(kern.spec, args, kern(**args, plan=plan)).passed


def test_bad_plans_are_refused(kern):
    args = make_prefill_case(kern.spec, [100, 100, 100], [10, 10, 10], np.random.default_rng(4))
    with pytest.raises(kgen.ArgumentError, match="made for at most 2 sequences, the call has 3"):
        kern(**args, plan=kern.plan([100, 100], q_indptr=_indptr([10, 10])))
    with pytest.raises(kgen.ArgumentError, match="made for at most 20 query rows, the call has 30"):
        kern(**args, plan=kern.plan([100, 100, 100], q_indptr=_indptr([10, 10, 0])))
    with pytest.raises(kgen.ArgumentError, match="q_indptr: required to plan a paged_prefill call"):
        kern.plan([100])
    with pytest.raises(kgen.ArgumentError, match="q_indptr: expected 3 non-decreasing offsets from 0"):
        kern.plan([100, 100], q_indptr=[0, 5])
    with pytest.raises(kgen.ArgumentError, match=r"sequence 1: q_len = 50 is larger than seq_lens\[1\] = 40"):
        kern.plan([100, 40], q_indptr=[0, 5, 55])
    with pytest.raises(kgen.ArgumentError, match="multiple of 16 of at least the config's partition_size 32"):
        kern.plan([100], q_indptr=[0, 4], partition_tokens=40)


def test_decode_refuses_q_indptr_in_its_plan():
    decode = kgen.build(tiny_decode("pipe_decode"), backend="cpu", verify=False, archs=[])
    with pytest.raises(kgen.ArgumentError, match="q_indptr: paged_decode has one query row per sequence"):
        decode.plan([100], q_indptr=[0, 1])


# ---- the pipeline ----------------------------------------------------------------------------------
def test_kv_paths_and_shared_memory():
    assert kv_path(_spec()) == "copy"
    assert kv_path(_spec(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"})) == "stage"
    assert kv_path(_spec(**{"kv_cache.dtype": "fp32"})) == "stage"  # wider than q: dequantized (rounded) to q's type
    assert kv_path(_spec(**{"kv_cache.layout": "vllm", "kv_cache.order": None})) == "gather"
    spec = _spec(LLAMA)
    # Q 64 rows + 2 stages x (K, V) of 64 keys, rows of 128 + 8 halves
    assert smem_bytes(spec, 4, 64, 2) == (64 + 2 * 2 * 64) * 136 * 2
    geo = prefill_geometry(spec, {"stages": 4, "path": 1})
    assert (geo.warps, geo.kv_tile) == (4, 32)  # automatic tiles shrink the key tile first under deep pipelines


def test_automatic_stages_fall_back_to_one_where_two_do_not_fit():
    """stages 0 (the default) is 2, or 1 when even the smallest automatic tiles of 2 stages need more
    than the targets' opt-in limit (kgen/plan/arch.py; 163 KiB with sm_80 among them): head_dim 512 of
    an fp32 cache staged for fp16 q, which then builds. Targeting sm_90 alone (227 KiB) keeps 2 stages."""
    assert prefill_geometry(_spec(LLAMA), {"stages": 0}).stages == 2
    wide_sm90 = _spec(**{"attention.head_dim": 512, "kv_cache.dtype": "fp32", "targets": ["sm_90"]})
    assert prefill_geometry(wide_sm90, {"stages": 0}).stages == 2
    wide = _spec(**{"attention.head_dim": 512, "kv_cache.dtype": "fp32", "targets": ["sm_80", "sm_90"]})
    two = prefill_geometry(wide, {"stages": 2})
    assert two.smem_bytes == smem_bytes(wide, two.warps, two.kv_tile, 2) > smem_limit(wide.targets) == 163 * 1024
    assert prefill_geometry(wide, {"stages": 0}).stages == 1
    config = resolve_config(PAGED_PREFILL, wide, None)
    assert PAGED_PREFILL.check_config(wide, config) == []
    assert prefill_geometry(wide, config).smem_bytes <= smem_limit(wide.targets)


@pytest.mark.parametrize("overrides,config", [
    ({}, {"stages": 1}),
    ({}, {"stages": 3, "kv_tile": 16, "warps": 1}),
    ({"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "kv_cache.order": "HND"},
     {"stages": 4, "kv_tile": 16}),
    ({"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor", "attention.head_dim": 40,
      "dtype.q": "bf16"}, {"stages": 3}),  # 8-byte copies of 8 fp8 elements, zero-padded K columns
], ids=["copy-s1", "copy-s3", "stage-int8-token-s4", "stage-e5m2-d40-s3"])
def test_stages_verify(overrides, config):
    kernel = kgen.build(_spec(**overrides), backend="cpu", config=config, archs=[], seed=77)
    assert kernel.report.passed, kernel.report.summary()


# the stage ring (attention/stage_ring.cuh, which the body includes)
WAIT = "cp_async_wait<(STAGES >= 2 ? STAGES - 2 : 0)>();  // this thread's copies of `tile` have landed"
BARRIER = "__syncthreads();  // everybody's have;"
INCLUDE = '#include "kgen/bodies/paged_prefill.cuh"\n'
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("mid,old,new", [
    ("unchanged", WAIT, WAIT),  # the control: the inlined body itself verifies
    ("never_waits", WAIT, "// (wait dropped)"),
    ("no_barrier_after_the_wait", BARRIER, "// (barrier dropped) everybody's have;"),
])
def test_reading_a_tile_before_its_copies_land_fails_verification(mid, old, new):
    """The CPU backend lands a cp.async copy only at its wait (issue leaves 0xFF bytes: NaN halves): a
    kernel that reads a tile before its own wait, or before the barrier after everybody's, fails."""
    spec = _spec()
    rendered = render(spec, {"stages": 2, "partition_size": 0, "path": 1})  # the ABI's single pass, mma.sync body
    body = (ROOT / "templates" / "common" / "paged_prefill.cuh").read_text()  # provided as kgen/bodies/paged_prefill.cuh
    assert rendered.source.count(INCLUDE) == 1
    # inlined as kernel code: no compiler branch (the MMA switch is 1 for sm_80+ and the CPU backend alike)
    arch_switch = body[body.index("#if !defined(KGEN_SIMT)"):body.index("#endif", body.index("#if !defined(KGEN_SIMT)"))
                       + len("#endif")]
    body = body.replace(arch_switch, "").replace("KGEN_PREFILL_HAS_MMA", "1").replace("#pragma once", "")
    source = inline_provided(rendered.source.replace(INCLUDE, body), "kgen/attention/stage_ring.cuh")
    assert source.count(old) == 1
    source = source.replace(old, new)
    mutant = kernel_from_source(spec, source, backend="cpu", config=rendered.config, archs=[])
    report = verify(mutant, seed=3)
    if old == new:
        assert report.passed, report.summary()
        return
    assert not report.passed, mid
    # Race detection (hand-written sources) may stop the matrix at the first case with a race;
    # where it sees none, the unlanded bytes fail the cases themselves.
    summary = report.summary()
    assert report.failed_cases and ("race" in summary or "NaN" in summary or "error" in summary), summary


MERGE_PARTS = "const int num_parts = split_partitions(kv_len, partition_tokens, max_partitions);"


def test_prefill_merge_is_the_shared_merge_body_and_a_broken_one_fails():
    """Prefill's merge kernel runs attention/epilogue.cuh's merge_partitions_body, the one decode runs too
    (tests/verify/test_verify_runner.py breaks it for decode): dropping the last partition there
    fails prefill's split cases, while the unbroken copy verifies."""
    spec = _spec()
    rendered = render(spec, {"partition_size": 32, "kv_tile": 16, "warps": 2})
    assert "kgen::paged_prefill_merge_body<Cfg>(" in rendered.source
    source = inline_provided(inline_prefill_body(rendered.source), "kgen/attention/epilogue.cuh")  # the body's part
    assert source.count(MERGE_PARTS) == 1
    good = kernel_from_source(spec, source, backend="cpu", config=rendered.config, archs=[])
    assert verify(good, seed=5).passed
    mutant = kernel_from_source(spec, source.replace(MERGE_PARTS, MERGE_PARTS.replace(
        "split_partitions(kv_len, partition_tokens, max_partitions)", "min(kv_len / partition_tokens, max_partitions)")),
        backend="cpu", config=rendered.config, archs=[])
    report = verify(mutant, seed=5)
    assert not report.passed and "chunk_1" in {c.name for c in report.failed_cases}, report.summary()
