"""Every paged-prefill variant at q_len 1 gives the decode kernel's numbers for the same spec and
inputs, and both agree with a small float64 computation written here from docs/abi.md (the kernel ABI) alone
(real = stored * scale, the ABI's cache and scale shapes), not from kgen's own reference.

The cases are small (4 query heads over 2 KV heads, head_dim 32, blocks of 8), so every cache
dtype x scale x order x layout runs in seconds on the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import full_tier_except

import kgen
from kgen.families.attention.decode_cases import make_decode_case

FLOAT = ("fp16", "bf16", "fp32")
QUANT = ("fp8_e4m3", "fp8_e5m2", "int8")
SCALES = ("per_tensor", "per_head", "per_token_head")
VARIANTS = [(dt, "none") for dt in FLOAT] + [(dt, sc) for dt in QUANT for sc in SCALES]
HQ, HKV, D, B = 4, 2, 32, 8
LENS = [1, B - 1, B + 1, 3 * B + 5, 70]


def _spec(kind: str, dt: str, scale: str, layout: str, order: str, q: str = "fp16"):
    kv = {"block_size": B, "layout": layout, "dtype": dt, "scale": scale}
    if layout != "vllm":
        kv["order"] = order
    return kgen.spec_from_dict({
        "kgen": 1, "name": f"eq_{kind}", "kind": kind,
        "attention": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D},
        "kv_cache": kv, "dtype": {"q": q}, "tail_masking": True, "targets": ["sm_90"]})


def _real(args: dict, which: str, scale_mode: str, layout: str, order: str, seq: int, n: int) -> np.ndarray:
    """[n, HKV, D] float64 real values of one sequence's K or V, read per docs/abi.md (the kernel ABI)."""
    table = np.asarray(args["block_tables"])[seq]
    if layout == "fused":
        pool = np.asarray(args["kv_cache"])[:, 0 if which == "k" else 1]
    else:
        pool = np.asarray(args[f"{which}_cache"])
    pool = pool.astype(np.float64)
    scale = None if scale_mode == "none" else np.asarray(args[f"{which}_scale"], dtype=np.float64)
    out = np.zeros((n, HKV, D))
    for t in range(n):
        blk, slot = int(table[t // B]), t % B
        for h in range(HKV):
            if layout == "vllm" and which == "k":  # [N, H, D/x, B, x]
                row = pool[blk, h, :, slot, :].reshape(-1)
            elif layout == "vllm":  # [N, H, D, B]
                row = pool[blk, h, :, slot]
            elif order == "NHD":
                row = pool[blk, slot, h]
            else:
                row = pool[blk, h, slot]
            if scale_mode == "per_tensor":
                s = float(scale.reshape(-1)[0])
            elif scale_mode == "per_head":
                s = scale[h]
            elif scale_mode == "per_token_head":
                s = scale[blk, slot, h] if order == "NHD" and layout != "vllm" else scale[blk, h, slot]
            else:
                s = 1.0
            out[t, h] = row * s
    return out


def _float64_decode(args: dict, scale_mode: str, layout: str, order: str) -> np.ndarray:
    q = np.asarray(args["q"]).astype(np.float64)
    out = np.zeros_like(q)
    for s, n in enumerate(np.asarray(args["seq_lens"])):
        k = _real(args, "k", scale_mode, layout, order, s, int(n))
        v = _real(args, "v", scale_mode, layout, order, s, int(n))
        for h in range(HQ):
            logits = k[:, h // (HQ // HKV)] @ q[s, h] / np.sqrt(D)
            p = np.exp(logits - logits.max())
            out[s, h] = p @ v[:, h // (HQ // HKV)] / p.sum()
    return out


_KERNELS: dict = {}


def _kernels(dt: str, scale: str, layout: str, order: str, q: str = "fp16"):
    key = (dt, scale, layout, order, q)
    if key not in _KERNELS:
        _KERNELS[key] = tuple(kgen.build(_spec(kind, dt, scale, layout, order, q), backend="cpu", archs=[],
                                         verify=False) for kind in ("paged_decode", "paged_prefill"))
    return _KERNELS[key]


def _run(dt: str, scale: str, layout: str, order: str, q: str = "fp16"):
    decode, prefill = _kernels(dt, scale, layout, order, q)
    args = make_decode_case(decode.spec, LENS, np.random.default_rng(7))
    args.pop("out", None)
    d_out, d_lse = decode(**args, return_lse=True)
    p_out, p_lse = prefill(**args, q_indptr=np.arange(len(LENS) + 1, dtype=np.int32), return_lse=True)
    return args, np.asarray(d_out, dtype=np.float64), np.asarray(p_out, dtype=np.float64), d_lse, p_lse


def _eps(name: str) -> float:
    return {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "fp32": 2.0 ** -23}[name]


# By default NHD over one float format and one of each quantized scale mode; the full tier has all.
@pytest.mark.parametrize("order", ["NHD", pytest.param("HND", marks=pytest.mark.full)])
@pytest.mark.parametrize("dt,scale", full_tier_except(VARIANTS, {0, *(i for i, v in enumerate(VARIANTS) if v in (
    ("int8", "per_token_head"), ("fp8_e4m3", "per_head"), ("fp8_e5m2", "per_tensor")))}))
def test_prefill_at_q_len_1_is_decode_and_follows_the_abi(dt, scale, order):
    args, d_out, p_out, d_lse, p_lse = _run(dt, scale, "separate", order)
    ref = _float64_decode(args, scale, "separate", order)
    mag = np.abs(ref).max()
    # fp16 q, out; the kernels differ in where they round (prefill rounds K and V to q's type for
    # the tensor cores), so the bound is a few units of fp16 rounding of the output's magnitude.
    bound = 8 * _eps("fp16") * mag
    assert np.abs(d_out - ref).max() <= bound, "decode against the float64 ABI computation"
    assert np.abs(p_out - ref).max() <= bound, "prefill against the float64 ABI computation"
    assert np.abs(p_out - d_out).max() <= bound
    np.testing.assert_allclose(np.asarray(p_lse), np.asarray(d_lse), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dt,scale", [("fp16", "none"), ("int8", "per_token_head")])
@pytest.mark.parametrize("layout", ["fused", "vllm"])
def test_other_layouts_too(dt, scale, layout):
    args, d_out, p_out, _, _ = _run(dt, scale, layout, "HND")
    ref = _float64_decode(args, scale, layout, "HND")
    bound = 8 * _eps("fp16") * np.abs(ref).max()
    assert np.abs(d_out - ref).max() <= bound
    assert np.abs(p_out - ref).max() <= bound
