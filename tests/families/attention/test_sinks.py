"""Attention sinks (docs/abi.md "Attention sinks"): the float64 reference against the definition
(the sink as one more key of value zero), every attention body verified on the CPU backend with
sinks (CUDA-core and tensor-core decode, prefill; single pass and split-KV; with and without a
sliding window), the LSE, sinks that outweigh every key without a NaN, the merge adding the sink
once, and every refused `sinks` argument."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import inline_prefill_body, inline_provided

import kgen
from kgen.families.attention.decode_cases import (
    SINK_CONTEST,
    SINK_RANGE,
    make_decode_case,
    sink_logits,
)
from kgen.families.attention.prefill_cases import make_prefill_case
from kgen.families.attention.reference import (
    attention_outputs,
    query_rows,
    real_kv,
    visible_keys,
)
from kgen.render import render
from kgen.verify.judge.bounds import check_lse, check_output
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

DECODE = {
    "kgen": 1, "name": "sink_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, "sinks": True},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "bf16"},
    "dtype": {"q": "bf16"}, "tail_masking": True, "targets": ["sm_90"],
}
PREFILL = {**DECODE, "name": "sink_prefill", "kind": "paged_prefill"}
SEED = 71


def _spec(base=DECODE, **overrides):
    return kgen.spec_from_dict(base).with_overrides(**overrides)


# ---- the reference ------------------------------------------------------------------------------
def _by_definition(spec, args):
    """Softmax over the visible keys plus one virtual key (logit sinks[h], value 0), in float64,
    one row and head at a time (independent of reference.py's vectorised online form)."""
    a, G = spec.attention, spec.group_size
    q = np.asarray(args["q"], dtype=np.float64)
    ind, pos = query_rows(args)
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for s, (k, v) in enumerate(real_kv(spec, args)):
        for r in range(int(ind[s]), int(ind[s + 1])):
            seen = visible_keys(spec, pos[r:r + 1], k.shape[1])[0]
            for h in range(a.num_q_heads):
                logits = spec.softmax_scale_value * (k[h // G] @ q[r, h])
                z = np.concatenate([logits[seen], [float(args["sinks"][h])]])
                values = np.concatenate([v[h // G][seen], np.zeros((1, a.head_dim))])
                w = np.exp(z - z.max())
                out[r, h] = w @ values / w.sum()
                lse[r, h] = z.max() + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("base,overrides,lens,q_lens", [
    (DECODE, {}, [1, 17, 40], None),
    (DECODE, {"attention.sliding_window": 8}, [5, 30], None),
    (PREFILL, {}, [20, 7, 9], [6, 0, 9]),  # a sequence without query rows
    (PREFILL, {"attention.sliding_window": 5}, [33], [12]),
])
def test_reference_is_the_softmax_with_one_more_key_of_value_zero(base, overrides, lens, q_lens):
    spec, rng = _spec(base, **overrides), np.random.default_rng(5)
    args = make_decode_case(spec, lens, rng) if q_lens is None else make_prefill_case(spec, lens, q_lens, rng)
    out, lse = attention_outputs(spec, args["q"], args)
    want_out, want_lse = _by_definition(spec, args)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_reference_with_a_dominant_sink_is_finite_and_near_zero():
    spec = _spec(PREFILL, **{"attention.causal": False})
    args = make_prefill_case(spec, [4], [4], np.random.default_rng(2))
    args["sinks"] = np.asarray([30.0, -5.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32)
    out, lse = attention_outputs(spec, args["q"], args)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    # +30 against four keys of logit ~N(0, 1): the output is ~e^-25 of the values, the LSE ~30
    assert np.max(np.abs(out[:, 0])) < 1e-8 and np.max(np.abs(lse[:, 0] - 30.0)) < 1e-6


def test_a_row_that_underflows_the_output_type_does_not_loosen_the_others():
    """A dominant sink's row (~1e-12) is 0 in fp16, a relative error of 1 in the model: it must not
    become every row's yardstick, or a kernel that forgets the sink of another head would pass."""
    ref = np.stack([np.full((1, 8), 1e-12), np.linspace(-1.0, 1.0, 8)[None, :]])  # [2 rows, 1 head, 8]
    lowp = ref.astype(np.float16).astype(np.float64)  # row 0 underflows to 0
    wrong = ref * np.asarray([1.0, 1.1])[:, None, None]  # row 1 off by 10%
    assert check_output("fp16", [4, 4], ref.astype(np.float16), ref, lowp, "fp16").passed
    assert not check_output("fp16", [4, 4], wrong.astype(np.float16), ref, lowp, "fp16").passed


def test_case_sinks_span_the_range_and_contest_the_keys():
    rng = np.random.default_rng(0)
    s = sink_logits(64, rng)
    assert s.dtype == np.float32 and s.shape == (64,)
    assert s.min() == SINK_RANGE[0] and s.max() == SINK_RANGE[1]
    assert np.sum((s >= SINK_CONTEST[0]) & (s <= SINK_CONTEST[1])) >= 31  # half compete with the keys


# ---- the kernels, verified ----------------------------------------------------------------------
CUDA_CORES, TENSOR_CORES = {"mma_min_group": 0}, {"mma_min_group": 1}


@pytest.mark.parametrize("base,overrides,config", [
    (DECODE, {}, {**CUDA_CORES, "partition_size": 0}),
    (DECODE, {}, {**CUDA_CORES, "partition_size": 32}),
    (DECODE, {"attention.sliding_window": 40}, {**CUDA_CORES, "partition_size": 16}),  # partitions outside it
    (DECODE, {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head", "attention.logits_soft_cap": 4.0},
     CUDA_CORES),
    (DECODE, {"dtype.q": "fp16", "kv_cache.dtype": "fp16"}, {**TENSOR_CORES, "partition_size": 0}),
    (DECODE, {}, {**TENSOR_CORES, "partition_size": 32}),
    (DECODE, {"attention.sliding_window": 40, "attention.alibi": True}, {**TENSOR_CORES, "partition_size": 16}),
    (PREFILL, {}, {"partition_size": 0}),
    (PREFILL, {}, {"partition_size": 32}),
    (PREFILL, {"attention.sliding_window": 24, "dtype.q": "fp16", "kv_cache.dtype": "fp16"}, {"partition_size": 16}),
    (PREFILL, {"attention.causal": False}, {"partition_size": 0}),
])
def test_every_body_verifies_with_sinks(base, overrides, config):
    spec = _spec(base, **overrides)
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], verify=True, seed=SEED)
    assert kernel.report.passed, kernel.report.summary()
    assert "TENSOR_CORES = true;" in kernel.source if config.get("mma_min_group") == 1 else True


def _call(kernel, args, sinks, **extra):
    given = {n: x for n, x in args.items() if n not in ("out", "sinks")}
    return kernel(**given, sinks=sinks, return_lse=True, **extra)


@pytest.mark.parametrize("base,config", [
    (DECODE, {**CUDA_CORES, "partition_size": 0}), (DECODE, {**CUDA_CORES, "partition_size": 16}),
    (DECODE, {**TENSOR_CORES, "partition_size": 0}), (DECODE, {**TENSOR_CORES, "partition_size": 16}),
    (PREFILL, {"partition_size": 0}), (PREFILL, {"partition_size": 16}),
])
def test_a_sink_that_outweighs_every_key_leaves_no_nan(base, config):
    """sink +30 against logits ~N(0, 1): outputs ~e^-25 of the values, the LSE ~30, nothing NaN,
    also in windowed split launches whose first partitions hold no key of the window."""
    spec = _spec(base, **{"attention.sliding_window": 20})
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], verify=False)
    rng = np.random.default_rng(9)
    lens = [90, 3]
    args = make_decode_case(spec, lens, rng) if base is DECODE else make_prefill_case(spec, lens, [5, 3], rng)
    sinks = np.full(spec.attention.num_q_heads, 30.0, dtype=np.float32)
    plan = kernel.plan(lens, **({} if base is DECODE else {"q_indptr": args["q_indptr"]}),
                       partition_tokens=16) if config["partition_size"] else None
    out, lse = _call(kernel, args, sinks, plan=plan)
    out, lse = np.asarray(out, dtype=np.float64), np.asarray(lse)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.max(np.abs(out)) < 1e-6
    ref, ref_lse = attention_outputs(spec, args["q"], dict(args, sinks=sinks))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    rows = {"q_indptr": args["q_indptr"]} if base is PREFILL else {}
    assert check_output("dominant_sink", lens, out, ref, ref, spec.dtype.resolved_out, **rows).passed


def test_lse_includes_the_sink_in_every_launch_plan():
    """The LSE of a single-pass and of a split launch (the merge adds the sink once) against the
    reference, with sinks that compete with the keys."""
    spec = _spec()
    rng = np.random.default_rng(4)
    lens = [70, 1, 33]
    args = make_decode_case(spec, lens, rng)
    sinks = rng.uniform(*SINK_CONTEST, spec.attention.num_q_heads).astype(np.float32)
    ref, ref_lse = attention_outputs(spec, args["q"], dict(args, sinks=sinks))
    _, no_sink_lse = attention_outputs(_spec(**{"attention.sinks": False}), args["q"], args)
    assert np.min(ref_lse - no_sink_lse) > 1e-3  # the sink changes every LSE: a check that can fail
    for config in ({**CUDA_CORES, "partition_size": 0}, {**CUDA_CORES, "partition_size": 16}):
        kernel = kgen.build(spec, backend="cpu", config=config, archs=[], verify=False)
        plan = kernel.plan(lens, partition_tokens=16) if config["partition_size"] else None
        out, lse = _call(kernel, args, sinks, plan=plan)
        assert check_lse("lse", lens, np.asarray(lse), ref_lse, ref_lse).passed
        assert check_output("out", lens, np.asarray(out, dtype=np.float64), ref, ref, "bf16").passed


# ---- the prefill body's sink (attention/epilogue.cuh's), broken on purpose (decode's:
# tests/verify/test_verify_runner.py) -----
@pytest.mark.parametrize("old,new,must_fail", [
    pytest.param("if (sinks != nullptr && !split) acc *=", "if (sinks != nullptr) acc *=",  # per partition
                 {"split_prefix_3P", "small_chunk_long_prefix"}, marks=pytest.mark.full),  # ~28 s: the Hopper
    # body's same mutation (test_prefill_wgmma.py) and the decode sink mutations (test_verify_runner.py) are default
    # (single-pass rows: the cases whose keys fit one partition of 32)
    pytest.param("st.add_sink(sinks[h])", "st.add_sink(sinks[h] * Cfg::SOFTMAX_SCALE)",  # scaled
                 {"chunk_16", "chunk_17"}, marks=pytest.mark.full),  # (the decode ones are default: test_verify_runner)
    pytest.param("st.add_sink(sinks[h])", "st.add_sink(-1e30f)", {"chunk_16", "chunk_17"},  # forgotten
                 marks=pytest.mark.full),
])
def test_prefill_sink_mutations_are_caught(prefill_copy, old, new, must_fail):
    spec, r, src = prefill_copy
    assert src.count(old) == 1, old
    bad = verify(kernel_from_source(spec, src.replace(old, new), backend="cpu", config=r.config, archs=[]),
                 seed=SEED)
    failed = {c.name for c in bad.failed_cases}
    assert must_fail <= failed, sorted(failed)


@pytest.fixture(scope="module")
def prefill_copy():
    """(spec, render, source) of a split prefill with its body and its epilogue part copied in, checked
    to pass unmutated."""
    spec = _spec(PREFILL)
    r = render(spec, {"partition_size": 32, "path": 1})  # the mma.sync body (test_prefill_wgmma.py: the Hopper one)
    src = inline_provided(inline_prefill_body(r.source), "kgen/attention/epilogue.cuh")  # as a hand-written copy
    good = verify(kernel_from_source(spec, src, backend="cpu", config=r.config, archs=[]), seed=SEED)
    assert good.passed, good.summary()
    return spec, r, src


# ---- the call ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decode_kernel():
    return kgen.build(_spec(), backend="cpu", config=CUDA_CORES, archs=[], verify=False)


def _args(spec):
    args = make_decode_case(spec, [20, 5], np.random.default_rng(1))
    args.pop("out")
    return args


@pytest.mark.parametrize("change,pattern", [
    (lambda a: a.pop("sinks"), r"sinks: required \(spec has sinks: true\).*fp32 shape \[8\]"),
    (lambda a: a.update(sinks=np.zeros(4, np.float32)), r"sinks: .*\[8\]"),
    (lambda a: a.update(sinks=np.zeros((8, 1), np.float32)), r"sinks: .*\[8\]"),
    (lambda a: a.update(sinks=np.zeros(8, np.float64)), r"sinks: .*fp32"),
])
def test_bad_sinks_are_refused_with_the_argument_named(decode_kernel, change, pattern):
    args = _args(decode_kernel.spec)
    change(args)
    with pytest.raises(kgen.ArgumentError, match=pattern):
        decode_kernel(**args)


def test_sinks_given_to_a_spec_without_are_refused_not_ignored():
    spec = _spec(**{"attention.sinks": False})
    kernel = kgen.build(spec, backend="cpu", config=CUDA_CORES, archs=[], verify=False)
    args = _args(spec)
    args["sinks"] = np.zeros(8, np.float32)
    with pytest.raises(kgen.ArgumentError, match=r"sinks: given, but the spec has no attention sinks"):
        kernel(**args)


def test_abi_has_sinks_after_alibi_only_for_a_spec_with_sinks():
    from kgen.abi import abi_text

    with_sinks, without = abi_text(_spec()), abi_text(_spec(**{"attention.sinks": False}))
    assert "sinks" not in without
    sig = with_sinks[with_sinks.index("extern"):]
    assert sig.index("alibi_slopes") < sig.index("sinks") < sig.index("part_o")
    assert "lse = sinks[h]" in with_sinks


def test_audit_compares_with_the_sinks_of_the_call(decode_kernel):
    """kern.audit recomputes each call with its own sinks: kgen's kernel passes, one that ignores
    them (built unverified from a mutated source) is caught."""
    spec = decode_kernel.spec
    audited = decode_kernel.audit(rate=1.0, seed=0)
    audited(**_args(spec))
    assert (audited.stats.checked, audited.stats.mismatches) == (1, 0)
    source = render(spec, {**CUDA_CORES, "partition_size": 0}).source
    ignoring, n = re.subn(r"alibi_slopes,\s+sinks,", "alibi_slopes, nullptr,", source)  # the body's Params
    assert n == 1
    ignores = kernel_from_source(spec, ignoring, backend="cpu", archs=[])
    with pytest.raises(kgen.AuditError):
        ignores.audit(rate=1.0, seed=0)(**_args(spec))
