"""MLA decode and prefill over an fp8_ds_mla cache (templates/common/ds_mla_row.cuh read by
templates/common/paged_mla.cuh, docs/mla.md): CPU builds verified against the float64 reference over
rows whose four tiles carry scales of very different magnitudes, with NaN rows past every tail;
source mutants of the row dequantization the verifier must reject; bad input; NVRTC builds for sm_80
and sm_90 without spills; and FlashMLA's FP8 checks (tests/lib.py + tests/quant.py +
tests/kernelkit/compare.py of deepseek-ai/FlashMLA): their inputs (q ~ N(0,1) clamped to +-1, K ~
N(0, 0.1) clamped, NaN past each length, the cache quantized and the reference run on its dequantized
rows), their tolerances (out: abs 1e-3 or rel 2.01/128 per element and cosine difference < 5e-6; LSE:
abs 1e-6 or rel 8.01/65536), the reference re-derived here in float64."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import full_tier_except, inline_provided

import kgen
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import ArgumentError
from kgen.formats import ds_mla
from kgen.quantize import quantize_ds_mla_rows
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

D, DV = 576, 512
BASE = {"kgen": 1, "name": "mla_ds", "kind": "paged_decode", "tail_masking": True, "targets": ["sm_80", "sm_90"],
        "attention": {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": D, "v_head_dim": DV, "softmax_scale": 0.1147},
        "kv_cache": {"block_size": 16, "layout": "mla", "dtype": "fp8_ds_mla"}, "dtype": {"q": "bf16"}}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


_KERNELS: dict = {}


def _kernel(kind="paged_decode", config=None, **overrides):
    key = (kind, tuple(sorted((config or {}).items())), tuple(sorted(overrides.items())))
    if key not in _KERNELS:
        _KERNELS[key] = kgen.build(_spec(kind=kind, **overrides), backend="cpu", verify=False, archs=[], config=config)
    return _KERNELS[key]


@pytest.mark.parametrize("config,overrides", [
    ({}, {}),
    ({"partition_size": 32, "col_warps": 4, "stages": 1}, {"attention.num_q_heads": 32, "kv_cache.block_size": 64}),
], ids=["h16-b16", "h32-b64-c4s1-split"])
def test_decode_verifies_on_cpu(config, overrides):
    report = verify(_kernel(config=config, **overrides), seed=21)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    assert {"len_1", "len_B-1", "len_B", "len_B+1", "long", "shared_prefix", "padded_pool"} <= \
        {c.name for c in report.cases}


@pytest.mark.full  # ~35 s; the prefill body reads the rows by default in test_flashmla_fp8_checks[s_q=2]
def test_prefill_verifies_on_cpu():
    report = verify(_kernel("paged_prefill"), seed=23)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)


MUTANTS = [
    ("the next tile's scale", "row + R::SCALES_AT + (d0 / R::TILE) * 4", "row + R::SCALES_AT + ((d0 / R::TILE + 1) % 4) * 4"),
    ("scales ignored", "__floats2bfloat162_rn(f.x * scale, f.y * scale)", "__floats2bfloat162_rn(f.x, f.y)"),
    ("rope read 16 bytes early", "row + R::ROPE_AT + (d0 - R::LATENT) * 2", "row + R::ROPE_AT - 16 + (d0 - R::LATENT) * 2"),
    ("576 bytes of the row staged", "PER_ROW = S::STORED / 16;", "PER_ROW = S::D / 16;"),
]


# Two mutants (a wrong scale, missing rope bytes) by default, ~12 s each; all four in the full tier.
@pytest.mark.parametrize("old,new", full_tier_except([m[1:] for m in MUTANTS], {0, 3}), ids=[m[0] for m in MUTANTS])
def test_verifier_rejects_mutant(old, new):
    spec = _spec()
    rendered = render(spec)
    source = inline_provided(rendered.source)  # the body as kernel code (a provided header)
    assert source.count(old) == 1, old
    kern = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    assert not verify(kern, seed=99).passed


def _call(rng, S=2, N=4, B=16):
    return {"q": rng.standard_normal((S, 16, D)).astype(ml_dtypes.bfloat16),
            "kv_cache": np.zeros((N, B, ds_mla.ROW_BYTES), np.uint8),
            "block_tables": np.arange(S * 2, dtype=np.int32).reshape(S, 2), "seq_lens": np.full(S, 20, np.int32)}


BAD = [
    (lambda a: a.update(kv_scale=np.ones((4, 16), np.float32)), r"kv_scale: fp8_ds_mla rows carry their own"),
    (lambda a: a.update(kv_cache=np.zeros((4, 16, D), np.uint8)), r"kv_cache: expected shape \[4, 16, 656\]"),
    (lambda a: a.update(kv_cache=np.zeros((4, 16, 664), np.uint8)[:, :, :656]), r"kv_cache: strides .* multiples of 16"),
    (lambda a: a.update(kv_cache=np.zeros((4, 16, 656), np.float16)), r"kv_cache: .*fp8_ds_mla"),
]


@pytest.mark.parametrize("mutate,message", BAD, ids=["kv_scale", "width", "token-stride", "dtype"])
def test_bad_input_is_refused_naming_the_argument(mutate, message):
    args = _call(np.random.default_rng(0))
    mutate(args)
    with pytest.raises(ArgumentError, match=message):
        _kernel()(**args)


@pytest.mark.parametrize("kind,config", [("paged_decode", {}), ("paged_decode", {"row_tiles": 2, "col_warps": 4}),
                                         ("paged_decode", {"partition_size": 64}), ("paged_prefill", {})],
                         ids=["decode", "decode-r2c4", "decode-split", "prefill"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_without_spills(kind, config, arch):
    rendered = render(_spec(kind=kind, **{"attention.num_q_heads": 128, "kv_cache.block_size": 64}), config)
    for name, res in compile_cubin(rendered.source, arch).resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0 and not res.advisories, (name, res)


# ---- FlashMLA's FP8 checks ------------------------------------------------------------------------------
def _allclose(ans, ref, abs_tol, rel_tol) -> bool:
    """kernelkit's check_is_allclose without its cosine part: the same NaN/inf positions, and every
    element within abs_tol or within rel_tol of |ref| + 1e-6."""
    ans, ref = np.asarray(ans, np.float64), np.asarray(ref, np.float64)
    for probe in (np.isnan, np.isposinf, np.isneginf):
        if not np.array_equal(probe(ans), probe(ref)):
            return False
    ok = np.isfinite(ref)
    err = np.abs(ans[ok] - ref[ok])
    return bool(np.all((err < abs_tol) | (err / (np.abs(ref[ok]) + 1e-6) < rel_tol)))


def _cos_diff(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if (y * y).sum() < 1e-12:
        return 0.0
    return 1.0 - 2.0 * float((x * y).sum()) / float((x * x + y * y).sum())


def _attention(q, rows, scale, s_q):
    """float64 attention of q [s_q, h, D] over real rows [L, D], query token i seeing keys 0 .. L - s_q + i."""
    L = rows.shape[0]
    logits = np.einsum("shd,ld->shl", q, rows) * scale
    visible = np.arange(L)[None, :] <= (L - s_q + np.arange(s_q))[:, None]
    logits = np.where(visible[:, None, :], logits, -np.inf)
    m = logits.max(axis=2, keepdims=True)
    e = np.exp(logits - m)
    return np.einsum("shl,ld->shd", e / e.sum(axis=2, keepdims=True), rows[:, :DV]), m[..., 0] + np.log(e.sum(axis=2))


FLASHMLA = [(1, 16), (1, 128), (2, 64)]


@pytest.mark.parametrize("s_q,h_q", FLASHMLA, ids=[f"sq{s}-h{h}" for s, h in FLASHMLA])
def test_flashmla_fp8_checks(s_q, h_q):
    rng = np.random.default_rng(100 * s_q + h_q)
    b, mean_sk, block = 3, 300, 64
    scale = D ** -0.55  # FlashMLA's FP8 tests score with d_qk^-0.55
    seqlens = np.maximum(rng.normal(mean_sk, mean_sk / 2, b).astype(int), s_q)  # varlen, as theirs
    blocks = -(-int(seqlens.max()) // block)
    table = rng.permutation(b * blocks).astype(np.int32).reshape(b, blocks)
    k = np.clip(rng.standard_normal((b * blocks, block, D)) / 10, -1, 1).astype(ml_dtypes.bfloat16)
    pool = quantize_ds_mla_rows(k)
    for i in range(b):  # NaN in every slot past a sequence's length, as their test writes before quantizing
        flat = pool[table[i]].reshape(-1, ds_mla.ROW_BYTES)
        flat[seqlens[i]:] = ds_mla.poison_rows((flat.shape[0] - seqlens[i],))
        pool[table[i]] = flat.reshape(blocks, block, ds_mla.ROW_BYTES)
    q = np.clip(rng.standard_normal((b, s_q, h_q, D)), -1, 1).astype(ml_dtypes.bfloat16)
    call = {"kv_cache": pool, "block_tables": table, "seq_lens": seqlens.astype(np.int32)}
    if s_q == 1:
        out, lse = _kernel(**{"attention.num_q_heads": h_q, "kv_cache.block_size": block,
                              "attention.softmax_scale": scale})(q=q[:, 0], **call, return_lse=True)
        out, lse = np.asarray(out)[:, None], np.asarray(lse)[:, None]
    else:
        kern = _kernel("paged_prefill", **{"attention.num_q_heads": h_q, "kv_cache.block_size": block,
                                           "attention.softmax_scale": scale})
        out, lse = kern(q=q.reshape(b * s_q, h_q, D), q_indptr=(np.arange(b + 1) * s_q).astype(np.int32), **call,
                        return_lse=True)
        out, lse = np.asarray(out).reshape(b, s_q, h_q, DV), np.asarray(lse).reshape(b, s_q, h_q)
    real = ds_mla.dequantize_rows(pool).astype(np.float64)  # their reference reads the dequantized cache
    for i in range(b):
        rows = real[table[i]].reshape(-1, D)[:seqlens[i]]
        want, want_lse = _attention(q[i].astype(np.float64), rows, scale, s_q)
        got = out[i].astype(np.float64)
        assert _allclose(got, want, 1e-3, 2.01 / 128) and _cos_diff(got, want) < 5e-6, i
        assert _allclose(lse[i], want_lse, 1e-6, 8.01 / 65536), i
        assert math.isfinite(float(np.abs(got).sum()))


def test_abi_text_names_the_656_byte_rows_and_no_kv_scale():
    from kgen.abi import abi_text
    text = abi_text(_spec(**{"attention.num_q_heads": 128, "kv_cache.block_size": 64}))
    assert "kv_cache      [num_blocks, 64, 656]  fp8_ds_mla" in text
    assert "const unsigned char* __restrict__ kv_cache" in text
    assert "null (fp8_ds_mla rows carry their own scales)" in text and "four fp32 scales" in text
    assert "dynamic shared memory 99584 bytes" in text
