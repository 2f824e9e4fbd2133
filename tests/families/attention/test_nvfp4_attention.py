"""paged_decode and paged_prefill over nvfp4 caches (docs/abi.md, NVFP4 caches): the verifier's matrix on the CPU
backend (data through the reference quantizer, garbage bytes and NaN e4m3 scales in every slot that
must not be read, split-KV, NHD and HND, GQA groups on each side of mma_min_group), the golden's
exact dequantization, the call's argument errors, and mutants the verifier must reject."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import full_tier_except, inline_provided, inlined_prefill_kernel

import kgen
from kgen.errors import ArgumentError, UnsupportedError
from kgen.families.attention.decode_mma_geometry import uses_tensor_cores
from kgen.families.attention.reference import attention_outputs, real_kv
from kgen.formats import nvfp4
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

EXAMPLE = "specs/llama3_8b_decode_nvfp4.yaml"


def variant(order="NHD", q="bf16", heads=(8, 2), head_dim=64, block=16, **extra):
    return kgen.load_spec(EXAMPLE).with_overrides(
        name=f"nv_dec_{order}_{q}_{heads[0]}x{heads[1]}_{head_dim}_{block}",
        **{"kv_cache.order": order, "dtype.q": q, "dtype.out": q, "attention.num_q_heads": heads[0],
           "attention.num_kv_heads": heads[1], "attention.head_dim": head_dim, "kv_cache.block_size": block},
        **extra)


# (order, q, (q heads, kv heads), head_dim, block, config): both bodies (auto mma_min_group is 2 for nvfp4:
# tensor cores from GQA 2), fp16 and bf16 MMA operands, MQA, GQA 16 (two MMA row halves), head_dim with a
# half span of 32 (96), split and single-pass.
MATRIX = [
    ("NHD", "fp16", (8, 2), 64, 16, {"partition_size": 64}),
    ("HND", "bf16", (32, 2), 96, 8, {"partition_size": 0}),
    ("NHD", "bf16", (8, 8), 128, 8, {"partition_size": 0}),
    ("HND", "fp16", (16, 2), 32, 32, {"partition_size": 64, "threads": 64, "mma_min_group": 0}),
]


# The 8x8 d128 row (~23 s) is the full tier's; the other rows cover both bodies, layouts and q dtypes by default.
@pytest.mark.parametrize("combo", full_tier_except(MATRIX, {0, 1, 3}, single=True), ids=lambda c: f"{c[0]}-{c[1]}-{c[2][0]}x{c[2][1]}-d{c[3]}-b{c[4]}")
def test_decode_matrix_passes(combo):
    *shape, config = combo
    spec = variant(*shape)
    kern = kgen.build(spec, backend="cpu", config=config, archs=[], seed=11)
    assert kern.report.passed, kern.report.summary()
    names = {c.name for c in kern.report.cases}
    assert {"len_B-1", "long_32k", "padded_pool", "huge_pool", "shared_prefix"} <= names
    if config["partition_size"]:
        assert kern.kernel_names[-1].endswith("_merge") and "len_P+1" in names
    body = "paged_decode_mma_body" if spec.group_size >= 2 and config.get("mma_min_group", -1) else "paged_decode_body"
    assert f"kgen::{body}<Cfg>" in kern.source


def test_tensor_cores_from_gqa_2_by_default():
    config = {"partition_size": 0, "threads": 128, "stages": 0, "heads_per_thread": 0, "mma_min_group": -1}
    assert not uses_tensor_cores(variant(heads=(8, 8)), config)
    assert uses_tensor_cores(variant(heads=(8, 4)), config)
    assert not uses_tensor_cores(variant(heads=(8, 4)), {**config, "mma_min_group": 0})


def _pool(rng, spec, N, ts):
    a, kv = spec.attention, spec.kv_cache
    real = rng.normal(0, 1, (N, kv.block_size, a.num_kv_heads, a.head_dim))
    packed, scales = nvfp4.quantize(real, ts)
    if kv.order == "HND":
        packed, scales = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (packed, scales))
    return packed, scales


@pytest.fixture(scope="module", params=[0, 2], ids=["cuda_cores", "tensor_cores"])
def small(request):
    spec = variant()
    return spec, kgen.build(spec, backend="cpu", config={"partition_size": 0, "mma_min_group": request.param},
                            verify=False, archs=[])


def _call(spec, rng, N=6):
    a = spec.attention
    k, ks = _pool(rng, spec, N, 0.01)
    v, vs = _pool(rng, spec, N, 0.02)
    return dict(q=rng.normal(0, 1, (2, a.num_q_heads, a.head_dim)).astype(ml_dtypes.bfloat16), k_cache=k, v_cache=v,
                k_scale=ks, v_scale=vs, k_tensor_scale=0.01, v_tensor_scale=np.float32(0.02),
                block_tables=np.array([[4, 1, 0], [2, 5, 3]], np.int32), seq_lens=np.array([37, 20], np.int32))


def test_golden_dequantizes_exactly(small):
    spec, _ = small
    args = _call(spec, np.random.default_rng(1))
    (k, v), _ = real_kv(spec, args)  # sequence 0: blocks 4, 1, 0 (37 tokens)
    ks = nvfp4.dequantize(args["k_cache"], args["k_scale"], 0.01)  # [N, B, H, D] (NHD)
    expect = ks[[4, 1, 0]].reshape(-1, 2, 64)[:37].transpose(1, 0, 2)
    assert np.array_equal(k, expect)
    vs = nvfp4.dequantize(args["v_cache"], args["v_scale"], np.float32(0.02))
    assert np.array_equal(v, vs[[4, 1, 0]].reshape(-1, 2, 64)[:37].transpose(1, 0, 2))


def test_garbage_and_nan_scales_past_the_lengths_change_nothing(small):
    spec, kern = small
    rng = np.random.default_rng(2)
    args = _call(spec, rng)
    clean = kern(**args).astype(np.float32)
    ref, _ = attention_outputs(spec, args["q"], args)
    assert np.abs(clean - ref).max() < 0.05 * np.abs(ref).max()
    dirty = {k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in args.items()}
    for name in ("k_scale", "v_scale"):
        dirty[name][0, 37 - 32:] = 0x7F  # the tail of sequence 0's last block (block 0, slots 5..15): NaN
        dirty[name][5, 20 - 16:] = 0xFF  # sequence 1's (block 5, slots 4..15)
        dirty[name][3] = 0x7F  # a table entry past sequence 1's blocks: never read
    for name in ("k_cache", "v_cache"):
        dirty[name][0, 5:] = rng.integers(0, 256, dirty[name][0, 5:].shape, dtype=np.uint8)
        dirty[name][3] = rng.integers(0, 256, dirty[name][3].shape, dtype=np.uint8)
    assert np.array_equal(kern(**dirty).astype(np.float32), clean)


@pytest.mark.parametrize(("change", "message"), [
    ({"k_tensor_scale": None}, "k_tensor_scale: required for an nvfp4 cache"),
    ({"v_scale": None}, "v_scale: required for an nvfp4 cache"),
    ({"k_scale": "fp32"}, "k_scale: expected dtype fp8_e4m3, got fp32"),
    ({"v_scale": "wide"}, "v_scale: expected shape [6, 16, 2, 4]"),
    ({"k_cache": "fp16"}, "k_cache: expected dtype nvfp4, got fp16"),
    ({"v_tensor_scale": "vector"}, "v_tensor_scale: expected shape []"),
])
def test_argument_errors_name_what_is_wrong(small, change, message):
    spec, kern = small
    args = _call(spec, np.random.default_rng(3))
    for name, how in change.items():
        if how is None:
            args.pop(name)
        elif how == "fp32":
            args[name] = args[name].astype(np.float32)
        elif how == "wide":
            args[name] = np.zeros((*args[name].shape[:-1], 8), np.uint8)
        elif how == "fp16":
            args[name] = np.zeros(args[name].shape, np.float16)
        elif how == "vector":
            args[name] = np.ones(2, np.float32)
    with pytest.raises(ArgumentError) as err:
        kern(**args)
    assert message in str(err.value)


def test_misaligned_block_scale_rows_are_refused(small):
    spec, kern = small
    args = _call(spec, np.random.default_rng(4))
    wide = np.zeros((*args["k_scale"].shape[:-1], 6), np.uint8)
    wide[..., :4] = args["k_scale"]
    args["k_scale"] = wide[..., :4]  # rows of 4 bytes 6 apart: the 4-byte copies would straddle them
    with pytest.raises(ArgumentError, match="k_scale: each row of block scales is copied 4 bytes at a time"):
        kern(**args)


def test_mla_stays_refused_with_the_reason():
    mla = kgen.load_spec(EXAMPLE).with_overrides(
        **{"attention.num_q_heads": 16, "attention.num_kv_heads": 1, "attention.head_dim": 576,
           "attention.v_head_dim": 512, "attention.softmax_scale": 0.0722, "kv_cache.layout": "mla",
           "kv_cache.order": None})
    with pytest.raises(UnsupportedError, match="nvfp4 caches in the mla layout are not built yet"):
        kgen.build(mla, backend="cpu", verify=False, archs=[])


# mutants of the rendered source the verifier must reject: (mma_min_group, old, new)
MUTANTS = [
    # CUDA cores: the block-scale copies read past the sequence: the tails' NaN scales reach the V weights
    (0, "[&](int t) { return t >= lo && t < hi; }", "[&](int t) { return t >= lo && t < hi + 8; }"),
    # CUDA cores: every element of a row scaled by its first group's scale (attention/kv_format.cuh)
    (0, "scales[t * (W / 16) + x / 16]", "scales[t * (W / 16)]"),
    # CUDA cores: V dequantized with K's block scales
    (0, "kv_staged_chunk<Cfg, VEC, DV>(vs, fs + NT * S::GROUPS,", "kv_staged_chunk<Cfg, VEC, DV>(vs, fs,"),
    # tensor cores: the same over-read of the tail's block scales
    (2, "return tbase + t >= tok_begin && tbase + t < tok_end; }",
     "return tbase + t >= tok_begin && tbase + t < tok_end + 8; }"),
    # tensor cores: K's elements 8t .. 8t + 7 given the span's first group whatever t
    (2, "ks_l = ks_w + g * S::GROUPS + (t >> 1);", "ks_l = ks_w + g * S::GROUPS;"),
    # tensor cores: V's nibble j taken from the wrong end of the byte pair (attention/kv_format.cuh)
    (2, "fp4_place(w << (12 - 4 * j))", "fp4_place(w << (4 * j))"),
    # tensor cores: V's columns 4g .. 4g + 3 given the 32-column half's first group whatever g
    (2, "vs_l = vs_w + 2 * t * S::GROUPS + (g >> 2);", "vs_l = vs_w + 2 * t * S::GROUPS;"),
]


# By default one mutant of each body (CUDA cores: the tail's scales; tensor cores: V's nibble order).
@pytest.mark.parametrize(("mma", "old", "new"), full_tier_except(MUTANTS, {0, 5}),
                         ids=["tail_scales", "first_group_only", "v_with_k_scales", "mma_tail_scales", "mma_k_group",
                              "mma_v_nibble", "mma_v_group"])
def test_mutants_fail_verification(mma, old, new):
    spec = variant(q="fp16", block=8)
    rendered = render(spec, {"partition_size": 0, "mma_min_group": mma})
    # the body and the KV-format part as kernel code (provided headers)
    source = inline_provided(inline_provided(rendered.source), "kgen/attention/kv_format.cuh")
    assert source.count(old) == 1, old
    mutant = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config,
                                archs=[])
    assert not verify(mutant, seed=5).passed


def test_torch_op_takes_uint8_pools_and_float_tensor_scales(small):
    torch = pytest.importorskip("torch")
    spec, built = small
    spec = spec.with_overrides(name=f"{spec.name}_torch_{built.config['mma_min_group']}")  # one op per body
    kern = kgen.build(spec, backend="cpu", config=built.config, verify=False, archs=[])
    args = _call(spec, np.random.default_rng(6))
    expect = kern(**args)
    op = getattr(torch.ops.kgen, spec.name)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in args.items() if isinstance(v, np.ndarray) and k != "q"}
    q = torch.from_numpy(args["q"].view(np.uint16).copy()).view(torch.bfloat16)
    got = op(q, t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], t["k_scale"], t["v_scale"], 0.01,
             0.02)
    assert np.array_equal(got.view(torch.uint16).numpy(), expect.view(np.uint16))


# ---- paged_prefill (the stage path: nibbles and block scales staged, one dequantizing pass) ----------
PREFILL = "specs/llama3_8b_prefill.yaml"


def prefill_variant(order="NHD", q="fp16", heads=(8, 2), head_dim=64, block=16, **extra):
    return kgen.load_spec(PREFILL).with_overrides(
        name=f"nv_pre_{order}_{q}_{heads[0]}x{heads[1]}_{head_dim}_{block}",
        **{"kv_cache.dtype": "nvfp4", "kv_cache.scale": "none", "kv_cache.order": order, "dtype.q": q,
           "dtype.out": q, "attention.num_q_heads": heads[0], "attention.num_kv_heads": heads[1],
           "attention.head_dim": head_dim, "kv_cache.block_size": block}, **extra)


# (order, q, heads, head_dim, block, config): GQA 4 and 8, MHA, MQA; split-KV and single-pass; 16-byte
# loads (32 elements: two scale groups); block-scale rows of 8, 4, 2 and 6 bytes (head_dim 96: copied
# a byte at a time); one to three stages.
PREFILL_MATRIX = [
    ("NHD", "fp16", (8, 2), 64, 16, {"partition_size": 64}),
    ("HND", "bf16", (16, 2), 128, 8, {"partition_size": 0, "stages": 1}),
    ("NHD", "bf16", (4, 4), 32, 32, {"partition_size": 64, "kv_tile": 16, "stages": 3}),
    ("HND", "fp16", (8, 1), 96, 16, {"partition_size": 64, "warps": 2}),
]


@pytest.mark.parametrize("combo", PREFILL_MATRIX, ids=lambda c: f"{c[0]}-{c[1]}-{c[2][0]}x{c[2][1]}-d{c[3]}-b{c[4]}")
def test_prefill_matrix_passes(combo):
    *shape, config = combo
    spec = prefill_variant(*shape)
    kern = kgen.build(spec, backend="cpu", config=config, archs=[], seed=12)
    assert kern.report.passed, kern.report.summary()
    names = {c.name for c in kern.report.cases}
    assert {"chunk_1", "chunk_150", "small_chunk_long_prefix", "padded_pool", "shared_prefix",
            "decode_equivalence"} <= names
    if config["partition_size"]:
        assert kern.kernel_names[-1].endswith("_merge") and "split_prefix_3P" in names
    assert "static constexpr int KV_PATH = 1;" in kern.source  # staged, then dequantized


@pytest.fixture(scope="module", params=["NHD", "HND"])
def small_prefill(request):
    spec = prefill_variant(order=request.param)
    return spec, kgen.build(spec, backend="cpu", config={"partition_size": 0}, verify=False, archs=[])


def _prefill_call(spec, rng, N=6):
    """Two causal chunks: 5 query tokens at the end of 37 keys (blocks 4, 1, 0), a whole prompt of 20
    (blocks 2, 5)."""
    a = spec.attention
    k, ks = _pool(rng, spec, N, 0.01)
    v, vs = _pool(rng, spec, N, 0.02)
    return dict(q=rng.normal(0, 1, (25, a.num_q_heads, a.head_dim)).astype(np.float16), k_cache=k, v_cache=v,
                q_indptr=np.array([0, 5, 25], np.int32), block_tables=np.array([[4, 1, 0], [2, 5, 3]], np.int32),
                seq_lens=np.array([37, 20], np.int32), k_scale=ks, v_scale=vs, k_tensor_scale=0.01,
                v_tensor_scale=np.float32(0.02))


def _tail(spec, x, block, first):
    """Slots first.. of one pool block, in either order (HND: slots after the head axis)."""
    return x[block, first:] if spec.kv_cache.order == "NHD" else x[block, :, first:]


def test_prefill_garbage_and_nan_scales_past_the_lengths_change_nothing(small_prefill):
    spec, kern = small_prefill
    rng = np.random.default_rng(7)
    args = _prefill_call(spec, rng)
    clean = kern(**args).astype(np.float32)
    ref, _ = attention_outputs(spec, args["q"], args)
    assert np.abs(clean - ref).max() < 0.02 * np.abs(ref).max()
    dirty = {k: (x.copy() if isinstance(x, np.ndarray) else x) for k, x in args.items()}
    for name in ("k_scale", "v_scale"):
        _tail(spec, dirty[name], 0, 37 - 32)[...] = 0x7F  # sequence 0's last block past its 37 keys: NaN
        _tail(spec, dirty[name], 5, 20 - 16)[...] = 0xFF  # sequence 1's
        dirty[name][3] = 0x7F  # a table entry past sequence 1's blocks: never read
    for name in ("k_cache", "v_cache"):
        for block, first in ((0, 5), (5, 4), (3, 0)):
            tail = _tail(spec, dirty[name], block, first)
            tail[...] = rng.integers(0, 256, tail.shape, dtype=np.uint8)
    assert np.array_equal(kern(**dirty).astype(np.float32), clean)


def test_prefill_smem_and_raw_tiles_follow_the_bits():
    """prefill.py's shared memory for nvfp4: raw tiles of half a byte an element and a byte of scale per
    16; the template's static_assert checks the same sum at compile time (every build above)."""
    from kgen.families.attention.prefill_geometry import smem_bytes
    spec = prefill_variant(heads=(32, 8), head_dim=128)
    int8 = spec.with_overrides(**{"kv_cache.dtype": "int8", "kv_cache.scale": "per_tensor"})
    raw_fp4, raw_int8, scales = 64 * 128 // 2, 64 * 128, 2 * 64 * 128 // 16
    assert smem_bytes(int8, 4, 64, 2) - smem_bytes(spec, 4, 64, 2) == 2 * 2 * (raw_int8 - raw_fp4) - 2 * scales


