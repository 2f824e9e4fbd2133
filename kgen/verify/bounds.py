"""The derived error bound of a floating-point case (docs/verification.md).

A case passes when  max|out - ref| <= K * max|out_lp - ref| + floor,  where out_lp is
the same attention computed in the kernel's input precision (inputs and every
intermediate rounded to the q dtype, as the FlashAttention tests do), K = 2, and
floor = max|ref| * (64 * eps(fp32) + eps(out dtype)): the kernels accumulate in fp32
(with fast exp on the GPU) and round once to the output dtype. NaN never passes, and
the output is pre-filled with NaN so an unwritten element fails too.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kgen.dtypes import dtype
from kgen.verify.report import CaseResult

K_FACTOR = 2.0
EPS_FP32 = float(np.finfo(np.float32).eps)


def check_output(name: str, seq_lens: list[int], out: np.ndarray, ref: np.ndarray, lowp: np.ndarray,
                 out_dtype: str) -> CaseResult:
    got = np.asarray(out).astype(np.float64)
    err = np.abs(got - ref)
    nan = ~np.isfinite(got)
    lowp_err = float(np.max(np.abs(lowp - ref)))
    ref_mag = float(np.max(np.abs(ref))) if ref.size else 0.0
    floor = max(ref_mag, 1e-30) * (64 * EPS_FP32 + float(ml_dtypes.finfo(dtype(out_dtype).numpy).eps))
    bound = K_FACTOR * lowp_err + floor
    bad = nan | (err > bound)
    max_err = float("nan") if nan.any() else float(err.max())
    result = CaseResult(name, list(seq_lens), max_err, bound, lowp_err, not bad.any(), int(nan.sum()))
    if bad.any():
        s, h, d = (int(i) for i in np.argwhere(bad)[0])
        result.first_failure = {"sequence": s, "head": h, "dim": d, "got": float(got[s, h, d]),
                                "expected": float(ref[s, h, d])}
        if nan.any():
            result.note = f"{int(nan.sum())} NaN/unwritten output elements"
    return result
