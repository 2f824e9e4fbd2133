"""Peer tests for sparse mla attention: the checks of FlashMLA's tests/test_flash_mla_sparse_decoding.py
and tests/test_flash_mla_sparse_prefill.py, ported to kgen's ABI and run on the CPU backend.

Inputs are generated their way. Decode: q ~ N(0, 1) clamped to [-1, 1], the latent rows N(0, 1) / 10
clamped to [-1, 1], a shuffled block table, lengths drawn around a mean (some zero in the corner
cases), each query token's indices a random set of distinct positions below its sequence's length
padded with -1, turned into physical slots through the block table; NaN in every slot no query names;
scale d_qk^-0.55. Prefill: q and kv ~ N(0, 1) / 10 plus a random shift, one flat KV array (here a pool
whose slot s is kv row s), distinct indices below s_kv, -1 past it, rows with every entry invalid;
scale 0.5. Their reference is re-derived here in numpy float64 from the same rounded inputs (never
their numbers) and their acceptance criterion applies (kernelkit's check_is_allclose: each element
within the absolute OR the relative tolerance, the same inf/NaN positions, and a cosine difference
bound): decode out abs 1e-3 / rel 2.01/128 / cos 5e-6 and lse abs 1e-6 / rel 8.01/65536; prefill out
abs 8e-4 / rel 3.01/128 / cos 7e-6 and lse abs 1e-6 / rel 2.01/65536.

What differs, by kgen's contract: a row with no valid entry has lse -inf (FlashMLA reports +inf);
FlashMLA's prefill treats any index outside [0, s_kv) as invalid, kgen refuses every entry outside
[-1, num_slots) (checked here); block sizes are powers of two (FlashMLA also tests 61, 69, 576);
attention sinks, topk_length, extra KV scopes and FlashMLA's max_logits output have no kgen
counterpart (topk_length is covered by trailing -1 entries, as its reference does). Sizes are scaled
down for the CPU backend (batch 4 not 74/321; s_q up to 9 not 213); head counts, dims and top-k values
are theirs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import full_tier_except

import kgen
from kgen.errors import ArgumentError

D, DV = 576, 512
BF16 = ml_dtypes.bfloat16


def _spec(kind: str, h_q: int, block: int, topk: int, scale: float):
    return kgen.spec_from_dict({
        "kgen": 1, "name": f"peer_sparse_{kind}_{h_q}_{block}_{topk}", "kind": kind, "tail_masking": True,
        "targets": ["sm_90"], "dtype": {"q": "bf16"},
        "attention": {"num_q_heads": h_q, "num_kv_heads": 1, "head_dim": D, "v_head_dim": DV, "softmax_scale": scale,
                      "sparse_topk": topk},
        "kv_cache": {"block_size": block, "layout": "mla", "dtype": "bf16"}})


_KERNELS: dict = {}


def _kernel(kind, h_q, block, topk, scale, config=None):
    key = (kind, h_q, block, topk, scale, tuple(sorted((config or {}).items())))
    if key not in _KERNELS:
        _KERNELS[key] = kgen.build(_spec(kind, h_q, block, topk, scale), backend="cpu", verify=False, archs=[],
                                   config=config)
    return _KERNELS[key]


def _sparse_attention(q, flat, indices, scale):
    """float64 attention of q [R, h, D] over the rows of flat [slots, D] each indices row [R, topk] names
    (-1 skipped, repeats per occurrence): out [R, h, DV] (0 for a row with none), lse [R, h] (-inf)."""
    valid = indices >= 0
    rows = flat[np.where(valid, indices, 0)].astype(np.float64)  # [R, topk, D]
    rows = np.where(valid[..., None], rows, 0.0)  # the unnamed slots hold NaN
    logits = np.einsum("rhd,rkd->rhk", q.astype(np.float64), rows) * scale
    logits = np.where(valid[:, None, :], logits, -np.inf)
    m = logits.max(axis=2, keepdims=True)
    e = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    denom = e.sum(axis=2, keepdims=True)
    out = np.einsum("rhk,rkd->rhd", e / np.where(denom > 0, denom, 1.0), rows[..., :DV])
    with np.errstate(divide="ignore"):
        lse = (m + np.log(denom))[..., 0]
    return out, lse


def _allclose(name, ans, ref, abs_tol, rel_tol, cos_tol):
    """kernelkit's check_is_allclose, re-derived: inf/NaN at the same places (then zeroed), every
    element within abs_tol or within rel_tol of |ref| + 1e-6, and 1 - 2<a, r> / (|a|^2 + |r|^2) <= cos_tol."""
    a, r = np.asarray(ans, np.float64).copy(), np.asarray(ref, np.float64).copy()
    for mask_of in (lambda x: x == np.inf, lambda x: x == -np.inf, np.isnan):
        ma, mr = mask_of(a), mask_of(r)
        assert np.array_equal(ma, mr), f"{name}: inf/NaN at other places ({int(ma.sum())} vs {int(mr.sum())})"
        a[ma], r[mr] = 0.0, 0.0
    err = np.abs(a - r)
    rel = err / (np.abs(r) + 1e-6)
    bad = (err >= abs_tol) & (rel >= rel_tol)
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, worst abs {err.max():.3g} rel {rel[bad].max():.3g}"
    denom = float((a * a + r * r).sum())
    cos = 0.0 if float((r * r).sum()) < 1e-12 else 1.0 - 2.0 * float((a * r).sum()) / denom
    assert cos <= cos_tol, f"{name}: cosine difference {cos:.3g} > {cos_tol}"


def _randperm_rows(rng, limits, topk, pad=-1):
    """FlashMLA's _randperm_batch: row i a random set of distinct values in [0, limits[i]) (as many as fit
    in topk), the rest `pad`."""
    out = np.full((len(limits), topk), pad, dtype=np.int64)
    for i, n in enumerate(limits):
        take = min(int(n), topk)
        out[i, :take] = rng.permutation(int(n))[:take] if n else []
        rng.shuffle(out[i])  # FlashMLA's rows come sorted by a random key: any order
    return out


# ---- FlashMLA sparse decode: (s_k, topk, block) pairs, h_q 64/128, s_q 1 or 3, varlen ------------------
DECODE = [  # (s_k, topk, block, h_q, s_q, all_invalid, zero_seqlen)
    (512, 64, 2, 64, 1, False, False),
    (512, 64, 64, 128, 3, False, False),
    (200, 64, 64, 64, 3, True, True),  # the corner case: every index invalid, zero lengths
    (300, 64, 2, 64, 1, False, True),  # zero lengths among the batch
    (1024, 576, 2, 64, 1, False, False),
    (2046, 2048, 64, 128, 1, False, False),  # V3.2's top-2048 over a context shorter than it: -1 padding
]


# By default the small top-k rows (both kernels, the corner cases); top-576 and top-2048 (~1-3 min each) in full.
@pytest.mark.parametrize("s_k,topk,block,h_q,s_q,all_invalid,zero_seqlen", full_tier_except(DECODE, {0, 1, 2, 3}),
                         ids=[f"sk{c[0]}-topk{c[1]}-b{c[2]}-h{c[3]}-sq{c[4]}" + ("-invalid" if c[5] else "")
                              + ("-zerolen" if c[6] else "") for c in DECODE])
def test_flashmla_sparse_decoding(s_k, topk, block, h_q, s_q, all_invalid, zero_seqlen):
    rng = np.random.default_rng(s_k + topk + block + h_q + s_q)
    b = 4
    scale = D ** -0.55
    seqlens = np.maximum(rng.normal(s_k, s_k / 2, b).astype(int), s_q)  # FlashMLA: varlen around s_k
    if zero_seqlen:
        seqlens[rng.standard_normal(b) > 0] = 0
    pad = max(-(-int(seqlens.max()) // (4 * block)), 1) * 4 * block
    table = rng.permutation(b * pad // block).astype(np.int32).reshape(b, -1)
    blocked = np.clip(rng.standard_normal((b * pad // block, block, D)) / 10, -1, 1).astype(BF16)
    q = np.clip(rng.standard_normal((b, s_q, h_q, D)), -1, 1).astype(BF16)
    positions = _randperm_rows(rng, np.repeat(seqlens, s_q), topk)  # [b * s_q, topk] logical positions
    if all_invalid:
        positions[:] = -1
    seq_of_row = np.repeat(np.arange(b), s_q)
    indices = np.where(positions >= 0, table[seq_of_row[:, None], np.maximum(positions, 0) // block] * block
                       + np.maximum(positions, 0) % block, -1).astype(np.int32)
    flat = blocked.reshape(-1, D)
    named = np.zeros(flat.shape[0], bool)
    named[indices[indices >= 0]] = True
    flat[~named] = np.nan  # FlashMLA: NaN in every slot no query uses
    kind = "paged_decode" if s_q == 1 else "paged_prefill"
    kern = _kernel(kind, h_q, block, topk, scale)
    call = {"q": q.reshape(b * s_q, h_q, D), "kv_cache": blocked, "indices": indices, "seq_lens": seqlens.astype(np.int32)}
    if s_q > 1:  # several query tokens a sequence, each with its own indices: prefill's packed rows
        call["q_indptr"] = (np.arange(b + 1) * s_q).astype(np.int32)
    out, lse = kern(**call, return_lse=True)
    want, want_lse = _sparse_attention(call["q"], flat, indices, scale)
    _allclose("out", np.asarray(out).astype(np.float32), want.astype(BF16).astype(np.float32), 1e-3, 2.01 / 128, 5e-6)
    _allclose("lse", np.asarray(lse), want_lse, 1e-6, 8.01 / 65536, 1e-7)
    if all_invalid:
        assert np.all(np.asarray(out).astype(np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_flashmla_sparse_decoding_with_split_kv():
    """FlashMLA splits the top-k over SM parts and combines; kgen's split-KV plan partitions the entries."""
    rng = np.random.default_rng(17)
    b, block, h_q, topk, scale = 2, 64, 64, 256, D ** -0.55
    seqlens = np.asarray([700, 150])
    table = rng.permutation(2 * 12).astype(np.int32).reshape(2, 12)
    blocked = np.clip(rng.standard_normal((24, block, D)) / 10, -1, 1).astype(BF16)
    positions = _randperm_rows(rng, seqlens, topk)
    indices = np.where(positions >= 0, table[np.arange(b)[:, None], np.maximum(positions, 0) // block] * block
                       + np.maximum(positions, 0) % block, -1).astype(np.int32)
    flat = blocked.reshape(-1, D)
    named = np.zeros(flat.shape[0], bool)
    named[indices[indices >= 0]] = True
    flat[~named] = np.nan
    q = np.clip(rng.standard_normal((b, h_q, D)), -1, 1).astype(BF16)
    kern = _kernel("paged_decode", h_q, block, topk, scale, {"partition_size": 64})
    plan = kern.plan(seqlens)
    assert plan.sizes["max_partitions"] == 4  # 256 entries in partitions of 64, whatever the lengths
    out, lse = kern(q=q, kv_cache=blocked, indices=indices, seq_lens=seqlens.astype(np.int32), plan=plan,
                    return_lse=True)
    want, want_lse = _sparse_attention(q, flat, indices, scale)
    _allclose("out", np.asarray(out).astype(np.float32), want.astype(BF16).astype(np.float32), 1e-3, 2.01 / 128, 5e-6)
    _allclose("lse", np.asarray(lse), want_lse, 1e-6, 8.01 / 65536, 1e-7)


# ---- FlashMLA sparse prefill: (s_kv, topk) incl. out-of-bound top-k, h_q 64/128, rows all invalid ------
PREFILL = [  # (s_q, s_kv, topk, h_q)
    (5, 128, 128, 64),
    (9, 95, 128, 128),  # s_kv < topk: -1 padding
    (4, 592, 128, 64),
    (3, 153, 256, 128),
    (2, 1840, 256, 64),
    (2, 1521, 512, 128),
]


# By default the top-128 rows (both head counts, padding); the larger top-k in the full tier.
@pytest.mark.parametrize("s_q,s_kv,topk,h_q", full_tier_except(PREFILL, {0, 1, 2}),
                         ids=[f"sq{a}-skv{b}-topk{c}-h{d}" for a, b, c, d in PREFILL])
def test_flashmla_sparse_prefill(s_q, s_kv, topk, h_q):
    rng = np.random.default_rng(s_q * 7 + s_kv + topk + h_q)
    block = 64
    q = np.clip(rng.standard_normal((s_q, h_q, D)) / 10 + (rng.random() - 0.5) / 10, -10, 10).astype(BF16)
    kv = np.clip(rng.standard_normal((s_kv, D)) / 10 + (rng.random() - 0.5) / 10, -10, 10).astype(BF16)
    nb = -(-s_kv // block)
    pool = np.full((nb * block, D), np.nan, dtype=BF16)  # slot s holds kv row s; slots past s_kv poisoned
    pool[:s_kv] = kv
    indices = _randperm_rows(rng, np.full(s_q, s_kv), topk).astype(np.int32)
    indices[rng.standard_normal(s_q) < -1] = -1  # FlashMLA's is_all_indices_invalid rows
    indices[0] = -1  # at least one such row
    named = np.zeros(pool.shape[0], bool)
    named[indices[indices >= 0]] = True
    pool[~named] = np.nan
    kern = _kernel("paged_prefill", h_q, block, topk, 0.5)
    out, lse = kern(q=q, kv_cache=pool.reshape(nb, block, D), indices=indices,
                    q_indptr=np.asarray([0, s_q], np.int32), seq_lens=np.asarray([s_kv], np.int32), return_lse=True)
    want, want_lse = _sparse_attention(q, pool, indices, 0.5)
    _allclose("out", np.asarray(out).astype(np.float32), want, 8e-4, 3.01 / 128, 7e-6)
    _allclose("lse", np.asarray(lse), want_lse, 1e-6, 2.01 / 65536, 1e-7)


@pytest.mark.parametrize("bad", [-2147483648, -123456, -2, 128, 114514, 2147483647])
def test_flashmla_invalid_index_candidates_are_refused(bad):
    """FlashMLA's prefill skips these out-of-range indices; kgen's contract refuses them by name."""
    kern = _kernel("paged_prefill", 64, 64, 128, 0.5)
    indices = np.full((1, 128), -1, np.int32)
    indices[0, 5] = bad
    with pytest.raises(ArgumentError, match=rf"indices\[0, 5\] = {bad}: not a cache slot"):
        kern(q=np.zeros((1, 64, D), BF16), kv_cache=np.zeros((2, 64, D), BF16), indices=indices,
             q_indptr=np.asarray([0, 1], np.int32), seq_lens=np.asarray([128], np.int32))
