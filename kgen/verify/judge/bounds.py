"""The derived error bound of a floating-point case (docs/verification.md), one bound per
(sequence, head) row, so that one wrong head among many cannot hide under the error of others.

ONE rule for every attention kind (decode's rows are its sequences, prefill's its packed query
rows). A row passes when  max_d |out - ref| <= K * model + floor,  where out_lp is the same
attention computed in the kernel's input precision (inputs and every intermediate rounded to the
q dtype, as the FlashAttention tests do), K = 2, and model is the larger of the row's own
max_d |out_lp - ref| and the case's largest such error relative to a row's magnitude times this
row's magnitude (one row's model error alone is too noisy a yardstick: a kernel rounds other
intermediates than the model does, e.g. P and K/V in q's type for the tensor cores). For the LSE,
a scalar per row, model is the case's largest |lse_lp - ref|; a row that sees no key wants -inf. The floor covers what an
fp32 kernel adds that the yardstick does not model (fp32 accumulation, fast exp, one rounding
to the output dtype); each term is the size of a standard rounding-error estimate:

  floor = eps32 * (64 + C_L * sqrt(L) + C_S * sqrt(D) * Smax) * A  +  eps(out) * max_d |ref|

with A = max_d sum_j p_j |v_jd| (a sum's error scales with the sum of its terms' magnitudes,
not with its result), L the sequence length (the online sums run over L terms), D = head_dim
(q and K's width: the length of the logit's dot product, not the output's width v_head_dim) and
Smax = max_j scale * sum_d |q_d k_jd| (a logit's dot-product error; an error e in a logit is a
relative error e in its probability). Without A and Smax (callers that have only the outputs)
the row's max|ref| stands for A and the logit term is left out. The dims are given explicitly
(head_dim for the logits, v_head_dim checked against the output's last axis). NaN never passes,
and the output is pre-filled with NaN so an unwritten element fails too.
"""

from __future__ import annotations

import math

import numpy as np

from kgen.formats.dtypes import dtype, ml_dtypes
from kgen.verify.judge.report import CaseResult

K_FACTOR = 2.0
EPS_FP32 = float(np.finfo(np.float32).eps)
C_LENGTH = 4.0  # sqrt(L) rounding-error growth of an L-term sum, with margin
C_LOGIT = 2.0  # sqrt(D) growth of a D-term dot product, with margin


def head_dims(spec) -> dict[str, int]:
    """A spec's two dims, as the bounds take them: head_dim (q . k) and v_head_dim (the output)."""
    return {"head_dim": spec.attention.head_dim, "v_head_dim": spec.v_head_dim_value}


def _logit_length(head_dim: int | None, logit_magnitude) -> int:
    """The dot-product length of a logit term: head_dim, which a caller with logit magnitudes must give
    (the output's width is v_head_dim, which may differ)."""
    if logit_magnitude is not None and (head_dim is None or head_dim < 1):
        raise ValueError(f"head_dim: the logit error term needs q and K's head_dim (the length of q . k), got "
                         f"{head_dim!r}; pass spec.attention.head_dim")
    return head_dim or 1


def _check_width(ref: np.ndarray, v_head_dim: int | None) -> None:
    if v_head_dim is not None and ref.shape[-1] != v_head_dim:
        raise ValueError(f"v_head_dim: the reference output's last axis is {ref.shape[-1]}, not the v_head_dim "
                         f"{v_head_dim} the caller names (shape {list(ref.shape)})")


def row_floor(ref: np.ndarray, out_dtype: str, seq_lens, magnitude: np.ndarray | None = None,
              logit_magnitude: np.ndarray | None = None, head_dim: int | None = None,
              v_head_dim: int | None = None) -> np.ndarray:
    """The absolute floor of each (sequence, head) row of an output [S, H, v_head_dim] (module
    docstring); head_dim (q . k's length) is required with logit_magnitude."""
    _check_width(ref, v_head_dim)
    ref_mag = np.max(np.abs(ref), axis=-1) if ref.size else np.zeros(ref.shape[:-1])
    acc = ref_mag if magnitude is None else np.maximum(magnitude, ref_mag)
    lens = np.asarray(seq_lens, dtype=np.float64).reshape(-1, *([1] * (ref.ndim - 2)))
    growth = 64.0 + C_LENGTH * np.sqrt(lens)
    if logit_magnitude is not None:
        growth = growth + C_LOGIT * math.sqrt(_logit_length(head_dim, logit_magnitude)) * logit_magnitude
    eps_out = float(ml_dtypes().finfo(dtype(out_dtype).numpy).eps)
    return np.maximum(EPS_FP32 * growth * acc + eps_out * ref_mag, 1e-30)


