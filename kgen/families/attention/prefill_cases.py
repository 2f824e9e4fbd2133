"""The paged-prefill family's verification matrix and benchmark inputs (docs/verification.md).

The caches are made exactly as for decode (kgen/families/attention/decode_cases.py: shuffled physical
blocks in a pool several times larger than needed, optional shared prefix blocks, strided pools,
poison in every slot past seq_len, every unreferenced block and every unused table entry); each
sequence gets a chunk of q_len query rows at the end of its seq_len tokens. The matrix: chunk
lengths 1, 15, 16, 17, 64 and longer; a whole prompt from an empty cache; chunks that start and
end inside blocks; a mixed batch of prefill chunks, single tokens and q_len = 0 sequences (with
the LSE); shared prefixes; padded pools; decode equivalence at q_len = 1 (against the decode
golden); window and partition edges when the spec or config has them. The output is pre-filled
with NaN; each (token, head) row is judged against its own derived bound (kgen/verify/bounds.py's
rule per row), so a few wrong rows cannot hide behind a large error elsewhere.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kgen.arrays import args_to_backend, to_numpy
from kgen.dtypes import dtype
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.reference import attention_decode
from kgen.families.base import Bench, Case, Config
from kgen.families.prefill_reference import attention_prefill
from kgen.verify.bounds import EPS_FP32, K_FACTOR
from kgen.verify.report import CaseResult


def make_prefill_case(spec, seq_lens: list[int], q_lens: list[int], rng: np.random.Generator,
                      share_prefix: bool = False, padded: bool = False) -> dict:
    """Keyword arguments for a prefill call (numpy arrays): decode's poisoned paged caches for
    `seq_lens`, q [sum(q_lens), Hq, D] packed by sequence, q_indptr, and out pre-filled with NaN."""
    a = spec.attention
    args = make_decode_case(spec, seq_lens, rng, share_prefix=share_prefix, padded=padded)
    T = int(sum(q_lens))
    args["q_indptr"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((T, a.num_q_heads, a.head_dim))
    args["q"] = q.astype(dtype(spec.dtype.q).numpy)
    args["out"] = np.full((T, a.num_q_heads, a.head_dim), np.nan, dtype=dtype(spec.dtype.resolved_out).numpy)
    return args


# ---- the verification matrix ----------------------------------------------------------------
WINDOW_ROW_KEYS = 1 << 20  # rows x window of the window cases (their chunks shrink for very long windows)


def _round_up(n: int, b: int) -> int:
    return max(b, -(-n // b) * b)


def prefill_case_matrix(spec, config: Config, rng: np.random.Generator) -> list[dict]:
    """Every case: name, seq_lens, q_lens and flags (share_prefix, padded, lse, decode: compare
    with the decode golden)."""
    B = spec.kv_cache.block_size
    inside = B // 2 + 1 if B > 1 else 1  # a prefix ending inside a block
    chunks = {  # name: (prefix tokens already cached, chunk length)
        "chunk_1": (2 * B + 3, 1), "chunk_15": (B + 3, 15), "chunk_16": (inside, 16), "chunk_17": (3, 17),
        "chunk_64": (B + inside, 64), "chunk_150": (37, 150), "whole_prompt": (0, 77),
        "inside_blocks": (inside, max(1, B - 1) if B > 2 else 3), "small_chunk_long_prefix": (600, 16),
    }
    W = spec.attention.sliding_window
    if W:  # chunks longer than the window where rows x window stays affordable; a prefix past it in any case
        cap = max(16, WINDOW_ROW_KEYS // W)
        chunks |= {"window_crossing": (W + 3, min(W + 5, cap)), "window_chunk_W": (W + B + 1, min(W, cap)),
                   "window_from_empty": (0, min(W + B + 1, cap))}
    P = config.get("partition_size", 0)
    if P:
        chunks |= {"partition_edges": (P - 5, P + 10), "split_prefix_3P": (3 * P + 5, 16)}
    cases = []
    for name, (prefix, q_len) in chunks.items():
        n = prefix + q_len
        if not spec.tail_masking:  # the promise: every seq_len a multiple of B (the chunk still ends anywhere)
            n = _round_up(n, B)
        cases.append({"name": name, "seq_lens": [n], "q_lens": [q_len]})

    # one launch: prefill chunks, single tokens (decode rows) and sequences without query rows
    mixed = [(50, 20), (33, 1), (0, 0), (90, 90), (17, 1), (40, 0), (2 * B + 1, B + 1)]
    mixed += [(int(n), int(rng.integers(0, n + 1))) for n in rng.integers(1, 200, size=3)]
    if not spec.tail_masking:
        mixed = [(_round_up(n, B) if n else 0, q) for n, q in mixed]
    order = rng.permutation(len(mixed))
    cases.append({"name": "mixed_batch", "seq_lens": [mixed[i][0] for i in order],
                  "q_lens": [mixed[i][1] for i in order], "lse": True})
    a, b = 3 * B + max(1, B // 2), 2 * B + 1
    if not spec.tail_masking:
        a, b = 3 * B, 2 * B
    cases.append({"name": "shared_prefix", "seq_lens": [a, b], "q_lens": [min(5, a), b], "share_prefix": True})
    pad = [2 * B + 1, max(1, B // 2)] if spec.tail_masking else [2 * B, B]
    cases.append({"name": "padded_pool", "seq_lens": pad, "q_lens": [B + 1, pad[1]], "padded": True})
    lens = [1, B - 1, B, B + 1, 2 * B + 1, max(5 * B + 3, 300)]
    if not spec.tail_masking:
        lens = [_round_up(n, B) for n in lens]
    lens = sorted({n for n in lens if n >= 1})
    cases.append({"name": "decode_equivalence", "seq_lens": lens, "q_lens": [1] * len(lens), "decode": True,
                  "lse": True})
    return cases


def matrix_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    return [Case(c["name"], c) for c in prefill_case_matrix(spec, config, rng)]


def _references(spec, args: dict, decode: bool = False) -> tuple[tuple, tuple]:
    """((out, lse) in float64, (out, lse) in the kernel's input precision) of one call; `decode`:
    from the decode golden (every q_len is 1)."""
    golden = attention_decode if decode else attention_prefill
    round_to = None if spec.dtype.q == "fp32" else dtype(spec.dtype.q).numpy
    return golden(spec, args["q"], args), golden(spec, args["q"], args, dtype=np.float32, round_to=round_to)


def _row_of_token(q_indptr: np.ndarray, token: int) -> int:
    return int(np.searchsorted(q_indptr, token, side="right") - 1)


def check_rows(name: str, seq_lens: list[int], q_indptr: np.ndarray, out: np.ndarray, ref: np.ndarray,
               lowp: np.ndarray, out_dtype: str) -> CaseResult:
    """The derived bound of kgen/verify/bounds.py applied per (token, head) row:
    max_d |out - ref| <= K * model + max_d |ref| * (64 eps(fp32) + eps(out)), NaN never passes, where
    model is the larger of the row's own model error max_d |lowp - ref| and the case's largest
    model error relative to row magnitude times this row's magnitude (one row's model error alone
    is too noisy a yardstick: the kernel rounds other intermediates than the model does).
    Reports the error and bound of the row closest to failing (or of the first failure)."""
    got = np.asarray(out).astype(np.float64)
    err = np.abs(got - ref)
    nan = ~np.isfinite(got)
    eps_out = float(ml_dtypes.finfo(dtype(out_dtype).numpy).eps)
    lowp_err = np.max(np.abs(lowp - ref), axis=2, initial=0.0)
    ref_mag = np.maximum(np.max(np.abs(ref), axis=2, initial=0.0), 1e-30)
    relative = float(np.max(lowp_err / ref_mag, initial=0.0))
    bound = K_FACTOR * np.maximum(lowp_err, relative * ref_mag) + ref_mag * (64 * EPS_FP32 + eps_out)
    bad = nan | ~(err <= bound[:, :, None])  # a NaN reference (a verifier bug) fails too
    row_err = np.max(np.where(nan, np.inf, err), axis=2, initial=0.0)
    if got.size == 0:
        return CaseResult(name, list(seq_lens), 0.0, 0.0, 0.0, True)
    worst = np.unravel_index(int(np.argmax(row_err / bound)), bound.shape)
    max_err = float("nan") if nan.any() else float(row_err[worst])
    result = CaseResult(name, list(seq_lens), max_err, float(bound[worst]), float(lowp_err[worst]),
                        not bad.any(), int(nan.sum()))
    if bad.any():
        t, h, d = (int(i) for i in np.argwhere(bad)[0])
        result.bound, result.lowp_error = float(bound[t, h]), float(lowp_err[t, h])
        result.first_failure = {"sequence": _row_of_token(q_indptr, t), "token": t, "head": h, "dim": d,
                                "got": float(got[t, h, d]), "expected": float(ref[t, h, d])}
        result.note = (f"{int(nan.sum())} NaN/unwritten output elements" if nan.any()
                       else f"token {t}, head {h}: error {float(err[t, h, d]):.3g} > its bound {float(bound[t, h]):.3g}")
    return result


def check_lse(name: str, seq_lens: list[int], lse: np.ndarray, ref: np.ndarray, lowp: np.ndarray) -> CaseResult:
    """The LSE against one bound for the case, as decode's: K * max |lowp - ref| + max |ref| * 64 eps(fp32)
    (a row's own model error is too noisy a yardstick for a scalar); exactly -inf where a row sees no key."""
    lse = np.asarray(lse, dtype=np.float64)
    empty = np.isneginf(ref)
    finite_ref = np.where(empty, 0.0, ref)
    model = np.abs(np.where(empty, 0.0, lowp) - finite_ref)
    bound = K_FACTOR * float(np.max(model, initial=0.0)) + max(float(np.max(np.abs(finite_ref), initial=0.0)),
                                                               1.0) * 64 * EPS_FP32
    err = np.where(empty, np.where(np.isneginf(lse), 0.0, np.inf), np.abs(lse - finite_ref))
    ok = bool(np.all(err <= bound)) and not np.isnan(lse).any()
    return CaseResult(name, list(seq_lens), float(np.max(err, initial=0.0)), bound, float(np.max(model, initial=0.0)),
                      ok, int(np.isnan(lse).sum()))


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    spec, p = kernel.spec, case.params
    args = make_prefill_case(spec, p["seq_lens"], p["q_lens"], rng, share_prefix=p.get("share_prefix", False),
                             padded=p.get("padded", False))
    (ref, ref_lse), (lowp, lowp_lse) = _references(spec, args, decode=p.get("decode", False))
    want_lse = p.get("lse", False)
    dev_args = args_to_backend(args, kernel.backend)
    # Split configs run with partitions of exactly partition_size, so the partition cases sit on
    # partition boundaries (a call without a plan may choose a larger multiple).
    P = kernel.config.get("partition_size", 0)
    plan = kernel.plan(args["seq_lens"], q_indptr=args["q_indptr"], partition_tokens=P) if P else None
    result = kernel(**dev_args, return_lse=True, plan=plan) if want_lse else kernel(**dev_args, plan=plan)
    out = result[0] if want_lse else result
    results = [check_rows(case.name, p["seq_lens"], args["q_indptr"], to_numpy(out), ref, lowp.astype(np.float64),
                          spec.dtype.resolved_out)]
    if want_lse:
        results.append(check_lse(case.name + "_lse", p["seq_lens"], to_numpy(result[1]), ref_lse,
                                 lowp_lse.astype(np.float64)))
    return results


# ---- the tuner's benchmark inputs -----------------------------------------------------------
BENCH_CHUNK = 512  # query rows per sequence when the context is longer (a chunked prefill)


def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of `context` tokens each, the last min(context, BENCH_CHUNK) of them the
    chunk being prefilled; the timed launches' output is checked like a case."""
    batch, context = bucket
    if not spec.tail_masking:
        context = _round_up(context, spec.kv_cache.block_size)
    lens, q_lens = [context] * batch, [min(context, BENCH_CHUNK)] * batch
    args = make_prefill_case(spec, lens, q_lens, rng)

    def check(got: dict) -> CaseResult:
        (ref, _), (lowp, _) = _references(spec, args)
        return check_rows("tuning", lens, args["q_indptr"], got["out"], ref, lowp.astype(np.float64),
                          spec.dtype.resolved_out)

    return Bench(args, ["out"], check)
