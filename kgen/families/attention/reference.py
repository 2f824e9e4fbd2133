"""The contiguous golden (docs/verification.md): gather the paged cache through the block
tables (in the canonical order of kgen/families/layout.py), dequantize exactly as the ABI
says (real = stored * scale, docs/abi.md), and compute attention in float64.

Only the blocks a sequence uses are gathered and only one KV head at a time is widened to
the working precision, so a pool of billions of elements (most of it never touched) or a
context of 32k tokens costs memory in proportion to what the sequence reads.

`attention_decode(..., dtype=np.float32, round_to=...)` computes the same attention in a lower
working precision; the verifier uses its error against float64 as the yardstick for a
kernel's error. `decode_reference` also returns, per (sequence, query head), the magnitudes
that the rounding errors of an fp32 kernel scale with (kgen/verify/bounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kgen.dtypes import QUANTIZED
from kgen.families.layout import cache_names, from_layout, scale_from_layout


@dataclass
class DecodeReference:
    out: np.ndarray  # [S, Hq, D]
    lse: np.ndarray  # [S, Hq]
    # max over d of sum_j p_j |v_jd|: what the output's accumulation errors are relative to
    magnitude: np.ndarray  # [S, Hq]
    # max over visible keys j of softmax_scale * sum_d |q_d k_jd|: what a logit's dot-product error scales with
    logit_magnitude: np.ndarray  # [S, Hq]


def _sequence_scale(spec, scale, blocks: np.ndarray, seq_len: int) -> np.ndarray:
    """The real-value scale of each (token, KV head) of one sequence, [seq_len, H] float64 (ones for a float cache)."""
    kv, h = spec.kv_cache, spec.attention.num_kv_heads
    if kv.dtype not in QUANTIZED or kv.scale == "none":
        return np.ones((seq_len, h))
    s = np.asarray(scale, dtype=np.float64)
    if kv.scale == "per_tensor":
        return np.full((seq_len, h), float(s.reshape(-1)[0]))
    if kv.scale == "per_head":
        return np.broadcast_to(s[None, :], (seq_len, h))
    pool = scale_from_layout(spec, np.asarray(scale)[blocks])  # [nb, B, H] of the used blocks only
    return pool.reshape(-1, h)[:seq_len].astype(np.float64)


def gather_stored(spec, args: dict, table_row: np.ndarray, seq_len: int):
    """One sequence's stored K and V [seq_len, H, D] (the cache dtype) and their scales [seq_len, H]
    (float64), read from the used blocks only."""
    a = spec.attention
    blocks = np.asarray(table_row[: -(-seq_len // spec.kv_cache.block_size)], dtype=np.int64)
    used = {name: np.asarray(args[name])[blocks] for name in cache_names(spec)}
    k, v = from_layout(spec, used)  # canonical [nb, B, H, D]
    shape = (-1, a.num_kv_heads, a.head_dim)
    k, v = k.reshape(shape)[:seq_len], v.reshape(shape)[:seq_len]
    return (k, v, _sequence_scale(spec, args.get("k_scale"), blocks, seq_len),
            _sequence_scale(spec, args.get("v_scale"), blocks, seq_len))


def decode_inputs_real(spec, args: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: (K, V) real values [num_kv_heads, seq_len, head_dim] in float64."""
    tables = np.asarray(args["block_tables"])
    result = []
    for i, L in enumerate(np.asarray(args["seq_lens"])):
        k, v, ks, vs = gather_stored(spec, args, tables[i], int(L))
        result.append(((k.astype(np.float64) * ks[..., None]).transpose(1, 0, 2),
                       (v.astype(np.float64) * vs[..., None]).transpose(1, 0, 2)))
    return result


def _logits_mask_bias(spec, seq_len: int, alibi_slopes) -> tuple[np.ndarray, np.ndarray]:
    """Visible-key mask [seq_len] and ALiBi bias [num_q_heads, seq_len] for the query at seq_len-1."""
    a = spec.attention
    pos = np.arange(seq_len)
    visible = np.ones(seq_len, dtype=bool)
    if a.sliding_window:
        visible &= pos >= seq_len - a.sliding_window
    bias = np.zeros((a.num_q_heads, seq_len))
    if a.alibi:
        bias = np.asarray(alibi_slopes, dtype=np.float64)[:, None] * (pos - (seq_len - 1))[None, :]
    return visible, bias


