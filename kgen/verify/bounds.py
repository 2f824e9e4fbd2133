"""The derived error bound of a floating-point case (docs/verification.md), one bound per
(sequence, head) row, so that one wrong head among many cannot hide under the error of others.

A row passes when  max_d |out - ref| <= K * max_d |out_lp - ref| + floor,  where out_lp is
the same attention computed in the kernel's input precision (inputs and every intermediate
rounded to the q dtype, as the FlashAttention tests do) and K = 2. The floor covers what an
fp32 kernel adds that the yardstick does not model (fp32 accumulation, fast exp, one rounding
to the output dtype); each term is the size of a standard rounding-error estimate:

  floor = eps32 * (64 + C_L * sqrt(L) + C_S * sqrt(D) * Smax) * A  +  eps(out) * max_d |ref|

with A = max_d sum_j p_j |v_jd| (a sum's error scales with the sum of its terms' magnitudes,
not with its result), L the sequence length (the online sums run over L terms), and Smax =
max_j scale * sum_d |q_d k_jd| (a logit's dot-product error; an error e in a logit is a relative
error e in its probability). Without A and Smax (callers that have only the outputs) the row's
max|ref| stands for A and the logit term is left out. NaN never passes, and the output is
pre-filled with NaN so an unwritten element fails too.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from kgen.dtypes import dtype
from kgen.verify.report import CaseResult

K_FACTOR = 2.0
EPS_FP32 = float(np.finfo(np.float32).eps)
C_LENGTH = 4.0  # sqrt(L) rounding-error growth of an L-term sum, with margin
C_LOGIT = 2.0  # sqrt(D) growth of a D-term dot product, with margin


def row_floor(ref: np.ndarray, out_dtype: str, seq_lens, magnitude: np.ndarray | None = None,
              logit_magnitude: np.ndarray | None = None) -> np.ndarray:
    """The absolute floor of each (sequence, head) row of an output [S, H, D] (module docstring)."""
    ref_mag = np.max(np.abs(ref), axis=-1) if ref.size else np.zeros(ref.shape[:-1])
    acc = ref_mag if magnitude is None else np.maximum(magnitude, ref_mag)
    lens = np.asarray(seq_lens, dtype=np.float64).reshape(-1, *([1] * (ref.ndim - 2)))
    growth = 64.0 + C_LENGTH * np.sqrt(lens)
    if logit_magnitude is not None:
        growth = growth + C_LOGIT * math.sqrt(ref.shape[-1]) * logit_magnitude
    eps_out = float(ml_dtypes.finfo(dtype(out_dtype).numpy).eps)
    return np.maximum(EPS_FP32 * growth * acc + eps_out * ref_mag, 1e-30)


def lse_floor(ref_lse: np.ndarray, seq_lens, logit_magnitude: np.ndarray | None = None,
              head_dim: int = 0) -> np.ndarray:
    """The absolute floor of each (sequence, head) LSE: fp32 rounding of the value itself, of its
    L-term sum (a relative error of the sum is an absolute error of its log), and of the logits."""
    lens = np.asarray(seq_lens, dtype=np.float64).reshape(-1, *([1] * (ref_lse.ndim - 1)))
    floor = EPS_FP32 * (64.0 * np.abs(ref_lse) + 64.0 + C_LENGTH * np.sqrt(lens))
    if logit_magnitude is not None:
        floor = floor + EPS_FP32 * C_LOGIT * math.sqrt(max(head_dim, 1)) * logit_magnitude
    return floor


def _judge(name: str, seq_lens, got: np.ndarray, ref: np.ndarray, lowp: np.ndarray, floor: np.ndarray,
           output: str) -> CaseResult:
    """Compare per row: rows are all axes but the last of `got` (out: [S, H, D]) or all axes (lse: [S, H])."""
    per_elem = got.ndim == ref.ndim and floor.ndim == got.ndim - 1
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)
        lowp_err = np.abs(lowp - ref)
        if per_elem:
            lowp_rows = np.max(lowp_err, axis=-1) if got.size else np.zeros(floor.shape)
        else:
            lowp_rows = lowp_err
        bound_rows = K_FACTOR * lowp_rows + floor
        bound = bound_rows[..., None] if per_elem else bound_rows
        nan = ~np.isfinite(got)
        bad = nan | (err > bound)
        err_rows = np.max(np.where(nan, np.inf, err), axis=-1) if per_elem else np.where(nan, np.inf, err)
    ratio = err_rows / bound_rows
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else None
    max_err = float("nan") if nan.any() else (float(err_rows[worst]) if worst is not None else 0.0)
    result = CaseResult(name, list(int(n) for n in seq_lens), max_err,
                        float(bound_rows[worst]) if worst is not None else 0.0,
                        float(lowp_rows[worst]) if worst is not None else 0.0, not bad.any(), int(nan.sum()))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        s, h = idx[0], idx[1]
        row = (s, h)
        result.first_failure = {
            "case": name, "output": output, "sequence": s, "head": h, "length": int(seq_lens[s]),
            "dim": idx[2] if per_elem else None, "got": float(got[idx]), "expected": float(ref[idx]),
            "error": float(err[idx]) if np.isfinite(got[idx]) else float("nan"), "bound": float(bound_rows[row]),
            "rows_failed": int(np.count_nonzero(np.any(bad, axis=-1) if per_elem else bad)),
        }
        if nan.any():
            result.note = f"{int(nan.sum())} NaN/inf/unwritten {output} element(s)"
    return result


def check_output(name: str, seq_lens: list[int], out: np.ndarray, ref: np.ndarray, lowp: np.ndarray,
                 out_dtype: str, magnitude: np.ndarray | None = None,
                 logit_magnitude: np.ndarray | None = None) -> CaseResult:
    """An output [S, H, D] against the reference, each (sequence, head) row with its own bound."""
    got = np.asarray(out).astype(np.float64)
    floor = row_floor(ref, out_dtype, seq_lens, magnitude, logit_magnitude)
    return _judge(name, seq_lens, got, ref, np.asarray(lowp, dtype=np.float64), floor, "out")


def check_lse(name: str, seq_lens: list[int], lse: np.ndarray, ref_lse: np.ndarray, lowp_lse: np.ndarray,
              logit_magnitude: np.ndarray | None = None, head_dim: int = 0) -> CaseResult:
    """The LSE [S, H] against the reference, each (sequence, head) with its own bound."""
    got = np.asarray(lse).astype(np.float64)
    floor = lse_floor(ref_lse, seq_lens, logit_magnitude, head_dim)
    return _judge(name, seq_lens, got, ref_lse, np.asarray(lowp_lse, dtype=np.float64), floor, "lse")
