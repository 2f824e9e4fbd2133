"""The float64 golden, checked against code written independently of it: an explicit
per-token gather straight from the ABI's index formulas, and torch's
scaled_dot_product_attention in float64 (GQA through enable_gqa, the sliding window as
a boolean mask, ALiBi as an additive bias, the soft cap computed by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kgen
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.reference import (
    attention_outputs,
    attention_reference,
    real_kv,
)

BASE = {
    "kgen": 1, "name": "ref_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 12, "num_kv_heads": 2, "head_dim": 32},
    "kv_cache": {"block_size": 8, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _token(spec, args, seq: int, t: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """Real K and V of one token by the ABI's index formulas (docs/abi.md), one element row at a time."""
    kv = spec.kv_cache
    blk, slot = int(args["block_tables"][seq, t // kv.block_size]), t % kv.block_size
    if kv.layout == "vllm":
        k = np.asarray(args["k_cache"][blk, head, :, slot, :], dtype=np.float64).reshape(-1)
        v = np.asarray(args["v_cache"][blk, head, :, slot], dtype=np.float64)
    else:
        kc, vc = (args["kv_cache"][:, 0], args["kv_cache"][:, 1]) if kv.layout == "fused" else (
            args["k_cache"], args["v_cache"])
        idx = (blk, slot, head) if kv.resolved_order == "NHD" else (blk, head, slot)
        k, v = np.asarray(kc[idx], dtype=np.float64), np.asarray(vc[idx], dtype=np.float64)
    if kv.scale == "none":
        return k, v
    scales = []
    for name in ("k_scale", "v_scale"):
        s = np.asarray(args[name], dtype=np.float64)
        if kv.scale == "per_tensor":
            scales.append(float(s))
        elif kv.scale == "per_head":
            scales.append(s[head])
        else:
            scales.append(s[blk, slot, head] if kv.resolved_order == "NHD" else s[blk, head, slot])
    return k * scales[0], v * scales[1]


@pytest.mark.parametrize("overrides", [
    {},
    {"kv_cache.order": "HND", "kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"},
    {"kv_cache.layout": "fused", "kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"},
    {"kv_cache.layout": "fused", "kv_cache.order": "HND", "kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor"},
    {"kv_cache.layout": "vllm", "kv_cache.order": None, "kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"},
    {"kv_cache.layout": "vllm", "kv_cache.order": None, "kv_cache.dtype": "bf16", "dtype.q": "bf16"},
], ids=["nhd", "hnd-int8-pth", "fused-fp8e4m3-ph", "fused-hnd-fp8e5m2-pt", "vllm-int8-pth", "vllm-bf16"])
def test_gather_matches_per_token_index_formulas(overrides):
    spec = _spec(**overrides)
    for padded in (False, True):
        args = make_decode_case(spec, [13, 1, 8], np.random.default_rng(5), share_prefix=True, padded=padded)
        for i, (k, v) in enumerate(real_kv(spec, args)):
            for t in range(k.shape[1]):
                for h in range(spec.attention.num_kv_heads):
                    kt, vt = _token(spec, args, i, t, h)
                    np.testing.assert_array_equal(k[h, t], kt)
                    np.testing.assert_array_equal(v[h, t], vt)
            assert np.isfinite(k).all() and np.isfinite(v).all()  # no poison reaches the golden


def _torch_decode(spec, q, seqs, alibi):
    """Reference by torch in float64: SDPA where it applies, manual softmax for the soft cap."""
    a = spec.attention
    outs, lses = [], []
    for i, (k, v) in enumerate(seqs):
        L = k.shape[1]
        qt = torch.from_numpy(np.asarray(q[i], dtype=np.float64))[None, :, None, :]  # [1, Hq, 1, D]
        kt, vt = torch.from_numpy(k)[None], torch.from_numpy(v)[None]  # [1, Hkv, L, D]
        pos = torch.arange(L, dtype=torch.float64)
        bias = torch.zeros(a.num_q_heads, 1, L, dtype=torch.float64)
        if a.alibi:
            bias += torch.from_numpy(np.asarray(alibi, np.float64))[:, None, None] * (pos - (L - 1))
        if a.sliding_window:
            bias = bias.masked_fill(pos < L - a.sliding_window, float("-inf"))
        scale = spec.softmax_scale_value
        kr = kt.repeat_interleave(spec.group_size, dim=1)
        scores = (qt @ kr.transpose(-1, -2)) * scale
        if a.logits_soft_cap:
            cap = a.logits_soft_cap
            p = torch.softmax(cap * torch.tanh(scores / cap) + bias, dim=-1)
            o = p @ vt.repeat_interleave(spec.group_size, dim=1)
            lse = torch.logsumexp(cap * torch.tanh(scores / cap) + bias, dim=-1)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias[None], scale=scale, enable_gqa=True)
            lse = torch.logsumexp(scores + bias, dim=-1)
        outs.append(o[0, :, 0].numpy())
        lses.append(lse[0, :, 0].numpy())
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention.num_kv_heads": 1},
    {"attention.num_kv_heads": 12},
    {"attention.sliding_window": 5},
    {"attention.alibi": True, "kv_cache.dtype": "int8", "kv_cache.scale": "per_head"},
    {"attention.logits_soft_cap": 1.5, "attention.softmax_scale": 0.4},
    {"attention.sliding_window": 9, "attention.alibi": True, "attention.logits_soft_cap": 3.0,
     "kv_cache.layout": "vllm", "kv_cache.order": None},
], ids=["gqa6", "mqa", "mha", "window", "alibi-int8", "softcap", "all-vllm"])
def test_reference_matches_torch_sdpa_in_float64(overrides):
    spec = _spec(**overrides)
    args = make_decode_case(spec, [1, 7, 8, 9, 30], np.random.default_rng(11))
    out, lse = attention_outputs(spec, args["q"], args)
    want, want_lse = _torch_decode(spec, args["q"], real_kv(spec, args), args.get("alibi_slopes"))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feature", [{"attention.sliding_window": 5}, {"attention.alibi": True},
                                     {"attention.logits_soft_cap": 1.5}], ids=["window", "alibi", "softcap"])