# mutants of the prefill source the verifier must reject: (old, new)
PREFILL_MUTANTS = [
    # every element of a row scaled by its first group's scale (attention/kv_format.cuh)
    ("scales[t * (W / 16) + x / 16]", "scales[t * (W / 16)]"),
    # V dequantized with K's block scales
    ("kv_staged_chunk<Cfg, VEC, S::DV>(vs, fs + KT * S::GROUPS, i, d0, vf)",
     "kv_staged_chunk<Cfg, VEC, S::DV>(vs, fs, i, d0, vf)"),
    # the block-scale copies read past the sequence: the tail's NaN scales reach the tiles
    ("[&](int t) { return kv0 + t < kv_end; }", "[&](int t) { return kv0 + t < kv_end + 8; }"),
    # the tensor scale forgotten on K (attention/kv_format.cuh)
    ("s = Scales{*k_scale.tensor * unit,", "s = Scales{unit,"),
    # the nibbles of each byte swapped
    ("kv_staged_chunk<Cfg, VEC, S::D>(ks, fs, i, d0, kf);",
     "kv_staged_chunk<Cfg, VEC, S::D>(ks, fs, i, d0, kf);\n      for (int e = 0; e < VEC; e += 2) { const float x = kf[e]; "
     "kf[e] = kf[e + 1]; kf[e + 1] = x; }"),
]


