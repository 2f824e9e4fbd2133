"""The contiguous golden of paged prefill (docs/prefill-family.md, docs/verification.md).

Each sequence's K and V are gathered and dequantized by kgen/reference.py (the decode golden's
gather and widening: real = stored * scale, canonical layout order); then every query row j of sequence s,
at absolute position p = seq_lens[s] - q_len_s + j, attends in float64 to keys 0..p (causal),
p-W+1..p (sliding window W) or all seq_lens[s] keys (causal: false). Logit order: scale, soft-cap,
ALiBi slope * (key - p), mask. The LSE is the natural log of the sum of exp of the final logits,
-inf for a row that sees no key (whose output is 0).

`dtype`/`round_to` model the prefill kernel's own computation in its input precision, the verifier's
yardstick for its error: q and the *stored* K/V values in q's type (kgen/reference.py's _widen, the
rule of every golden: exact for int8 and fp8, so a quantized cache adds no rounding; the scales are
applied in the working precision), logits in the working precision (the kernel's are fp32 MMA
accumulators, never rounded to q's type), P rounded to q's type (the P V operand), the output rounded.
A kernel that rounds anything else to q's type, such as the dequantized K or V, has an error that
this yardstick does not grant it.
"""

from __future__ import annotations

import numpy as np

from kgen.reference import sequence_kv

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
    kv = sequence_kv(spec, args, dtype, round_to)  # stored values in q's type, times the scales
    for s, ((k, v), pos) in enumerate(zip(kv, query_positions(ind, lens), strict=True)):
        k, v = np.repeat(k, G, axis=0), np.repeat(v, G, axis=0)  # [Hq, L, D]
        for j in range(0, len(pos), ROW_CHUNK):  # rows in chunks: the logits of a long prompt need not fit at once
            rows = slice(int(ind[s]) + j, int(ind[s]) + min(j + ROW_CHUNK, len(pos)))
            out[rows], lse[rows] = _rows(spec, qf[rows], k, v, pos[j:j + ROW_CHUNK], slopes, scale, rnd, dtype)
    return out, lse


def _rows(spec, q, k, v, pos, slopes, scale, rnd, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(out [rows, Hq, D], lse [rows, Hq]) of query rows at positions `pos` over one sequence's K, V [Hq, L, D]."""
    a = spec.attention
    logits = np.einsum("thd,hld->thl", q, k) * scale  # fp32 accumulators in the kernel: not rounded
    if a.logits_soft_cap:
        cap = dtype(a.logits_soft_cap)
        logits = cap * np.tanh(logits / cap)
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
