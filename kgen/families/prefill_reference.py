"""The contiguous golden of paged prefill (docs/prefill-family.md, docs/verification.md).

Each sequence's K and V are gathered and dequantized by kgen/families/attention/reference.py (the decode golden's
gather: real = stored * scale, canonical layout order); then every query row j of sequence s,
at absolute position p = seq_lens[s] - q_len_s + j, attends in float64 to keys 0..p (causal),
p-W+1..p (sliding window W) or all seq_lens[s] keys (causal: false). Logit order: scale, soft-cap,
ALiBi slope * (key - p), mask. The LSE is the natural log of the sum of exp of the final logits,
-inf for a row that sees no key (whose output is 0).

`dtype`/`round_to` model a kernel computed in a lower precision, as attention_decode does: the
verifier's yardstick for a kernel's error.
"""

from __future__ import annotations

import numpy as np

from kgen.families.attention.reference import decode_inputs_real

ROW_CHUNK = 256  # query rows per reference step


def query_positions(q_indptr, seq_lens) -> list[np.ndarray]:
    """Per sequence: the absolute positions of its query rows (seq_len - q_len + j)."""
    ind = np.asarray(q_indptr, dtype=np.int64)
    return [int(n) - (ind[s + 1] - ind[s]) + np.arange(ind[s + 1] - ind[s]) for s, n in enumerate(seq_lens)]


def visible_keys(spec, pos: np.ndarray, seq_len: int) -> np.ndarray:
    """[rows, seq_len] bool: which keys each query row sees."""
    a = spec.attention
    key = np.arange(seq_len)[None, :]
    p = np.asarray(pos)[:, None]
    visible = np.ones((len(pos), seq_len), dtype=bool)
    if a.causal:
        visible &= key <= p
    if a.sliding_window:
        visible &= key > p - a.sliding_window
    return visible


def attention_prefill(spec, q, args: dict, dtype=np.float64, round_to=None) -> tuple[np.ndarray, np.ndarray]:
    """(out [num_q_tokens, Hq, D], lse [num_q_tokens, Hq]) of a prefill call's arguments."""
    a = spec.attention
    rnd = (lambda x: x.astype(round_to).astype(dtype)) if round_to is not None else (lambda x: x)
    qf = rnd(np.asarray(q).astype(dtype))
    T, Hq, D = qf.shape
    out = np.zeros((T, Hq, D), dtype=dtype)
    lse = np.full((T, Hq), -np.inf, dtype=dtype)
    G = spec.group_size
    scale = dtype(spec.softmax_scale_value)
    ind = np.asarray(args["q_indptr"], dtype=np.int64)
    lens = np.asarray(args["seq_lens"])
    slopes = np.asarray(args["alibi_slopes"], dtype=dtype) if a.alibi else None
    for s, ((k, v), pos) in enumerate(zip(decode_inputs_real(spec, args), query_positions(ind, lens), strict=True)):
        k, v = np.repeat(rnd(k.astype(dtype)), G, axis=0), np.repeat(rnd(v.astype(dtype)), G, axis=0)  # [Hq, L, D]
        for j in range(0, len(pos), ROW_CHUNK):  # rows in chunks: the logits of a long prompt need not fit at once
            rows = slice(int(ind[s]) + j, int(ind[s]) + min(j + ROW_CHUNK, len(pos)))
            out[rows], lse[rows] = _rows(spec, qf[rows], k, v, pos[j:j + ROW_CHUNK], slopes, scale, rnd, dtype)
    return out, lse


def _rows(spec, q, k, v, pos, slopes, scale, rnd, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(out [rows, Hq, D], lse [rows, Hq]) of query rows at positions `pos` over one sequence's K, V [Hq, L, D]."""
    a = spec.attention
    logits = rnd(np.einsum("thd,hld->thl", q, k) * scale)
    if a.logits_soft_cap:
        cap = dtype(a.logits_soft_cap)
        logits = rnd(cap * np.tanh(logits / cap))
    if slopes is not None:
        logits = logits + slopes[None, :, None] * (np.arange(k.shape[1])[None, None, :] - pos[:, None, None])
    seen = visible_keys(spec, pos, k.shape[1])[:, None, :]
    logits = np.where(seen, logits, -np.inf)
    m = logits.max(axis=2, keepdims=True, initial=-np.inf)
    e = np.where(seen, np.exp(logits - np.where(np.isfinite(m), m, 0.0)), 0.0)
    denom = e.sum(axis=2, keepdims=True)
    p = rnd(e / np.where(denom > 0, denom, 1.0))
    with np.errstate(divide="ignore"):
        return rnd(np.einsum("thl,hld->thd", p, v)), (m + np.log(denom))[..., 0]