def lse_floor(ref_lse: np.ndarray, seq_lens, logit_magnitude: np.ndarray | None = None,
              head_dim: int | None = None) -> np.ndarray:
    """The absolute floor of each (sequence, head) LSE: fp32 rounding of the value itself, of its
    L-term sum (a relative error of the sum is an absolute error of its log), and of the logits."""
    lens = np.asarray(seq_lens, dtype=np.float64).reshape(-1, *([1] * (ref_lse.ndim - 1)))
    floor = EPS_FP32 * (64.0 * np.abs(ref_lse) + 64.0 + C_LENGTH * np.sqrt(lens))
    if logit_magnitude is not None:
        floor = floor + EPS_FP32 * C_LOGIT * math.sqrt(_logit_length(head_dim, logit_magnitude)) * logit_magnitude
    return floor


def _judge(name: str, seq_lens, got: np.ndarray, ref: np.ndarray, lowp: np.ndarray, floor: np.ndarray,
           output: str, rows: Rows, tiny: float = 0.0) -> CaseResult:
    """Compare per row: rows are all axes but the last of `got` (out: [rows, H, D]) or all axes
    (lse: [rows, H]). A reference of -inf (a row that sees no key: its LSE) wants exactly -inf.
    Rows smaller than `tiny` (the output type's smallest normal: their rounding is not relative,
    e.g. a head whose attention sink outweighs every key) keep their own model error but do not
    set the case's relative one."""
    per_elem = got.ndim == ref.ndim and floor.ndim == got.ndim - 1
    with np.errstate(invalid="ignore"):
        empty = np.isneginf(ref)
        both_empty = empty & np.isneginf(got)
        err = np.where(both_empty, 0.0, np.abs(got - np.where(empty, 0.0, ref)))
        err = np.where(empty & ~both_empty, np.inf, err)
        lowp_err = np.where(empty, 0.0, np.abs(np.where(empty, 0.0, lowp) - np.where(empty, 0.0, ref)))
        if per_elem:  # the row's model error, or the case's largest relative to its magnitude
            lowp_rows = np.max(lowp_err, axis=-1) if got.size else np.zeros(floor.shape)
            mag = np.maximum(np.max(np.abs(np.where(empty, 0.0, ref)), axis=-1, initial=0.0), 1e-30)
            relative = np.where(mag >= tiny, lowp_rows / mag, 0.0)
            lowp_rows = np.maximum(lowp_rows, np.max(relative, initial=0.0) * mag)
        else:  # a scalar per row (the LSE): the case's largest model error
            lowp_rows = np.full(lowp_err.shape, np.max(lowp_err, initial=0.0))
        bound_rows = K_FACTOR * lowp_rows + floor
        bound = bound_rows[..., None] if per_elem else bound_rows
        nan = ~np.isfinite(got) & ~both_empty
        bad = nan | (err > bound)
        err_rows = np.max(np.where(nan, np.inf, err), axis=-1) if per_elem else np.where(nan, np.inf, err)
    ratio = err_rows / bound_rows
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else None
    max_err = float("nan") if nan.any() else (float(err_rows[worst]) if worst is not None else 0.0)
    result = CaseResult(name, list(int(n) for n in seq_lens), max_err,
                        float(bound_rows[worst]) if worst is not None else 0.0, not bad.any(), int(nan.sum()))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        r, h = idx[0], idx[1]
        row = (r, h)
        result.first_failure = {
            "case": name, "output": output, **rows.where(r), "head": h,
            "dim": idx[2] if per_elem else None, "got": float(got[idx]), "expected": float(ref[idx]),
            "error": float(err[idx]) if np.isfinite(got[idx]) else float("nan"), "bound": float(bound_rows[row]),
            "model_error": float(lowp_rows[row]),
            "rows_failed": int(np.count_nonzero(np.any(bad, axis=-1) if per_elem else bad)),
        }
        if nan.any():
            result.note = f"{int(nan.sum())} NaN/inf/unwritten {output} element(s)"
    return result


