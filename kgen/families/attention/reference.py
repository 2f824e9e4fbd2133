"""The contiguous golden of both attention kinds (docs/verification.md): gather the paged cache
through the block tables (in the canonical order of kgen/formats/cache.py), dequantize exactly
as the ABI says (real = stored * scale, docs/abi.md), and compute attention in float64.

A sparse call (attention.sparse_topk) is first turned into the dense call that reads the rows its
`indices` name (sparse_as_dense): the reference gathers by indices, never by the block tables.

ONE computation, parameterised by each query row's absolute position: prefill's row j of
sequence s (rows q_indptr[s] ..) sits at p = seq_lens[s] - q_len_s + j; decode is q_len 1, its
row at p = seq_len - 1. A row sees keys 0..p (causal), p-W+1..p (sliding window W) or all
seq_len keys (prefill with causal: false). Logit order: scale, soft-cap, ALiBi
slope * (key - p), mask. The LSE is the natural log of the sum of exp of the final logits, -inf
for a row that sees no key (whose output is 0). With attention sinks, every row's softmax also
has a virtual key of logit sinks[h] (as given) and value zero: it joins the max, the sum and the
LSE (a row with no key: lse = sinks[h], out = 0).

Only the blocks a sequence uses are gathered and only one KV head at a time is widened to
the working precision, so a pool of billions of elements (most of it never touched) or a
context of 32k tokens costs memory in proportion to what the sequence reads.

`attention_outputs(..., dtype=np.float32, round_to=...)` computes the same attention in a lower
working precision; the verifier uses its error against float64 as the yardstick for a
kernel's error. `attention_reference` also returns, per (sequence, query head), the magnitudes
that the rounding errors of an fp32 kernel scale with (kgen/verify/judge/bounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kgen.formats import nvfp4
from kgen.formats.cache import CacheFormat, cache_names, from_layout, scale_from_layout

ROW_CHUNK = 256  # query rows per step: the logits of a long prompt need not fit at once


@dataclass
class Reference:
    """Per query row (decode: one per sequence; prefill: the packed rows)."""

    out: np.ndarray  # [rows, Hq, Dv] (Dv: v_head_dim)
    lse: np.ndarray  # [rows, Hq]
    # max over d of sum_j p_j |v_jd|: what the output's accumulation errors are relative to
    magnitude: np.ndarray  # [rows, Hq]
    # max over visible keys j of softmax_scale * sum_d |q_d k_jd|: what a logit's dot-product error scales with
    logit_magnitude: np.ndarray  # [rows, Hq]


def _sequence_scale(spec, scale, blocks: np.ndarray, seq_len: int, tensor_scale=None) -> np.ndarray:
    """The real-value scale of each (token, KV head) of one sequence, [seq_len, H] float64 (ones for a float
    cache; nvfp4: the tensor scale)."""
    kv, h = spec.kv_cache, spec.attention.num_kv_heads
    if CacheFormat.of(spec).block_scaled:  # the tensor scale; the block scales are in the stored values
        return np.full((seq_len, h), float(np.asarray(tensor_scale, dtype=np.float32)))
    if not CacheFormat.of(spec).quantized or kv.scale == "none":
        return np.ones((seq_len, h))
    s = np.asarray(scale, dtype=np.float64)
    if kv.scale == "per_tensor":
        return np.full((seq_len, h), float(s.reshape(-1)[0]))
    if kv.scale == "per_head":
        return np.broadcast_to(s[None, :], (seq_len, h))
    pool = scale_from_layout(spec, np.asarray(scale)[blocks])  # [nb, B, H] of the used blocks only
    return pool.reshape(-1, h)[:seq_len].astype(np.float64)


def gather_stored(spec, args: dict, table_row: np.ndarray, seq_len: int):
    """One sequence's stored K [seq_len, H, D] and V [seq_len, H, Dv] (the cache dtype) and their
    scales [seq_len, H] (float64), read from the used blocks only."""
    a = spec.attention
    blocks = np.asarray(table_row[: -(-seq_len // spec.kv_cache.block_size)], dtype=np.int64)
    used = {name: np.asarray(args[name])[blocks] for name in cache_names(spec)}
    k, v = from_layout(spec, used)  # canonical [nb, B, H, D] (V: [.., v_head_dim])
    if CacheFormat.of(spec).block_scaled:
        k, v = (_fp4_stored(spec, x, args[name], blocks) for x, name in ((k, "k_scale"), (v, "v_scale")))
    k = k.reshape(-1, a.num_kv_heads, a.head_dim)[:seq_len]
    v = v.reshape(-1, a.num_kv_heads, spec.v_head_dim_value)[:seq_len]
    # mla: one scale set dequantizes the latent row for K and V alike
    k_name, v_name = ("kv_scale", "kv_scale") if CacheFormat.of(spec).mla else ("k_scale", "v_scale")
    return (k, v, _sequence_scale(spec, args.get(k_name), blocks, seq_len, args.get("k_tensor_scale")),
            _sequence_scale(spec, args.get(v_name), blocks, seq_len, args.get("v_tensor_scale")))


def _fp4_stored(spec, packed: np.ndarray, scales, blocks: np.ndarray) -> np.ndarray:
    """nvfp4: e2m1 * e4m3 block scale of each element (fp32, exact: also in fp16 and bf16), what the
    kernels widen before the tensor scale, which _sequence_scale supplies per token."""
    return nvfp4.scaled_values(packed, scale_from_layout(spec, np.asarray(scales).view(np.uint8)[blocks]))


def sequence_kv(spec, args: dict, dtype=np.float64, round_to=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: (K [num_kv_heads, seq_len, head_dim], V [.., v_head_dim]) in the working precision `dtype`, each
    head widened by _widen (stored values rounded to `round_to`, times the scale)."""
    tables = np.asarray(args["block_tables"])
    result = []
    for i, L in enumerate(np.asarray(args["seq_lens"])):
        k, v, ks, vs = gather_stored(spec, args, tables[i], int(L))
        result.append(tuple(np.stack([_widen(x[:, h], sc[:, h], dtype, round_to) for h in range(x.shape[1])])
                            for x, sc in ((k, ks), (v, vs))))
    return result


