"""Run a kernel's verification matrix (docs/verification.md): the kernel's family supplies the
cases, their inputs, the reference and the comparison; this module seeds them, runs them and
gathers the report."""

from __future__ import annotations

import time

import numpy as np

from kgen.errors import KernelRuntimeError
from kgen.families.registry import family_for
from kgen.runtime.cuda import is_device_error, release_device_memory
from kgen.seeds import fresh_seed
from kgen.verify.isolation import failed_run
from kgen.verify.judge.report import VerificationReport


def verify(kernel, seed: int | None = None, cases: list[str] | None = None) -> VerificationReport:
    """Run the case matrix on `kernel` with fresh random inputs (the seed is recorded); `cases`
    keeps only the cases of those names."""
    spec = kernel.spec
    family = family_for(spec)
    seed = int(seed if seed is not None else fresh_seed())
    rng = np.random.default_rng(seed)
    report = VerificationReport(spec.name, kernel.backend, seed, dict(kernel.config))
    start = time.perf_counter()
    try:
        for case in family.cases(spec, kernel.config, rng):
            if cases is not None and case.name not in cases:
                continue
            t0 = time.perf_counter()
            try:
                results = family.run_case(kernel, case, rng)
            except KernelRuntimeError as e:  # a crash, abort or hang of an isolated kernel: this case's verdict
                report.cases.append(failed_run(case.name, case.sizes, e))
                break
            except Exception as e:
                if not is_device_error(e):
                    raise
                # A fault on the GPU (an illegal address): it surfaces at the next CUDA call, and the
                # process's CUDA context is lost; the verdict names the kernel and the case.
                report.cases.append(failed_run(case.name, case.sizes, KernelRuntimeError(
                    f"{spec.name}: the GPU reported {type(e).__name__}: {e}; this process's CUDA context is "
                    "lost (restart the process before using CUDA again)")))
                break
            for r in results:
                r.seconds = time.perf_counter() - t0
            report.cases.extend(results)
    finally:
        if kernel.backend == "cuda":
            release_device_memory()  # the cases' pools (up to ~17 GiB for huge_pool) leave CuPy's cache
    report.seconds = time.perf_counter() - start
    return report
