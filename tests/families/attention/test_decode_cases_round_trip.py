"""Round trip (docs/verification.md): what cache_write writes, paged_decode reads back to the
reference's values. Both kinds are built from specs that share the cache (layout, order,
dtype, scale), run on the CPU backend, and meet only through the pools: tokens are appended
with cache_write in two calls (a prefill chunk, then the rest) through slot mappings taken
from shuffled block tables, then paged_decode attends over them. The expectation is computed
without the pools: attention in float64 over the original K/V quantized and dequantized as
kgen/quantize.py says (per_token_head scales from each row, per_head scales from the caller)."""

from __future__ import annotations

import numpy as np
import pytest

import kgen
from kgen.formats.cache import cache_shapes, scale_shape
from kgen.formats.dtypes import QUANTIZED, dtype
from kgen.quantize import QMAX, per_token_head_scale, quantize
from kgen.verify.judge.bounds import check_output

H, HQ, D, B = 2, 6, 64, 8
LENS = [37, 5, 80]
CASES = [("fp16", "none", "separate", "NHD"), ("fp8_e4m3", "per_head", "fused", "HND"),
         ("int8", "per_token_head", "vllm", None), ("int8", "per_token_head", "separate", "HND")]


def _specs(cache: str, scale: str, layout: str, order: str | None):
    kv = {"block_size": B, "layout": layout, "order": order, "dtype": cache, "scale": scale}
    common = {"kgen": 1, "attention": {"num_q_heads": HQ, "num_kv_heads": H, "head_dim": D}, "kv_cache": kv,
              "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"]}
    tag = f"{cache}_{scale}_{layout}_{order or 'x'}"
    return (kgen.spec_from_dict({**common, "name": f"rt_write_{tag}", "kind": "cache_write"}),
            kgen.spec_from_dict({**common, "name": f"rt_decode_{tag}", "kind": "paged_decode"}))


def _dequantized(spec, x: np.ndarray, caller_scale: np.ndarray | None) -> np.ndarray:
    """What the cache holds for rows x [T, H, D], in real units (kgen/quantize.py), float64."""
    kv = spec.kv_cache
    if kv.dtype not in QUANTIZED:
        return quantize(x, None, kv.dtype).astype(np.float64)
    if kv.scale == "per_token_head":
        s = per_token_head_scale(x.astype(np.float32), kv.dtype)[..., None]
    else:
        s = caller_scale[None, :, None]
    return quantize(x, s, kv.dtype).astype(np.float64) * s.astype(np.float64)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Float64 attention of one sequence: q [HQ, D], k and v [L, H, D] contiguous."""
    kh, vh = np.repeat(k, HQ // H, axis=1), np.repeat(v, HQ // H, axis=1)  # [L, HQ, D]
    s = np.einsum("hd,lhd->hl", q, kh) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,lhd->hd", p, vh)


@pytest.mark.parametrize("cache,scale,layout,order", CASES, ids=["-".join(x or "vllm" for x in c) for c in CASES])
def test_decode_reads_back_what_cache_write_wrote(cache, scale, layout, order):
    write_spec, decode_spec = _specs(cache, scale, layout, order)
    write = kgen.build(write_spec, backend="cpu", verify=False, archs=[])
    decode = kgen.build(decode_spec, backend="cpu", verify=False, archs=[])
    rng = np.random.default_rng(17)
    nblocks = [-(-n // B) for n in LENS]
    N = 2 * sum(nblocks) + 3
    perm = rng.permutation(N)
    tables = np.zeros((len(LENS), max(nblocks) + 1), np.int32)
    start = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[start:start + nb]
        start += nb

    cd = dtype(cache).numpy
    pools = {n: np.full(s, 127 if cache == "int8" else np.nan, dtype=cd) for n, s in cache_shapes(write_spec, N).items()}
    scales = {}
    if scale == "per_head":
        scales = {n: (2.5 / QMAX[cache] * rng.uniform(0.5, 1.5, H)).astype(np.float32) for n in ("k_scale", "v_scale")}
    elif scale == "per_token_head":
        scales = {n: np.full(scale_shape(write_spec, N), np.nan, np.float32) for n in ("k_scale", "v_scale")}

    keys = [rng.standard_normal((n, H, D)).astype(np.float16) for n in LENS]
    values = [rng.standard_normal((n, H, D)).astype(np.float16) for n in LENS]
    slots = [(tables[i, np.arange(n) // B] * B + np.arange(n) % B).astype(np.int32) for i, n in enumerate(LENS)]
    for part in (slice(0, 4), slice(4, None)):  # a prefill chunk of every sequence, then the rest
        k = np.concatenate([x[part] for x in keys])
        v = np.concatenate([x[part] for x in values])
        sl = np.concatenate([s[part] for s in slots])
        pad = np.full(3, -1, np.int32)  # padding tokens are skipped
        write(key=np.concatenate([k, k[:3]]), value=np.concatenate([v, v[:3]]),
              slot_mapping=np.concatenate([sl, pad]), **pools, **scales)

    q = rng.standard_normal((len(LENS), HQ, D)).astype(np.float16)
    out = decode(q=q, block_tables=tables, seq_lens=np.asarray(LENS, np.int32), **pools, **scales)

    sm = float(decode_spec.softmax_scale_value)
    expected = np.stack([
        _attention(q[i].astype(np.float64), _dequantized(write_spec, keys[i], scales.get("k_scale")),
                   _dequantized(write_spec, values[i], scales.get("v_scale")), sm) for i in range(len(LENS))])
    # the yardstick: the same attention with inputs and intermediates rounded to fp16
    r16 = lambda x: x.astype(np.float16).astype(np.float64)  # noqa: E731
    lowp = np.stack([
        r16(_attention(r16(q[i]), r16(_dequantized(write_spec, keys[i], scales.get("k_scale"))),
                       r16(_dequantized(write_spec, values[i], scales.get("v_scale"))), sm)) for i in range(len(LENS))])
    result = check_output("round_trip", LENS, out, expected, lowp, "fp16")
    assert result.passed, (result.max_error, result.bound, result.first_failure)
    # what the yardstick allows is far below what a cache read wrongly would cost: the result is
    # not only within the bound but close to the float64 values
    assert result.max_error < 2e-2 * float(np.max(np.abs(expected)))
    if layout == "separate":  # the same check refuses K and V read from each other's pool
        swapped = {"k_cache": pools["v_cache"], "v_cache": pools["k_cache"]}
        wrong = decode(q=q, block_tables=tables, seq_lens=np.asarray(LENS, np.int32), **swapped, **scales)
        assert not check_output("swapped", LENS, wrong, expected, lowp, "fp16").passed