# The full tier's (~17 s each): the nvfp4 prefill matrix verifies by default, and the decode mutants above
# prove by default that the verifier sees nvfp4 scale bugs.
@pytest.mark.parametrize("mutation", full_tier_except([None, *PREFILL_MUTANTS], set(), single=True),
                         ids=["control", "first_group_only", "v_with_k_scales", "tail_scales", "no_k_tensor_scale",
                              "nibble_order"])
def test_prefill_mutants_fail_verification(mutation):
    # the prefill body is a provided header: the mutants edit a copy inlined into the source
    spec = prefill_variant()
    kernel = inlined_prefill_kernel(spec, {"partition_size": 64}, [mutation] if mutation else [],
                                    parts=("kgen/attention/kv_format.cuh",))
    report = verify(kernel, seed=5)
    assert report.passed == (mutation is None), report.summary()


def test_specs_for_model_with_nvfp4_gives_three_buildable_specs():
    from kgen.families.registry import support_problems
    llama = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "torch_dtype": "bfloat16"}
    specs = kgen.specs_for_model(llama, kv_dtype="nvfp4")
    assert sorted(specs) == ["cache_write", "decode", "prefill"]
    for spec in specs.values():
        assert spec.kv_cache.dtype == "nvfp4" and spec.kv_cache.scale == "none"
        assert support_problems(spec) == [], spec.kind
