"""The decode family's tensor-core body (templates/common/paged_decode_mma.cuh, docs/decode-family.md
"Tensor cores for grouped query heads"): real CPU builds verified by kgen's own verifier against the
float64 reference over dtypes, scales, layouts and the attention features; which body a config
renders (and the fallbacks, named in the notes); NVRTC compiles for sm_80 and sm_90 without spills."""

from __future__ import annotations

import pytest
from conftest import full_tier_except

import kgen
from kgen.abi import abi_text
from kgen.compile.nvrtc import compile_cubin
from kgen.families.attention.decode import PAGED_DECODE
from kgen.families.attention.decode_mma_geometry import mma_geometry, mma_unsupported
from kgen.families.base import resolve_config
from kgen.render import render

BASE = {
    "kgen": 1, "name": "tc_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _tensor_cores(spec, config=None) -> bool:
    src = render(spec, config).source
    assert ("TENSOR_CORES = true;" in src) != ("TENSOR_CORES = false;" in src)
    return "TENSOR_CORES = true;" in src


MATRIX = [
    ({}, {}),
    ({}, {"partition_size": 32}),
    ({"attention.num_q_heads": 6, "dtype.q": "bf16", "kv_cache.dtype": "bf16", "attention.head_dim": 128,
      "attention.sliding_window": 40, "attention.alibi": True, "attention.logits_soft_cap": 3.0,
      "attention.softmax_scale": 0.3}, {"mma_min_group": 1}),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"}, {}),
    ({"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_head", "dtype.q": "bf16"}, {"partition_size": 32}),
    ({"kv_cache.dtype": "int8", "kv_cache.scale": "per_head", "attention.head_dim": 80}, {}),
    ({"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"}, {}),
    ({"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "dtype.q": "bf16", "attention.head_dim": 48},
     {"partition_size": 32}),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head", "attention.alibi": True,
      "attention.sliding_window": 40}, {"partition_size": 32}),
    ({"kv_cache.layout": "fused"}, {"stages": 1}),
    ({"kv_cache.order": "HND", "kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor"}, {"threads": 128}),
    ({"tail_masking": False, "attention.sliding_window": 20}, {"partition_size": 48}),
    ({"attention.num_q_heads": 16, "attention.num_kv_heads": 1, "attention.head_dim": 32}, {}),  # 16 rows, no padding
    ({"attention.num_q_heads": 2, "attention.num_kv_heads": 2}, {"mma_min_group": 1}),  # one head, 15 padded rows
]


# By default every third row (0, 3, 6, ...); every row in the full tier.
@pytest.mark.parametrize("overrides,config", full_tier_except(MATRIX, set(range(0, len(MATRIX), 3))),
                         ids=[str(i) for i in range(len(MATRIX))])
def test_tensor_core_body_verifies(overrides, config):
    spec = _spec(**overrides)
    config = {"mma_min_group": 1, **config}  # the tensor-core body for every row (auto would leave fp16 group 4)
    assert _tensor_cores(spec, config)
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], verify=True, seed=19)
    assert kernel.report.passed, kernel.report.summary()


@pytest.mark.parametrize("overrides,config,why", [
    ({}, {"mma_min_group": 0}, "mma_min_group 0"),
    ({}, {"mma_min_group": 5}, "group 4 < mma_min_group 5"),
    ({"dtype.q": "fp32", "kv_cache.dtype": "fp32"}, {"mma_min_group": 1}, "q is fp32"),
    ({"kv_cache.dtype": "fp32"}, {}, "fp32 cache"),
    ({"kv_cache.layout": "vllm", "kv_cache.order": None}, {}, "vLLM layout"),
    ({"attention.head_dim": 72}, {}, "head_dim 72"),
    ({"attention.head_dim": 512}, {}, "head_dim 512"),
    ({"attention.num_q_heads": 32, "attention.num_kv_heads": 1}, {}, "GQA group 32"),
    ({"targets": ["sm_75", "sm_90"]}, {}, "target sm_75"),
])
def test_unsupported_combos_fall_back_and_say_so(overrides, config, why):
    spec = _spec(**overrides)
    src = render(spec, config, spec.targets[0]).source  # the oldest target's body (sm_75: no mma.sync there)
    assert "TENSOR_CORES = false;" in src and "paged_decode_mma_body<" not in src
    note = next(line for line in src.splitlines() if "// Body:" in line)
    assert "CUDA cores" in note and why in note, note


