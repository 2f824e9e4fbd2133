"""Peer tests for the mla layout: the checks of FlashMLA's tests/test_flash_mla.py and of FlashInfer's
MLA tests (tests/attention/test_deepseek_mla.py), ported to kgen's ABI and run on the CPU backend.
Inputs are generated their way (FlashMLA: a contiguous block table, NaN in every slot past a
sequence's length, variable lengths drawn around a mean, s_q 1 or 2 causal query tokens;
FlashInfer: the compressed KV and the rope key as separate tensors, here concatenated into kgen's
one latent row, pages of 1, 16 and 64), their reference attention is re-derived here in numpy
float64 from the same rounded inputs (never their numbers), and their acceptance criteria apply
(FlashMLA: cosine difference < 1e-5 of out and LSE; FlashInfer: allclose rtol = atol = 1e-3).
Sizes are scaled down where the CPU backend needs it (FlashMLA's batch 128 x 4,096 tokens:
batch 3 x ~300 here); head counts, dims and page sizes are theirs."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import full_tier_except

import kgen

D, DV = 576, 512


def _spec(kind: str, h_q: int, block: int, dtype: str, scale: float):
    return kgen.spec_from_dict({
        "kgen": 1, "name": f"peer_{kind}_{h_q}_{block}_{dtype}", "kind": kind, "tail_masking": True,
        "targets": ["sm_90"], "dtype": {"q": dtype},
        "attention": {"num_q_heads": h_q, "num_kv_heads": 1, "head_dim": D, "v_head_dim": DV, "softmax_scale": scale},
        "kv_cache": {"block_size": block, "layout": "mla", "dtype": dtype}})


_KERNELS: dict = {}


def _kernel(kind, h_q, block, dtype, scale, config=None):
    key = (kind, h_q, block, dtype, scale, tuple(sorted((config or {}).items())))
    if key not in _KERNELS:
        _KERNELS[key] = kgen.build(_spec(kind, h_q, block, dtype, scale), backend="cpu", verify=False, archs=[],
                                   config=config)
    return _KERNELS[key]


def _attention(q, rows, scale, s_q):
    """float64 attention of q [s_q, h, D] over rows [L, D] (V = rows[:, :DV]), causal as FlashMLA's
    tril(diagonal = L - s_q): query token i sees keys 0 .. L - s_q + i. Returns out [s_q, h, DV], lse [s_q, h]."""
    L = rows.shape[0]
    logits = np.einsum("shd,ld->shl", q, rows) * scale
    visible = np.arange(L)[None, :] <= (L - s_q + np.arange(s_q))[:, None]  # [s_q, L]
    logits = np.where(visible[:, None, :], logits, -np.inf)
    m = logits.max(axis=2, keepdims=True)
    e = np.exp(logits - m)
    out = np.einsum("shl,ld->shd", e / e.sum(axis=2, keepdims=True), rows[:, :DV])
    return out, (m[..., 0] + np.log(e.sum(axis=2)))


def _cos_diff(x, y) -> float:
    """FlashMLA's cal_diff criterion: 1 - 2 <x, y> / (|x|^2 + |y|^2)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 1.0 - 2.0 * float((x * y).sum()) / max(float((x * x + y * y).sum()), 1e-12)


# ---- FlashMLA: b, s_q 1-2, h_q 16..128, h_kv 1, d 576, dv 512, block 64, varlen, causal ----------------
FLASHMLA = [(1, 16, False), (1, 32, True), (1, 64, True), (1, 128, True), (2, 16, True), (2, 64, False),
            (2, 128, True)]


# By default every other FlashMLA check (both s_q, varlen and fixed lengths); all in the full tier.
@pytest.mark.parametrize("s_q,h_q,varlen", full_tier_except(FLASHMLA, set(range(0, len(FLASHMLA), 2))), ids=[f"sq{s}-h{h}-{'varlen' if v else 'fixed'}" for s, h, v in
                                                           FLASHMLA])