def _widen(stored: np.ndarray, scale: np.ndarray, dtype, rnd) -> np.ndarray:
    """Real values [L, D] of one KV head in the working precision (stored * scale, then rounded)."""
    if np.all(scale == 1.0):  # a float cache: the stored values are the real ones
        x = stored.astype(dtype)
        return x if rnd is None or stored.dtype == np.dtype(rnd) else x.astype(rnd).astype(dtype)
    x = (stored.astype(np.float64) * scale[:, None]).astype(dtype)
    return x if rnd is None else x.astype(rnd).astype(dtype)


def decode_reference(spec, q, args: dict, dtype=np.float64, round_to=None, magnitudes: bool = True) -> DecodeReference:
    """Decode attention for every sequence, with the error magnitudes of each (sequence, head)
    (upper bounds that cost one pass over K and V; zeros without `magnitudes`).

    dtype is the working precision; round_to (a numpy dtype, e.g. float16) additionally
    rounds the inputs and each intermediate (scores, probabilities, output) to it,
    which models a kernel computed in the inputs' own precision.
    """
    a = spec.attention
    rnd = (lambda x: x.astype(round_to).astype(dtype)) if round_to is not None else (lambda x: x)
    qf = rnd(np.asarray(q).astype(dtype))
    S, Hq, D = qf.shape
    G = spec.group_size
    ref = DecodeReference(np.zeros((S, Hq, D), dtype=dtype), np.zeros((S, Hq), dtype=dtype),
                          np.zeros((S, Hq)), np.zeros((S, Hq)))
    scale = dtype(spec.softmax_scale_value)
    tables = np.asarray(args["block_tables"])
    with np.errstate(over="ignore"):  # an overflowing rounding (e.g. to fp16) is part of the model
        for i, L in enumerate(np.asarray(args["seq_lens"])):
            L = int(L)
            k_st, v_st, ks, vs = gather_stored(spec, args, tables[i], L)
            visible, bias = _logits_mask_bias(spec, L, args.get("alibi_slopes"))
            for h in range(a.num_kv_heads):
                rows = slice(h * G, (h + 1) * G)  # query head r reads KV head r // G
                k = _widen(k_st[:, h], ks[:, h], dtype, round_to)  # [L, D]
                v = _widen(v_st[:, h], vs[:, h], dtype, round_to)
                qh = qf[i, rows]  # [G, D]
                s = rnd(np.einsum("gd,ld->gl", qh, k) * scale)  # einsum, not BLAS: no thread pool to oversubscribe
                if a.logits_soft_cap:
                    cap = dtype(a.logits_soft_cap)
                    s = rnd(cap * np.tanh(s / cap))
                s = s + bias[rows].astype(dtype)
                s = np.where(visible[None, :], s, -np.inf)
                m = s.max(axis=1, keepdims=True)
                e = np.exp(s - m)
                denom = e.sum(axis=1, keepdims=True)
                p = rnd(e / denom)
                ref.out[i, rows] = rnd(np.einsum("gl,ld->gd", p, v))
                ref.lse[i, rows] = (m + np.log(denom))[:, 0]
                if magnitudes:
                    # sum_j p_j max_d |v_jd| >= max_d sum_j p_j |v_jd|; |q| max_j |k_j| >= max_j sum_d |q_d k_jd|
                    ref.magnitude[i, rows] = np.einsum("gl,l->g", p.astype(np.float64), np.abs(v).max(axis=1))
                    knorm = float(np.sqrt(np.max(np.sum(np.square(k[visible], dtype=np.float64), axis=1))))
                    ref.logit_magnitude[i, rows] = float(scale) * np.linalg.norm(qh.astype(np.float64), axis=1) * knorm
    return ref


def attention_decode(spec, q, args: dict, dtype=np.float64, round_to=None) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention for every sequence: (out [S, Hq, D], lse [S, Hq]) (see decode_reference)."""
    ref = decode_reference(spec, q, args, dtype=dtype, round_to=round_to, magnitudes=False)
    return ref.out, ref.lse