def real_kv(spec, args: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: (K, V) real values [num_kv_heads, seq_len, head_dim / v_head_dim] in float64."""
    return sequence_kv(spec, args)


def query_rows(args: dict) -> tuple[np.ndarray, np.ndarray]:
    """(q_indptr [S + 1], the absolute position of every query row [rows]) of a call's arguments:
    prefill's own q_indptr, or one row per sequence (decode: q_len 1)."""
    lens = np.asarray(args["seq_lens"], dtype=np.int64).reshape(-1)
    ind = np.asarray(args["q_indptr"], dtype=np.int64) if "q_indptr" in args else np.arange(lens.size + 1)
    q_lens = np.diff(ind)
    pos = np.concatenate([n - q + np.arange(q) for n, q in zip(lens, q_lens, strict=True)] or [np.zeros(0, np.int64)])
    return ind, pos.astype(np.int64)


def visible_keys(spec, pos: np.ndarray, seq_len: int) -> np.ndarray:
    """[rows, seq_len] bool: which keys each query row (at absolute position pos) sees."""
    a = spec.attention
    key = np.arange(seq_len)[None, :]
    p = np.asarray(pos)[:, None]
    visible = np.ones((len(pos), seq_len), dtype=bool)
    if getattr(a, "causal", None) is not False:  # decode's row is the last key: causal or not, it sees 0..p
        visible &= key <= p
    if a.sliding_window:
        visible &= key > p - a.sliding_window
    return visible


def _widen(stored: np.ndarray, scale: np.ndarray, dtype, rnd) -> np.ndarray:
    """Real values [L, D] of one KV head in the working precision: the *stored* values rounded to
    `rnd` (the kernel's input type), times the scale in the working precision. The rule of every
    golden: a kernel converts what is stored to its input type (exact for int8 and fp8 in fp16 and
    bf16, so only a float cache of another type is rounded) and applies scales in fp32; rounding the
    dequantized values instead would put an error in the yardstick that a correct kernel does not
    make, and hide one that does (docs/verification.md)."""
    x = stored.astype(dtype) if rnd is None or stored.dtype == np.dtype(rnd) else stored.astype(rnd).astype(dtype)
    if np.all(scale == 1.0):  # a float cache: the stored values are the real ones
        return x
    return x * np.asarray(scale, dtype=np.float64).astype(dtype)[:, None]


def sparse_as_dense(spec, args: dict) -> dict:
    """A sparse call's arguments (attention.sparse_topk: `indices` [rows, N]) as the dense call that
    reads the same rows: query row r becomes sequence r, whose keys are its valid entries' cache rows
    in order (a repeated slot repeated, -1 left out), gathered into a pool of its own with their
    per-token scales; each row is then a decode row and sees all its keys (none: out 0, lse -inf).
    A dense call's arguments are returned as they are."""
    if not spec.attention.sparse_topk or "indices" not in args:
        return args
    B = spec.kv_cache.block_size
    ind = np.asarray(args["indices"]).astype(np.int64)
    valid = ind >= 0
    lens = valid.sum(axis=1)
    nb = max(1, -(-int(lens.max(initial=0)) // B))
    names = list(cache_names(spec)) + (["kv_scale"] if CacheFormat.of(spec).per_token else [])
    dense = {k: v for k, v in args.items() if k not in ("indices", "q_indptr", "seq_lens", *names)}
    for name in names:
        pool = np.asarray(args[name])
        rows = np.zeros((ind.shape[0], nb * B, *pool.shape[2:]), dtype=pool.dtype)
        for r, entries in enumerate(ind):
            slots = entries[valid[r]]
            rows[r, : slots.size] = pool[slots // B, slots % B]
        dense[name] = rows.reshape(ind.shape[0] * nb, B, *pool.shape[2:])
    dense["block_tables"] = np.arange(ind.shape[0] * nb, dtype=np.int32).reshape(ind.shape[0], nb)
    dense["seq_lens"] = lens.astype(np.int32)
    return dense


def attention_reference(spec, q, args: dict, dtype=np.float64, round_to=None, magnitudes: bool = True,
                        units: np.ndarray | None = None) -> Reference:
    """Attention of every query row of a call (decode or prefill: `args` with or without
    q_indptr), with the error magnitudes of each (row, head) (upper bounds that cost one pass over
    K and V; zeros without `magnitudes`). With `units` ([rows, num_kv_heads] bool: a sample,
    kgen/verify/judge/sample.py) only those (row, KV head)'s query heads are computed; the others
    keep out 0 and lse -inf.

    dtype is the working precision; round_to (a numpy dtype, e.g. float16) additionally rounds
    q and the *stored* K/V values to it (_widen: the scales are applied in the working precision),
    then the probabilities (the P V operand) and the output; the logits stay in the working
    precision (the kernels' are fp32 accumulators). That models a kernel computed in its inputs' own
    precision; a kernel that rounds anything else to q's type, such as the dequantized K or V, has
    an error that this yardstick does not grant it.
    """
    a = spec.attention
    args = sparse_as_dense(spec, args)  # a sparse row: the rows its indices name
    rnd = (lambda x: x.astype(round_to).astype(dtype)) if round_to is not None else (lambda x: x)
    qf = rnd(np.asarray(q).astype(dtype))
    R, Hq = qf.shape[:2]
    G = spec.group_size
    ref = Reference(np.zeros((R, Hq, spec.v_head_dim_value), dtype=dtype), np.full((R, Hq), -np.inf, dtype=dtype),
                    np.zeros((R, Hq)), np.zeros((R, Hq)))
    scale = dtype(spec.softmax_scale_value)
    tables = np.asarray(args["block_tables"])
    slopes = np.asarray(args["alibi_slopes"], dtype=np.float64) if a.alibi else None
    sinks = np.asarray(args["sinks"], dtype=np.float64).astype(dtype) if a.sinks else None
    ind, positions = query_rows(args)
    with np.errstate(over="ignore", divide="ignore"):  # an overflowing rounding (e.g. to fp16) is part of the model
        for s, L in enumerate(np.asarray(args["seq_lens"])):
            L, first, last = int(L), int(ind[s]), int(ind[s + 1])
            if last == first or (units is not None and not units[first:last].any()):
                continue  # no query rows (or none sampled): nothing to compute, nothing read
            k_st, v_st, ks, vs = gather_stored(spec, args, tables[s], L)
            for h in range(a.num_kv_heads):
                heads = slice(h * G, (h + 1) * G)  # query head r reads KV head r // G
                chosen = None if units is None else np.nonzero(units[first:last, h])[0] + first
                if chosen is not None and not chosen.size:
                    continue
                k = _widen(k_st[:, h], ks[:, h], dtype, round_to)  # [L, D]
                v = _widen(v_st[:, h], vs[:, h], dtype, round_to)  # [L, Dv]
                knorm = np.sqrt(np.sum(np.square(k, dtype=np.float64), axis=1)) if magnitudes else None
                vmax = np.abs(v).max(axis=1, initial=0.0).astype(np.float64) if magnitudes else None
                steps = [slice(r0, min(r0 + ROW_CHUNK, last)) for r0 in range(first, last, ROW_CHUNK)] \
                    if chosen is None else [chosen[c0:c0 + ROW_CHUNK] for c0 in range(0, chosen.size, ROW_CHUNK)]
                for rows in steps:
                    _rows(spec, ref, rows, heads, qf[rows, heads], k, v, positions[rows], slopes, scale, rnd,
                          knorm, vmax, None if sinks is None else sinks[heads])
    return ref


def _rows(spec, ref: Reference, rows: slice | np.ndarray, heads: slice, q, k, v, pos, slopes, scale, rnd, knorm, vmax,
          sinks=None) -> None:
    """Fill ref for query rows `rows` (positions `pos`) and the query heads `heads` of one KV head
    (`sinks`: those heads' sink logits, or None)."""
    a = spec.attention
    # logits stay in the working precision: the kernels' are fp32 accumulators, never rounded to q's type
    s = np.einsum("rgd,ld->rgl", q, k) * scale  # einsum, not BLAS: no thread pool to oversubscribe
    if a.logits_soft_cap:
        cap = s.dtype.type(a.logits_soft_cap)
        s = cap * np.tanh(s / cap)
    if slopes is not None:
        bias = slopes[heads][None, :, None] * (np.arange(k.shape[0])[None, None, :] - pos[:, None, None])
        s = s + bias.astype(s.dtype)
    seen = visible_keys(spec, pos, k.shape[0])[:, None, :]
    s = np.where(seen, s, -np.inf)
    m = s.max(axis=2, keepdims=True, initial=-np.inf)
    e = np.where(seen, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    denom = e.sum(axis=2, keepdims=True)
    p = rnd(e / np.where(denom > 0, denom, 1.0))
    o = np.einsum("rgl,ld->rgd", p, v)
    lse = (m + np.log(denom))[..., 0]
    if sinks is not None:
        # The sink (a key of value zero) joins last, as in the kernels: it takes its share of the
        # row's mass from the keys' normalised output, so a dominant sink does not underflow P.
        lse_all = np.logaddexp(lse, sinks[None, :])  # a row with no key: the sink's logit
        keep = np.exp(lse - lse_all)  # the keys' share (0 for a row with no key)
        o, p, lse = o * keep[..., None], p * keep[..., None], lse_all
    ref.out[rows, heads] = rnd(o)
    ref.lse[rows, heads] = lse
    if knorm is not None:
        # sum_j p_j max_d |v_jd| >= max_d sum_j p_j |v_jd|; |q| max_j |k_j| >= max_j sum_d |q_d k_jd|
        ref.magnitude[rows, heads] = np.einsum("rgl,l->rg", p.astype(np.float64), vmax)
        kmax = np.max(np.where(seen[:, 0, :], knorm[None, :], 0.0), axis=1, initial=0.0)  # [rows]
        ref.logit_magnitude[rows, heads] = float(scale) * np.linalg.norm(q.astype(np.float64), axis=2) * kmax[:, None]


def attention_outputs(spec, q, args: dict, dtype=np.float64, round_to=None) -> tuple[np.ndarray, np.ndarray]:
    """(out [rows, Hq, Dv], lse [rows, Hq]) of a call's arguments (see attention_reference)."""
    ref = attention_reference(spec, q, args, dtype=dtype, round_to=round_to, magnitudes=False)
    return ref.out, ref.lse



def value_hull(spec, args: dict) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) [num_seqs, num_kv_heads, v_head_dim] float64: the least and greatest real V value of
    each sequence's keys per head and channel (0 included with attention sinks, whose value is 0).
    Every output row of attention is a convex combination of its visible keys' V rows, so it lies
    between them: a check that costs one pass over V, for rows whose reference is not computed."""
    a, DV = spec.attention, spec.v_head_dim_value
    args = sparse_as_dense(spec, args)
    lens = np.asarray(args["seq_lens"]).reshape(-1)
    tables = np.asarray(args["block_tables"])
    lo = np.zeros((lens.size, a.num_kv_heads, DV))
    hi = np.zeros((lens.size, a.num_kv_heads, DV))
    for s, L in enumerate(lens):
        if L < 1:
            continue
        _, v, _, vs = gather_stored(spec, args, tables[s], int(L))
        real = v.astype(np.float64) * np.asarray(vs, dtype=np.float64)[:, :, None]
        lo[s], hi[s] = real.min(axis=0), real.max(axis=0)
    if a.sinks:
        lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    return lo, hi
