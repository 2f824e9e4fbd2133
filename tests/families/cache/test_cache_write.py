"""cache_write: bit-exact stores for every cache dtype, layout and scale mode (run on the CPU
backend and judged by kgen.verify.judge.bitexact against kgen.quantize), argument checks, and
mutants of the rendered source that the verifier must reject."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import inline_provided

import kgen
from kgen.errors import ArgumentError
from kgen.quantize import QMAX, quantize, to_cache_dtype
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

SPEC = "specs/cache_write_fp8_e4m3.yaml"

# (cache dtype, scale, layout, order, input dtype): every dtype, layout, order and scale mode at least once.
COMBOS = [
    ("fp8_e4m3", "per_head", "separate", "NHD", "fp16"),
    ("fp8_e4m3", "per_token_head", "vllm", None, "fp16"),
    ("fp8_e5m2", "per_tensor", "vllm", None, "bf16"),
    ("fp8_e5m2", "per_token_head", "separate", "NHD", "fp32"),
    ("int8", "per_token_head", "fused", "HND", "fp32"),
    ("int8", "per_tensor", "separate", "NHD", "bf16"),
    ("int8", "per_head", "vllm", None, "fp16"),
    ("fp16", "none", "separate", "HND", "fp32"),
    ("fp16", "none", "fused", "NHD", "fp16"),
    ("bf16", "none", "vllm", None, "fp16"),
    ("fp32", "none", "fused", "NHD", "bf16"),
]


def variant(cache: str, scale: str, layout: str, order: str | None, q: str, **extra):
    name = f"cw_{cache}_{scale}_{layout}_{order or 'x'}_{q}"
    return kgen.load_spec(SPEC).with_overrides(
        name=name, kv_cache={"dtype": cache, "scale": scale, "layout": layout, "order": order},
        **{"dtype.q": q, "attention.head_dim": 64, "kv_cache.block_size": 8}, **extra)


@pytest.fixture(scope="module")
def kernels():
    return {combo: kgen.build(variant(*combo), backend="cpu", verify=False, archs=[]) for combo in COMBOS}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(x or "vllm" for x in c))
def test_bit_exact_against_model(kernels, combo):
    report = verify(kernels[combo], seed=1234)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note for c in report.failed_cases)
    names = {c.name for c in report.cases}
    assert {"scattered", "sequence", "edge_values", "all_skipped", "strided_inputs"} <= names


def test_example_spec_builds_verifies_and_has_no_spills():
    kern = kgen.build(kgen.load_spec(SPEC), backend="cpu")
    assert kern.report.passed, kern.report.summary()
    res = kern.resources["sm_90"]["cache_write_fp8_e4m3"]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


def _fp16_call(kern, rng, T=5):
    spec = kern.spec
    H, D, B = spec.attention.num_kv_heads, spec.attention.head_dim, spec.kv_cache.block_size
    N = 4
    cd = ml_dtypes.float8_e4m3fn
    return {
        "key": rng.standard_normal((T, H, D)).astype(np.float16),
        "value": rng.standard_normal((T, H, D)).astype(np.float16),
        "k_cache": np.zeros((N, B, H, D), cd), "v_cache": np.zeros((N, B, H, D), cd),
        "k_scale": rng.uniform(0.005, 0.02, H).astype(np.float32),
        "v_scale": rng.uniform(0.005, 0.02, H).astype(np.float32),
        "slot_mapping": rng.choice(N * B, T, replace=False).astype(np.int32),
    }


@pytest.fixture(scope="module")
def fp8_kernel(kernels):
    return kernels[COMBOS[0]]


def test_torch_tensors_written_in_place_and_skip(fp8_kernel):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    args = _fp16_call(fp8_kernel, rng)
    args["slot_mapping"][1] = -1
    B = fp8_kernel.spec.kv_cache.block_size
    k_bits = torch.from_numpy(args["k_cache"].view(np.uint8).copy())
    call = dict(args, k_cache=k_bits.view(torch.float8_e4m3fn), key=torch.from_numpy(args["key"]))
    assert fp8_kernel(**call) is None
    got = k_bits.numpy().view(ml_dtypes.float8_e4m3fn)
    expected = np.zeros_like(got)
    for t, slot in enumerate(args["slot_mapping"]):
        if slot >= 0:
            expected[slot // B, slot % B] = quantize(args["key"][t], args["k_scale"][:, None], "fp8_e4m3")
    assert np.array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_quantize_model_rules():
    # int8: ties to even, symmetric clamp, NaN -> 0
    x = np.asarray([0.5, 1.5, 2.5, -0.5, -2.5, 300.0, -300.0, np.nan], np.float32)
    assert to_cache_dtype(x, "int8").tolist() == [0, 2, 2, 0, -2, 127, -127, 0]
    # fp8: saturate to the finite range instead of NaN/inf
    for name in ("fp8_e4m3", "fp8_e5m2"):
        big = to_cache_dtype(np.asarray([1e9, -np.inf], np.float32), name).astype(np.float32)
        assert big.tolist() == [QMAX[name], -QMAX[name]]


BAD = [
    (lambda a: a.update(slot_mapping=np.where(np.arange(5) == 2, 10**6, a["slot_mapping"]).astype(np.int32)),
     r"slot_mapping\[2\] = 1000000: not a slot"),
    (lambda a: a["slot_mapping"].__setitem__(0, -2), r"slot_mapping\[0\] = -2"),
    (lambda a: a["slot_mapping"].__setitem__(1, a["slot_mapping"][0]), r"both slot"),
    (lambda a: a.update(key=a["key"][:, :, :-1]), r"key: expected shape"),
    (lambda a: a.update(value=a["value"].astype(np.float32)), r"value: expected dtype fp16"),
    (lambda a: a.update(k_cache=a["k_cache"].view(np.int8)), r"k_cache: expected dtype fp8_e4m3"),
    (lambda a: a.pop("v_scale"), r"v_scale: required for a fp8_e4m3 cache"),
    (lambda a: a["k_scale"].__setitem__(3, 0.0), r"k_scale\[3\] = 0.0: scales must be positive"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].astype(np.int16)), r"slot_mapping: expected dtype int32, got int16"),
    (lambda a: a.update(kv_cache=a["k_cache"]), r"kv_cache: not an argument of layout 'separate'"),
    (lambda a: a.update(out=a["key"]), r"unknown argument\(s\): out"),
]


@pytest.mark.parametrize("mutate,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_refused_naming_the_argument(fp8_kernel, mutate, message):
    args = _fp16_call(fp8_kernel, np.random.default_rng(3))
    before = args["k_cache"].copy()
    mutate(args)
    with pytest.raises(ArgumentError, match=message):
        fp8_kernel(**args)
    assert np.array_equal(args["k_cache"].view(np.uint8), before.view(np.uint8))


def test_scales_given_for_a_float_cache_are_refused(kernels):
    kern = kernels[("fp16", "none", "separate", "HND", "fp32")]
    H, D, B = 8, 64, 8
    args = {"key": np.zeros((2, H, D), np.float32), "value": np.zeros((2, H, D), np.float32),
            "k_cache": np.zeros((2, H, B, D), np.float16), "v_cache": np.zeros((2, H, B, D), np.float16),
            "slot_mapping": np.asarray([0, 1], np.int32), "k_scale": np.ones(H, np.float32)}
    with pytest.raises(ArgumentError, match=r"k_scale: a fp16 cache takes no scales"):
        kern(**args)


# ---- the verifier must be able to fail: mutants of the rendered source ----------------------
MUTANTS = [
    (COMBOS[0], "to_float(src[d]) / scale", "to_float(src[d]) * scale", "scattered"),  # scale applied wrong
    (COMBOS[0], "+ off * k_s_token", "+ (off ^ 1) * k_s_token", "scattered"),  # K slot offset wrong
    (COMBOS[6], "return (i8)__float2int_rn(c);", "return (i8)roundf(c);", "edge_values"),  # ties away from 0
    (COMBOS[2], "__NV_SATFINITE, __NV_E5M2", "__NV_NOSAT, __NV_E5M2", "edge_values"),  # no saturation
    (COMBOS[4], "*pool = scale;", "*pool = scale * 1.0001f;", "scattered"),  # scale pool entry wrong
    (COMBOS[4], "if (!(scale > 0.0f)) scale = 1.0f;", "if (!(scale > 0.0f)) scale = 2.0f;", "edge_values"),
    (COMBOS[7], "row < 2 * H;", "row < 2 * H - 1;", "scattered"),  # last V head never written
]


@pytest.mark.parametrize("combo,old,new,case", MUTANTS, ids=[m[2] for m in MUTANTS])
def test_verifier_rejects_mutant(combo, old, new, case):
    spec = variant(*combo)
    rendered = render(spec)
    source = inline_provided(rendered.source)  # the body as kernel code (a provided header)
    assert source.count(old) == 1, old
    broken = source.replace(old, new)
    kern = kernel_from_source(spec, broken, backend="cpu", config=rendered.config, archs=[])
    report = verify(kern, seed=99)
    assert not report.passed
    failed = {c.name: c for c in report.failed_cases}
    assert case in failed, report.summary()
    assert failed[case].note and failed[case].max_error > 0
    assert "FAILED" in report.summary()


# ---- key and value rows of their own widths (attention.v_head_dim, docs/abi.md) --------------
TWO_WIDTHS = [  # (cache, scale, order, q, head_dim, v_head_dim)
    ("fp16", "none", "NHD", "fp16", 192, 128),
    ("int8", "per_token_head", "HND", "bf16", 64, 96),
    ("fp8_e4m3", "per_head", "NHD", "fp32", 128, 64),
    ("fp8_e5m2", "per_tensor", "HND", "fp16", 32, 40),
]


def two_widths(cache: str, scale: str, order: str, q: str, head_dim: int, v_head_dim: int):
    return variant(cache, scale, "separate", order, q).with_overrides(
        name=f"cw2_{cache}_{scale}_{order}_{head_dim}_{v_head_dim}",
        **{"attention.head_dim": head_dim, "attention.v_head_dim": v_head_dim})


@pytest.mark.parametrize("combo", TWO_WIDTHS, ids=lambda c: "-".join(map(str, c)))
def test_two_widths_bit_exact_against_model(combo):
    """Every byte of both pools (and of the per-token scale pools: one scale per (token, head) of each
    array, from its own row) equals the model's, at two widths."""
    kern = kgen.build(two_widths(*combo), backend="cpu", verify=False, archs=[])
    report = verify(kern, seed=99)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note for c in report.failed_cases)
    assert {c.name for c in report.cases} == {"scattered", "sequence", "single_token", "edge_values", "all_skipped",
                                              "strided_inputs"}


def test_two_widths_value_rows_are_checked_against_v_head_dim():
    kern = kgen.build(two_widths(*TWO_WIDTHS[0]), backend="cpu", verify=False, archs=[])
    rng = np.random.default_rng(2)
    H, B = kern.spec.attention.num_kv_heads, kern.spec.kv_cache.block_size
    args = {"key": rng.standard_normal((3, H, 192)).astype(np.float16),
            "value": rng.standard_normal((3, H, 128)).astype(np.float16),
            "k_cache": np.zeros((2, B, H, 192), np.float16), "v_cache": np.zeros((2, B, H, 128), np.float16),
            "slot_mapping": np.asarray([0, 5, B + 1], np.int32)}
    kern(**args)
    assert np.array_equal(args["v_cache"][0, 5], args["value"][1]) and np.array_equal(args["k_cache"][1, 1],
                                                                                       args["key"][2])
    with pytest.raises(ArgumentError, match=rf"value: expected shape \[3, {H}, 128\]"):
        kern(**{**args, "value": args["key"]})
    with pytest.raises(ArgumentError, match=rf"v_cache: expected shape \[2, {B}, {H}, 128\]"):
        kern(**{**args, "v_cache": args["k_cache"]})