def test_flashmla_checks(s_q, h_q, varlen):
    rng = np.random.default_rng(1000 * s_q + h_q)
    b, mean_sk, block = 3, 300, 64
    scale = 1.0 / math.sqrt(D)  # FlashMLA's test scores with 1/sqrt(d)
    seqlens = np.full(b, mean_sk)
    if varlen:  # FlashMLA: lengths drawn from N(mean, mean / 2), at least s_q
        seqlens = np.maximum(rng.normal(mean_sk, mean_sk / 2, b).astype(int), s_q)
    pad = -(-int(seqlens.max()) // 256) * 256
    table = np.arange(b * pad // block, dtype=np.int32).reshape(b, -1)  # FlashMLA's contiguous block table
    blocked_k = rng.standard_normal((b * pad // block, block, D)).astype(ml_dtypes.bfloat16)
    flat = blocked_k.reshape(b, pad, D)
    for i in range(b):
        flat[i, seqlens[i]:] = np.nan  # FlashMLA poisons every slot past a sequence's length
    q = rng.standard_normal((b, s_q, h_q, D)).astype(ml_dtypes.bfloat16)
    kind = "paged_decode" if s_q == 1 else "paged_prefill"
    kern = _kernel(kind, h_q, block, "bf16", scale)
    call = {"kv_cache": blocked_k, "block_tables": table, "seq_lens": seqlens.astype(np.int32)}
    if s_q == 1:
        out, lse = kern(q=q[:, 0], **call, return_lse=True)
        out, lse = np.asarray(out)[:, None], np.asarray(lse)[:, None]
    else:
        indptr = (np.arange(b + 1) * s_q).astype(np.int32)
        out, lse = kern(q=q.reshape(b * s_q, h_q, D), q_indptr=indptr, **call, return_lse=True)
        out, lse = np.asarray(out).reshape(b, s_q, h_q, DV), np.asarray(lse).reshape(b, s_q, h_q)
    for i in range(b):
        rows = flat[i, :seqlens[i]].astype(np.float64)
        want, want_lse = _attention(q[i].astype(np.float64), rows, scale, s_q)
        assert _cos_diff(out[i].astype(np.float64), want) < 1e-5, i
        assert _cos_diff(lse[i], want_lse) < 1e-5, i


def test_flashmla_check_with_split_kv():
    """FlashMLA splits long contexts over blocks (num_splits); kgen's split-KV plan does the same."""
    rng = np.random.default_rng(7)
    b, block, h_q, scale = 2, 64, 64, 1.0 / math.sqrt(D)
    seqlens = np.asarray([1500, 777])
    table = np.arange(b * 24, dtype=np.int32).reshape(b, 24)
    blocked_k = rng.standard_normal((b * 24, block, D)).astype(ml_dtypes.bfloat16)
    for i in range(b):
        blocked_k.reshape(b, -1, D)[i, seqlens[i]:] = np.nan
    q = rng.standard_normal((b, h_q, D)).astype(ml_dtypes.bfloat16)
    kern = _kernel("paged_decode", h_q, block, "bf16", scale, {"partition_size": 64})
    plan = kern.plan(seqlens)
    assert plan.sizes["max_partitions"] > 1  # the plan does split these
    out, lse = kern(q=q, kv_cache=blocked_k, block_tables=table, seq_lens=seqlens.astype(np.int32), plan=plan,
                    return_lse=True)
    for i in range(b):
        rows = blocked_k.reshape(b, -1, D)[i, :seqlens[i]].astype(np.float64)
        want, want_lse = _attention(q[i][None].astype(np.float64), rows, scale, 1)
        assert _cos_diff(np.asarray(out)[i], want[0]) < 1e-5 and _cos_diff(np.asarray(lse)[i], want_lse[0]) < 1e-5


# ---- FlashInfer: page sizes 1/16/64, batch sizes, kv lengths; ckv and kpe separate ------------------------
FLASHINFER = [(1, 17, 1), (3, 33, 16), (5, 75, 64), (7, 197, 16), (3, 197, 1)]


@pytest.mark.parametrize("causal_chunk", [0, 5], ids=["decode", "prefill-qo5"])
@pytest.mark.parametrize("batch,kv_len,page", FLASHINFER, ids=[f"b{b}-kv{k}-p{p}" for b, k, p in FLASHINFER])
def test_flashinfer_checks(batch, kv_len, page, causal_chunk):
    rng = np.random.default_rng(batch * 1000 + kv_len + page)
    heads = 16
    sm_scale = 1.0 / math.sqrt(128 + 64)  # FlashInfer's test: DeepSeek's qk_nope + qk_rope head dims
    pages_per = -(-kv_len // page)
    n_pages = batch * pages_per
    ckv = (rng.standard_normal((n_pages, page, DV))).astype(np.float16)  # compressed KV
    kpe = (rng.standard_normal((n_pages, page, D - DV))).astype(np.float16)  # rope keys
    pool = np.concatenate([ckv, kpe], axis=2)  # kgen's latent row: ckv then kpe
    indices = rng.permutation(n_pages).astype(np.int32).reshape(batch, pages_per)
    qo = max(causal_chunk, 1)
    q_nope = rng.standard_normal((batch * qo, heads, DV)).astype(np.float16)
    q_pe = rng.standard_normal((batch * qo, heads, D - DV)).astype(np.float16)
    q = np.concatenate([q_nope, q_pe], axis=2)
    lens = np.full(batch, kv_len, dtype=np.int32)
    kind = "paged_prefill" if causal_chunk else "paged_decode"
    kern = _kernel(kind, heads, page, "fp16", sm_scale)
    call = {"q": q, "kv_cache": pool, "block_tables": indices, "seq_lens": lens, "return_lse": True}
    if causal_chunk:
        call["q_indptr"] = (np.arange(batch + 1) * qo).astype(np.int32)
    out, lse = (np.asarray(x) for x in kern(**call))
    for i in range(batch):
        rows_ckv = ckv[indices[i]].reshape(-1, DV)[:kv_len].astype(np.float64)
        rows_kpe = kpe[indices[i]].reshape(-1, D - DV)[:kv_len].astype(np.float64)
        qn = q_nope[i * qo:(i + 1) * qo].astype(np.float64)
        qp = q_pe[i * qo:(i + 1) * qo].astype(np.float64)
        # FlashInfer's reference: logits = (q_nope ckv^T + q_pe kpe^T) * sm_scale, causal, out = p ckv
        logits = (np.einsum("shd,ld->shl", qn, rows_ckv) + np.einsum("shd,ld->shl", qp, rows_kpe)) * sm_scale
        visible = np.arange(kv_len)[None, :] <= (kv_len - qo + np.arange(qo))[:, None]
        logits = np.where(visible[:, None, :], logits, -np.inf)
        m = logits.max(axis=2, keepdims=True)
        e = np.exp(logits - m)
        want = np.einsum("shl,ld->shd", e / e.sum(axis=2, keepdims=True), rows_ckv)
        want_lse = m[..., 0] + np.log(e.sum(axis=2))
        np.testing.assert_allclose(out[i * qo:(i + 1) * qo].astype(np.float64), want, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(lse[i * qo:(i + 1) * qo], want_lse, rtol=1e-3, atol=1e-3)
