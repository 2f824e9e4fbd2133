"""Paged prefill over a quantized cache computes on real = stored * scale (docs/abi.md), judged as an
outside checker would: against a float64 computation written here from the ABI alone (gather through
the block table, stored * scale, softmax), with a bound that takes the int8/fp8 inputs as exact.

int8 and fp8 values convert to fp16 and bf16 exactly, so the only roundings a tensor-core prefill
may add to decode's fp32 computation are P's to q's type (for P V) and the output's; its error per
(token, head) row is then within

    u(q) * A + u(out) * max_d |ref| + eps32 * (64 + 4 sqrt(L) + 2 sqrt(D) * Smax) * A

(u = eps / 2, A = max_d sum_j p_j |v_jd|, Smax = max_j scale * sum_d |q_d k_jd|). A kernel that
rounds the dequantized K to q's type adds a logit error of about u(q) * Smax, which the queries
here (4x the unit normal: sharp softmax rows) make larger than that bound (1.2x to 4.3x for every
format below, before the fix). Checked at q_len 1 against the decode kernel of the same spec too,
and over a multi-row chunk. kgen's own verification fails such a kernel too: its yardstick rounds
the stored values, never the dequantized ones, and keeps prefill's logits in fp32, so the LSE
checks (mixed_batch_lse, sharp_rows_lse) see the logit error at 90x to 190x their bound."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import full_tier_except, inlined_prefill_kernel

import kgen
from kgen.families.attention.decode_cases import make_decode_case
from kgen.formats.dtypes import dtype
from kgen.verify.runner import verify

Q_GAIN = 4.0  # queries 4x the unit normal: logits ~N(0, 16), sharp rows
LENS = [150, 37, 1, 65]

BASE = {
    "kgen": 1, "name": "prefill_quant_exact", "kind": "paged_prefill",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "int8", "scale": "per_token_head"},
    "dtype": {"q": "bf16", "out": "bf16"}, "tail_masking": True, "targets": ["sm_90"],
}


def _spec(kind="paged_prefill", **kv):
    d = {**BASE, "kind": kind, "name": f"{BASE['name']}_{kind}", "kv_cache": {**BASE["kv_cache"], **kv}}
    if kv.get("dtype", "int8") != "int8":  # fp8 caches with fp16 queries, as the bundled fp8 spec
        d["dtype"] = {"q": "fp16", "out": "fp16"}
    return kgen.spec_from_dict(d)


# ---- the float64 computation, from docs/abi.md alone ------------------------------------------
def _real(cache, scale, kv, B, blocks, L, H):
    """(real [H, L, D], stored [H, L, D], scale [H, L]) float64 of one sequence: gather the blocks,
    then stored * scale."""
    c = np.asarray(cache)[blocks].astype(np.float64)  # NHD [nb, B, H, D]; HND [nb, H, B, D]
    if kv["order"] == "HND":
        c = c.transpose(0, 2, 1, 3)
    s = np.asarray(scale, dtype=np.float64)
    if kv["scale"] == "per_tensor":
        s = np.full(c.shape[:3], float(s))
    elif kv["scale"] == "per_head":
        s = np.broadcast_to(s[None, None, :], c.shape[:3])
    else:  # per_token_head: NHD [N, B, H], HND [N, H, B]
        s = s[blocks]
        if kv["order"] == "HND":
            s = s.transpose(0, 2, 1)
    c, s = c.reshape(-1, H, c.shape[-1])[:L].transpose(1, 0, 2), s.reshape(-1, H)[:L].T
    return c * s[..., None], c, s


def float64_prefill(spec, args):
    """(out [T, Hq, D], per-row A, Smax and W [T, Hq]) of a causal prefill call, in float64;
    W = keys seen * max_j v_scale_j * max_jd |v_stored_jd| (the reach of an underflow of P V's
    operand: P times V's per-token scales, relative to their largest)."""
    kv = {"order": spec.kv_cache.resolved_order, "scale": spec.kv_cache.scale}
    a, B = spec.attention, spec.kv_cache.block_size
    G, scale = a.num_q_heads // a.num_kv_heads, 1.0 / math.sqrt(a.head_dim)
    q = np.asarray(args["q"]).astype(np.float64)
    out, amag, smax, wide = np.zeros(q.shape), np.zeros(q.shape[:2]), np.zeros(q.shape[:2]), np.zeros(q.shape[:2])
    ind = np.asarray(args["q_indptr"])
    for s, L in enumerate(np.asarray(args["seq_lens"])):
        L = int(L)
        blocks = np.asarray(args["block_tables"])[s, : -(-L // B)]
        k, _, _ = _real(args["k_cache"], args["k_scale"], kv, B, blocks, L, a.num_kv_heads)
        v, v_st, v_sc = _real(args["v_cache"], args["v_scale"], kv, B, blocks, L, a.num_kv_heads)
        for t in range(ind[s], ind[s + 1]):
            pos = L - (ind[s + 1] - ind[s]) + (t - ind[s])  # sees keys 0 .. pos
            for h in range(a.num_q_heads):
                kh, vh = k[h // G, : pos + 1], v[h // G, : pos + 1]
                logits = scale * (kh @ q[t, h])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[t, h] = p @ vh
                amag[t, h] = np.max(p @ np.abs(vh))
                smax[t, h] = np.max(scale * (np.abs(kh) @ np.abs(q[t, h])))
                wide[t, h] = (pos + 1) * np.max(v_sc[h // G, : pos + 1]) * np.max(np.abs(v_st[h // G, : pos + 1]))
    return out, amag, smax, wide


def derived_bound(spec, ref, amag, smax, wide, seq_len_of_row):
    """The module docstring's per-row bound for a kernel whose operands are exact, plus what the
    narrow range of fp16 costs: half its smallest subnormal per output element, and per P V operand
    (times `wide`: P times V's per-token scales relative to their largest may underflow)."""
    u_q = float(ml_dtypes.finfo(dtype(spec.dtype.q).numpy).eps) / 2
    u_out = float(ml_dtypes.finfo(dtype(spec.dtype.resolved_out).numpy).eps) / 2
    eps32 = float(np.finfo(np.float32).eps)
    fp32 = eps32 * (64 + 4 * np.sqrt(seq_len_of_row)[:, None] + 2 * math.sqrt(spec.attention.head_dim) * smax)
    tiny = lambda name: float(ml_dtypes.finfo(dtype(name).numpy).smallest_subnormal) / 2  # noqa: E731
    under = tiny(spec.dtype.resolved_out) + (tiny(spec.dtype.q) * wide if spec.kv_cache.scale == "per_token_head" else 0)
    return u_q * amag + u_out * np.abs(ref).max(axis=2) + fp32 * amag + under


def _case(spec, q_lens, seed):
    args = make_decode_case(spec, LENS, np.random.default_rng(seed))
    T = int(sum(q_lens))
    rng = np.random.default_rng(seed + 1)
    q = Q_GAIN * rng.standard_normal((T, spec.attention.num_q_heads, spec.attention.head_dim))
    args["q"] = q.astype(dtype(spec.dtype.q).numpy)
    args["q_indptr"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args["out"] = np.full(q.shape, np.nan, dtype=dtype(spec.dtype.resolved_out).numpy)
    return args


def _row_errors(spec, args, out):
    """(error, bound) per (token, head) row of one prefill output."""
    ref, amag, smax, wide = float64_prefill(spec, args)
    ind, lens = np.asarray(args["q_indptr"]), np.asarray(args["seq_lens"])
    row_len = np.repeat(lens, np.diff(ind)).astype(np.float64)
    err = np.abs(np.asarray(out).astype(np.float64) - ref).max(axis=2)
    return err, derived_bound(spec, ref, amag, smax, wide, row_len)


def _build(spec, **kw):
    return kgen.build(spec, backend="cpu", archs=[], verify=False, **kw)


FORMATS = [(d, s, o) for d in ("int8", "fp8_e4m3") for s in ("per_tensor", "per_head", "per_token_head")
           for o in ("NHD", "HND")] + [("fp8_e5m2", "per_token_head", "HND")]


# By default each scale mode once (int8 and fp8 alternate); every format and order in the full tier.
@pytest.mark.parametrize("cache,scale,order", full_tier_except(FORMATS, {0, 9, 12}), ids=["-".join(f) for f in FORMATS])
def test_prefill_over_a_quantized_cache_is_as_exact_as_decode(cache, scale, order):
    kv = {"dtype": cache, "scale": scale, "order": order}
    prefill, decode = _build(_spec(**kv)), _build(_spec("paged_decode", **kv))
    # q_len 1 everywhere: the decode kernel's rows
    args = _case(prefill.spec, [1] * len(LENS), seed=11)
    p_out = prefill(**args)
    d_args = {k: v for k, v in args.items() if k != "q_indptr"}
    d_out = decode(**dict(d_args, out=np.full_like(args["out"], np.nan)))
    p_err, bound = _row_errors(prefill.spec, args, p_out)
    d_err, _ = _row_errors(prefill.spec, args, d_out)
    assert np.all(d_err <= bound), f"decode: worst error/bound {np.max(d_err / bound):.3g}"
    assert np.all(p_err <= bound), f"prefill at q_len 1: worst error/bound {np.max(p_err / bound):.3g}"
    # a multi-row chunk: a prefix plus a chunk, a whole prompt, a single token, a short chunk
    args = _case(prefill.spec, [20, 37, 1, 5], seed=12)
    p_err, bound = _row_errors(prefill.spec, args, prefill(**args))
    assert np.all(p_err <= bound), f"prefill chunks: worst error/bound {np.max(p_err / bound):.3g}"


@pytest.mark.parametrize("config", [None, {"stages": 1, "kv_tile": 16, "warps": 1, "partition_size": 32}],
                         ids=["default", "split"])
def test_an_int8_per_token_head_prefill_verifies(config):
    kernel = kgen.build(_spec(order="HND"), backend="cpu", archs=[], config=config, seed=21)
    assert kernel.report.passed, kernel.report.summary()


# ---- kgen's own verification catches a prefill that rounds the dequantized values -----------------
# The defect this file was written for, put back into the staged path of a per_token_head cache: K and
# V scaled before their conversion to q's type, and no scale outside the products.
ROUND_DEQUANTIZED = [
    ("      kv_staged_chunk<Cfg, VEC, S::D>(ks, fs, i, d0, kf);\n",
     "      kv_staged_chunk<Cfg, VEC, S::D>(ks, fs, i, d0, kf);\n"
     "      for (int e = 0; e < VEC; ++e) kf[e] *= reinterpret_cast<const float*>(stage + S::SCALES_AT)[i];\n"),
    ("      kv_staged_chunk<Cfg, VEC, S::DV>(vs, fs + KT * S::GROUPS, i, d0, vf);\n",
     "      kv_staged_chunk<Cfg, VEC, S::DV>(vs, fs + KT * S::GROUPS, i, d0, vf);\n"
     "      for (int e = 0; e < VEC; ++e) vf[e] *= reinterpret_cast<const float*>(stage + S::SCALES_AT)[KT + i];\n"),
    ("S::TOKEN_SCALES ? qk_scale * tok_sc[col] : qk_scale", "qk_scale"),  # the logit scale (attention/logits.cuh)
    ("s[j][i] *= tok_sc[S::KT + 8 * j + 2 * t + (i & 1)] * v_inv_ref;", ";"),  # (bf16 q: v_inv_ref is 1)
]


@pytest.mark.full  # ~30 s, two whole verifications; the exactness itself is checked by default above
@pytest.mark.parametrize("mutations", [(), ROUND_DEQUANTIZED], ids=["control", "rounds_dequantized"])
def test_kgen_verify_fails_a_prefill_that_rounds_dequantized_values(mutations):
    spec = _spec(order="HND")
    report = verify(inlined_prefill_kernel(spec, {"partition_size": 0}, mutations), seed=8)
    if not mutations:
        assert report.passed, report.summary()
        return
    assert not report.passed, report.summary()
    # the logit error shows in the LSE, whose yardstick has fp32 logits as the kernel has
    failed = {c.name for c in report.failed_cases}
    assert {"mixed_batch_lse", "sharp_rows_lse"} <= failed, report.summary()


@pytest.mark.parametrize("outlier", [1e-9, 1e4], ids=["tiny", "huge"])
def test_fp16_p_times_per_token_v_scales_survives_an_outlier_scale(outlier):
    """fp16 q: P times V's per-token scales is rounded to fp16, whose range is narrow; one key's V
    scale far from the others (a near-zero row, or an outlier) neither overflows P nor loses the rest."""
    spec = _spec(dtype="int8", order="NHD").with_overrides(**{"dtype.q": "fp16", "dtype.out": "fp16"})
    kernel = _build(spec)
    args = _case(spec, [20, 37, 1, 5], seed=13)
    first = int(np.asarray(args["block_tables"])[1, 0])  # sequence 1's first key, every KV head
    args["v_scale"][first, 0, :] *= np.float32(outlier)
    err, bound = _row_errors(spec, args, kernel(**args))
    assert np.all(err <= bound), f"worst error/bound {np.max(err / bound):.3g}"
