"""Judging a large attention case as a serving audit does (docs/verification.md, section 3.2).

The kernel runs the whole batch; AFTER it ran, a random sample of (query row, KV head) units is
drawn and only their float64 reference (and input-precision model) is computed: the cost of the
reference stays about REF_BUDGET (query head x key) products however large the batch, and the
kernel cannot know which rows will be judged. Every sequence has at least one unit in the sample.

Every row, sampled or not, is still checked for what costs nothing to check: a non-finite value
(poison read, NaN pre-fill left), a (row, head) still holding its pre-fill bit for bit (never
written), and a value outside the range of the V values the row averages (`value_hull`: attention
is a convex combination of V rows). Writes outside the outputs and into inputs are the guards' and
seals' (kgen/verify/judge/guards.py), which cover every byte whatever the sample.
"""

from __future__ import annotations

import numpy as np

from kgen.formats.dtypes import dtype, ml_dtypes
from kgen.verify.judge.report import CaseResult

REF_BUDGET = 1 << 17  # (query head, key) products of the reference a sampled case computes, about
HULL_SLACK = 4.0  # the hull's tolerance in units of the input and output types' eps (rounded weights, output)


def draw_units(rng: np.random.Generator, row_seq: np.ndarray, row_keys: np.ndarray, num_kv_heads: int,
               group: int, budget: int = REF_BUDGET) -> np.ndarray:
    """[rows, num_kv_heads] bool: one unit of every sequence that has rows, then every other unit
    with the probability that brings the reference's cost (row_keys: the keys each row sees) to
    about `budget` (1 when the whole case fits)."""
    row_seq = np.asarray(row_seq, dtype=np.int64)
    cost = float(np.sum(np.asarray(row_keys, dtype=np.float64))) * num_kv_heads * group
    p = min(1.0, budget / max(cost, 1.0))
    units = rng.random((row_seq.size, num_kv_heads)) < p
    if row_seq.size:
        starts = np.flatnonzero(np.r_[True, row_seq[1:] != row_seq[:-1]])  # rows are grouped by sequence
        ends = np.r_[starts[1:], row_seq.size]
        pick = starts + (rng.random(starts.size) * (ends - starts)).astype(np.int64)
        units[pick, rng.integers(0, num_kv_heads, size=starts.size)] = True
    return units


def per_query_head(units: np.ndarray, group: int) -> np.ndarray:
    """[rows, num_q_heads]: a KV head's unit judges its group's query heads."""
    return np.repeat(units, group, axis=1)


def check_every_row(result: CaseResult, output: str, got: np.ndarray, before: np.ndarray, row_seq: np.ndarray,
                    lo: np.ndarray | None = None, hi: np.ndarray | None = None, group: int = 1,
                    types: tuple[str, ...] = ()) -> CaseResult:
    """Fail `result` for a (row, head) of `got` ([rows, Hq(, D)], as the kernel wrote it) that is
    not finite, that still holds a stale `before` (its finite, non-zero pre-fill) bit for bit, or (given the hull lo/hi
    [num_seqs, num_kv_heads, D] of each sequence's V, and `types`: the dtypes the kernel rounds to)
    that lies outside its sequence's V range."""
    if not np.asarray(got).size:
        return result
    got = np.ascontiguousarray(got)
    before = np.ascontiguousarray(np.asarray(before, dtype=got.dtype))
    wide = got.astype(np.float64)
    axes = tuple(range(2, got.ndim))  # the row's elements (none for the LSE)

    def every(x):
        return x.all(axis=axes) if axes else x

    with np.errstate(invalid="ignore"):
        bad_finite = ~every(np.isfinite(wide))
        same = (got.view(np.uint8).reshape(got.shape + (-1,)) == before.view(np.uint8).reshape(got.shape + (-1,)))
        # A pre-fill of zeros is an output a correct kernel can write (a sequence whose V rows quantize
        # to zero: nvfp4), so only a stale (finite, non-zero) pre-fill left in place is "never written";
        # a NaN pre-fill left in place is NaN above.
        stale = every(np.isfinite(before.astype(np.float64))) & ~every(before.astype(np.float64) == 0)
        unwritten = every(same.all(axis=-1)) & stale
        outside = np.zeros(bad_finite.shape, dtype=bool)
        if lo is not None and got.size:
            seq = np.asarray(row_seq, dtype=np.int64)
            lo_r = np.repeat(lo[seq], group, axis=1)  # [rows, Hq, D]
            hi_r = np.repeat(hi[seq], group, axis=1)
            eps = sum(float(ml_dtypes().finfo(dtype(t).numpy).eps) for t in types) or 2.0 ** -10
            tol = HULL_SLACK * eps * np.maximum(np.abs(lo_r), np.abs(hi_r)) + 1e-30
            outside = ((wide < lo_r - tol) | (wide > hi_r + tol)).any(axis=-1) & ~bad_finite
    for mask, why in ((bad_finite, f"NaN/inf in {output}"), (unwritten, f"{output} never written (it still holds "
                      "its pre-fill)"), (outside, f"{output} outside the range of the V values it averages")):
        if mask.any():
            r, h = (int(i) for i in np.argwhere(mask)[0])
            result.fail(f"{int(mask.sum())} (row, head) of {output}: {why}, the first at row {r}, head {h}",
                        {"output": output, "row": r, "head": h})
    return result
