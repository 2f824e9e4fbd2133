"""Verification's policy for kernels that do not run to completion.

Hand-written kernels are untrusted: kgen.verify.untrusted.handwritten loads them isolated (each launch in a
child process with limits, kgen.runtime.isolated), so a crash, an abort or a hang reaches the
runner as a KernelRuntimeError. It becomes the failed verdict of the case that triggered it, named
with the signal or the timeout; the remaining cases are not run (a hang would cost its time limit
again on every one of them).
"""

from __future__ import annotations

import math

from kgen.errors import KernelRuntimeError
from kgen.verify.judge.report import CaseResult


def failed_run(case: str, sizes: list[int], error: KernelRuntimeError) -> CaseResult:
    """The failed CaseResult of a case whose launch crashed, hung or was refused by the runtime."""
    return CaseResult(case, list(sizes), math.nan, math.nan, False,
                      note=f"case '{case}': the kernel did not run to completion: {error} "
                           "(later cases were not run)")