def test_each_feature_changes_the_reference(feature):
    """Guards the torch comparison above against features that silently do nothing."""
    spec = _spec(**feature)
    args = make_decode_case(spec, [3, 30], np.random.default_rng(4))
    with_f, _ = attention_outputs(spec, args["q"], args)
    without, _ = attention_outputs(_spec(), args["q"], {k: v for k, v in args.items() if k != "alibi_slopes"})
    assert np.max(np.abs(with_f[1] - without[1])) > 1e-3


def test_lowp_reference_is_a_nonzero_yardstick():
    spec = _spec()
    args = make_decode_case(spec, [40], np.random.default_rng(3))
    ref, _ = attention_outputs(spec, args["q"], args)
    low, _ = attention_outputs(spec, args["q"], args, dtype=np.float32, round_to=np.float16)
    err = np.max(np.abs(low - ref))
    assert 0 < err < 1e-2


@pytest.mark.parametrize("overrides", [{}, {"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"},
                                       {"attention.sliding_window": 5}], ids=["fp16", "int8-pth", "window"])
def test_error_magnitudes_bound_what_they_stand_for(overrides):
    """attention_reference's magnitudes are upper bounds of the sums the verifier's floor scales with:
    max_d sum_j p_j |v_jd| and max over visible j of scale * sum_d |q_d k_jd| (docs/verification.md)."""
    spec = _spec(**overrides)
    args = make_decode_case(spec, [1, 9, 30], np.random.default_rng(6))
    ref = attention_reference(spec, args["q"], args)
    G, scale = spec.group_size, spec.softmax_scale_value
    for i, (k, v) in enumerate(real_kv(spec, args)):
        L = k.shape[1]
        visible = np.arange(L) >= (L - spec.attention.sliding_window if spec.attention.sliding_window else 0)
        for h in range(spec.attention.num_q_heads):
            q = np.asarray(args["q"][i, h], np.float64)
            s = np.where(visible, scale * (k[h // G] @ q), -np.inf)
            p = np.exp(s - s.max())
            p /= p.sum()
            exact_mag = np.max(p @ np.abs(v[h // G]))
            exact_logit = np.max(scale * (np.abs(k[h // G][visible]) @ np.abs(q)))
            assert exact_mag <= ref.magnitude[i, h] * (1 + 1e-12) and ref.magnitude[i, h] > 0
            assert exact_logit <= ref.logit_magnitude[i, h] * (1 + 1e-12)
            assert ref.logit_magnitude[i, h] <= np.sqrt(spec.attention.head_dim) * exact_logit + 1e-12

