"""The contiguous golden (docs/verification.md): gather the paged cache through the block
tables (in the canonical order of kgen/families/layout.py), dequantize exactly as the ABI
says (real = stored * scale, docs/abi.md), and compute attention in float64.

`attention_decode(..., dtype=np.float32, round_to=...)` computes the same attention in a lower
working precision; the verifier uses its error against float64 as the yardstick for a
kernel's error.
"""

from __future__ import annotations

import numpy as np

from kgen.families.layout import canonical_scale, from_layout


def gather_sequence(pool: np.ndarray, scale: np.ndarray, table_row: np.ndarray, seq_len: int) -> np.ndarray:
    """Contiguous real values [num_kv_heads, seq_len, head_dim] of one sequence from a canonical
    [N, B, H, D] pool and its canonical [N, B, H] scales."""
    n, b, h, d = pool.shape
    blocks = np.asarray(table_row[: -(-seq_len // b)], dtype=np.int64)
    x = pool[blocks] * scale[blocks][..., None]  # [nb, B, H, D]
    return x.reshape(-1, h, d)[:seq_len].transpose(1, 0, 2)


def decode_inputs_real(spec, args: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: (K, V) real values [num_kv_heads, seq_len, head_dim] in float64."""
    k, v = (x.astype(np.float64) for x in from_layout(spec, args))
    n = k.shape[0]
    ks = canonical_scale(spec, args.get("k_scale"), n)
    vs = canonical_scale(spec, args.get("v_scale"), n)
    tables = np.asarray(args["block_tables"])
    lens = np.asarray(args["seq_lens"])
    return [(gather_sequence(k, ks, tables[i], int(L)), gather_sequence(v, vs, tables[i], int(L)))
            for i, L in enumerate(lens)]


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


def attention_decode(spec, q, args: dict, dtype=np.float64, round_to=None) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention for every sequence: (out [S, Hq, D], lse [S, Hq]).

    dtype is the working precision; round_to (a numpy dtype, e.g. float16) additionally
    rounds the inputs and each intermediate (scores, probabilities, output) to it,
    which models a kernel computed in the inputs' own precision.
    """
    a = spec.attention
    rnd = (lambda x: x.astype(round_to).astype(dtype)) if round_to is not None else (lambda x: x)
    qf = rnd(np.asarray(q).astype(dtype))
    seqs = decode_inputs_real(spec, args)
    S, Hq, D = qf.shape
    out = np.zeros((S, Hq, D), dtype=dtype)
    lse = np.zeros((S, Hq), dtype=dtype)
    G = spec.group_size
    scale = dtype(spec.softmax_scale_value)
    for i, (k, v) in enumerate(seqs):
        k, v = rnd(k.astype(dtype)), rnd(v.astype(dtype))
        L = k.shape[1]
        visible, bias = _logits_mask_bias(spec, L, args.get("alibi_slopes"))
        kh = np.repeat(k, G, axis=0)  # [Hq, L, D]: query head h reads KV head h // G
        vh = np.repeat(v, G, axis=0)
        s = rnd(np.einsum("hd,hld->hl", qf[i], kh) * scale)
        if a.logits_soft_cap:
            cap = dtype(a.logits_soft_cap)
            s = rnd(cap * np.tanh(s / cap))
        s = s + bias.astype(dtype)
        s = np.where(visible[None, :], s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        denom = e.sum(axis=1, keepdims=True)
        p = rnd(e / denom)
        out[i] = rnd(np.einsum("hl,hld->hd", p, vh))
        lse[i] = (m + np.log(denom))[:, 0]
    return out, lse