class Rows:
    """Which sequence each output row belongs to: one row per sequence (decode), or the rows
    q_indptr packs by sequence (prefill)."""

    def __init__(self, seq_lens, q_indptr=None):
        self.seq_lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        ind = None if q_indptr is None else np.asarray(q_indptr, dtype=np.int64).reshape(-1)
        self.packed = ind is not None
        self.sequence = (np.repeat(np.arange(self.seq_lens.size), np.diff(ind)) if ind is not None
                         else np.arange(self.seq_lens.size))

    @property
    def lengths(self) -> np.ndarray:
        """The KV length of each row's sequence (what its sums run over, at most)."""
        return self.seq_lens[self.sequence] if self.sequence.size else np.zeros(0, dtype=np.int64)

    def where(self, row: int) -> dict:
        s = int(self.sequence[row])
        return {"sequence": s, **({"token": row} if self.packed else {}), "length": int(self.seq_lens[s])}


def _only_judged(got: np.ndarray, ref: np.ndarray, lowp: np.ndarray, judged) -> tuple:
    """With a sample (`judged` [rows, H] bool: kgen/verify/judge/sample.py), the rows outside it
    compare 0 with 0 unless the kernel wrote a non-finite value there (which still fails)."""
    if judged is None:
        return got, ref, lowp
    j = np.asarray(judged, dtype=bool).reshape(judged.shape + (1,) * (got.ndim - judged.ndim))
    with np.errstate(invalid="ignore"):
        return (np.where(j | ~np.isfinite(got), got, 0.0), np.where(j, ref, 0.0),
                np.where(j, np.asarray(lowp, dtype=np.float64), 0.0))


def check_output(name: str, seq_lens: list[int], out: np.ndarray, ref: np.ndarray, lowp: np.ndarray,
                 out_dtype: str, magnitude: np.ndarray | None = None,
                 logit_magnitude: np.ndarray | None = None, q_indptr=None, head_dim: int | None = None,
                 v_head_dim: int | None = None, judged: np.ndarray | None = None) -> CaseResult:
    """An output [rows, H, v_head_dim] against the reference, each (row, head) with its own bound;
    rows are the sequences, or with q_indptr the query rows it packs by sequence. head_dim (q . k's
    length) is required with logit_magnitude. `judged` ([rows, H] bool): only those rows have a
    reference (a sample); the others must be finite here (sample.py checks the rest of them)."""
    rows = Rows(seq_lens, q_indptr)
    got, ref, lowp = _only_judged(np.asarray(out).astype(np.float64), ref, lowp, judged)
    floor = row_floor(ref, out_dtype, rows.lengths, magnitude, logit_magnitude, head_dim, v_head_dim)
    tiny = float(ml_dtypes().finfo(dtype(out_dtype).numpy).tiny)
    return _judge(name, seq_lens, got, ref, np.asarray(lowp, dtype=np.float64), floor, "out", rows, tiny)


def check_lse(name: str, seq_lens: list[int], lse: np.ndarray, ref_lse: np.ndarray, lowp_lse: np.ndarray,
              logit_magnitude: np.ndarray | None = None, head_dim: int | None = None, q_indptr=None,
              judged: np.ndarray | None = None) -> CaseResult:
    """The LSE [rows, H] against the reference, each (row, head) with its own bound; exactly -inf
    where a row sees no key. `judged`: as check_output's."""
    rows = Rows(seq_lens, q_indptr)
    got, ref, lowp_lse = _only_judged(np.asarray(lse).astype(np.float64), np.asarray(ref_lse, dtype=np.float64),
                                      lowp_lse, judged)
    floor = lse_floor(np.where(np.isneginf(ref), 0.0, ref), rows.lengths, logit_magnitude, head_dim)
    return _judge(name, seq_lens, got, ref, np.asarray(lowp_lse, dtype=np.float64), floor, "lse", rows)