def test_threshold_picks_the_body_and_the_notes_name_it():
    spec = _spec()  # group 4, fp16 cache
    assert _tensor_cores(spec, {"mma_min_group": 4}) and _tensor_cores(spec, {"mma_min_group": 1})
    assert not _tensor_cores(spec, {"mma_min_group": 8}) and not _tensor_cores(spec, {"mma_min_group": 0})
    # auto (the default, -1): from 8 heads for a 16-bit cache, from 4 for an 8-bit one
    assert not _tensor_cores(spec) and "group 4 < mma_min_group 8 (auto)" in abi_text(spec)
    group8 = _spec(**{"attention.num_q_heads": 16})
    assert _tensor_cores(group8) and "Body: tensor cores" in abi_text(group8)
    fp8 = _spec(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"})
    assert _tensor_cores(fp8)
    assert not _tensor_cores(_spec(**{"attention.num_q_heads": 6, "attention.num_kv_heads": 2,
                                      "kv_cache.dtype": "int8", "kv_cache.scale": "per_head"}))  # group 3 < 4
    assert "Body: CUDA cores" in abi_text(_spec(**{"dtype.q": "fp32", "kv_cache.dtype": "fp32"}))
    assert mma_unsupported(spec) is None
    assert PAGED_DECODE.default_space(spec)["mma_min_group"] == [0, 4]
    assert "mma_min_group" not in PAGED_DECODE.default_space(_spec(**{"attention.num_q_heads": 4}))  # group 2


def test_same_kernels_and_grid_as_the_cuda_core_body():
    spec = _spec()
    for P in (0, 64):
        tc = PAGED_DECODE.kernels(spec, resolve_config(PAGED_DECODE, spec, {"partition_size": P, "mma_min_group": 4}))
        cc = PAGED_DECODE.kernels(spec, resolve_config(PAGED_DECODE, spec, {"partition_size": P, "mma_min_group": 0}))
        assert [(k.name, k.params, k.grid, k.smem) for k in tc] == [(k.name, k.params, k.grid, k.smem) for k in cc]


def test_geometry_fits_static_shared_memory_and_refuses_too_many_stages():
    spec = _spec(**{"attention.head_dim": 256})
    geo, problems = mma_geometry(spec, resolve_config(PAGED_DECODE, spec, {"threads": 256, "mma_min_group": 4}))
    assert not problems and geo.stages >= 2 and geo.smem_bytes <= 48 * 1024
    problems = PAGED_DECODE.check_config(spec, resolve_config(PAGED_DECODE, spec, {"stages": 4, "mma_min_group": 4}))
    assert problems and "shared memory" in problems[0]
    assert not PAGED_DECODE.check_config(spec, resolve_config(PAGED_DECODE, spec, {"mma_min_group": -1}))  # auto
    assert PAGED_DECODE.check_config(spec, resolve_config(PAGED_DECODE, spec, {"mma_min_group": -2}))


@pytest.mark.parametrize("overrides", [
    {"attention.head_dim": 128},
    {"attention.head_dim": 128, "kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"},
    {"attention.head_dim": 128, "kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"},
    {"attention.head_dim": 256, "dtype.q": "bf16", "kv_cache.dtype": "bf16", "attention.sliding_window": 64},
    {"attention.head_dim": 112, "attention.num_q_heads": 32, "attention.num_kv_heads": 2,
     "kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor"},
], ids=["fp16-128", "fp8-128", "int8-token-128", "bf16-256-window", "fp8e5m2-112-g16"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_without_spills(overrides, arch):
    spec = _spec(**overrides)
    rendered = render(spec, {"partition_size": 64, "mma_min_group": 1})
    assert "TENSOR_CORES = true;" in rendered.source
    res = compile_cubin(rendered.source, arch).resources[spec.name]
    assert res.spill_stores == res.spill_loads == res.stack_frame == 0, res


def test_negative_dequant_scale_keeps_the_largest_logit():
    """Where the body folds the softmax scale into exp2 it takes a row's max on raw q . k products,
    which is right only for a positive scale: a runtime K scale may be negative (it flips which
    product is the largest), so it stays out of that fold. Negating a head's K scale is the same
    attention as negating its group's queries; the float64 reference checks the result itself."""
    import numpy as np

    from kgen.families.attention.decode_cases import (
        attention_references,
        make_decode_case,
    )

    spec = _spec(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"})
    config = {"mma_min_group": 1, "partition_size": 0}
    assert _tensor_cores(spec, config)
    kern = kgen.build(spec, backend="cpu", config=config, verify=False, archs=[])
    args = make_decode_case(spec, [37, 20], np.random.default_rng(5))
    G = spec.attention.num_q_heads // spec.attention.num_kv_heads
    neg_scale = {**args, "k_scale": args["k_scale"] * np.float32([-1.0, 1.0])}  # KV head 0's K scale < 0
    q = args["q"].copy()
    q[:, :G] = -q[:, :G]  # KV head 0's queries negated instead
    neg_q = {**args, "q": q}
    got = kern(**{k: v.copy() for k, v in neg_scale.items()}).astype(np.float64)
    same = kern(**{k: v.copy() for k, v in neg_q.items()}).astype(np.float64)
    plain = kern(**{k: v.copy() for k, v in args.items()}).astype(np.float64)
    np.testing.assert_array_equal(got, same)
    assert not np.allclose(got[:, :G], plain[:, :G], atol=1e-2)  # the sign mattered
    ref, _ = attention_references(spec, neg_scale)
    np.testing.assert_allclose(got, ref.out, atol=2e-2, rtol=2e-2)
