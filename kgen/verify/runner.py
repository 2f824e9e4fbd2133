"""Run a kernel's verification matrix (docs/verification.md): the kernel's family supplies the
cases, their inputs, the reference and the comparison; this module seeds them, runs them and
gathers the report."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kgen.errors import KernelRuntimeError
from kgen.families.registry import family_for
from kgen.runtime.cuda import is_device_error, release_device_memory
from kgen.seeds import fresh_seed
from kgen.verify.isolation import failed_run
from kgen.verify.judge.report import VerificationReport


def verify(kernel, seed: int | None = None, cases: list[str] | None = None, device_budget: int | None = None,
           host_twin: Callable[[], Any] | None = None) -> VerificationReport:
    """Run the case matrix on `kernel` with fresh random inputs (the seed is recorded); `cases`
    keeps only the cases of those names. `device_budget` (bytes, CUDA only): a case whose arrays
    take more device memory than that runs on `host_twin()` instead (the CPU backend's build of the
    same source and config; made at most once), and its verdict says so (serving-time
    verification: kgen/vllm)."""
    spec = kernel.spec
    family = family_for(spec)
    seed = int(seed if seed is not None else fresh_seed())
    rng = np.random.default_rng(seed)
    report = VerificationReport(spec.name, kernel.backend, seed, dict(kernel.config))
    start = time.perf_counter()
    twin = None
    try:
        # the cases of the body that runs (its tiles: kgen/bodies.py), on the whole spec's data
        for case in family.cases(getattr(kernel, "body_spec", spec), kernel.config, rng):
            if cases is not None and case.name not in cases:
                continue
            if case.params.get("kgen_only") and getattr(kernel, "handwritten", False):
                continue  # a promise of kgen's own kernels beyond the ABI (e.g. padded rows)
            t0 = time.perf_counter()
            runs_on, moved = kernel, None
            need = family.case_device_bytes(spec, case)
            if device_budget is not None and kernel.backend == "cuda" and need > device_budget:
                if host_twin is None:
                    raise ValueError("verify: a device_budget needs host_twin, the kernel's CPU-backend build")
                twin = twin or host_twin()
                runs_on = twin
                moved = (f"run on the host (the CPU backend's build of the same source): its arrays take "
                         f"{need / 2**30:.1f} GiB, over the device budget of {device_budget / 2**20:.0f} MiB")
            try:
                results = family.run_case(runs_on, case, rng)
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
                if moved:
                    r.note = moved + (f"; {r.note}" if r.note else "")
            report.cases.extend(results)
    finally:
        if kernel.backend == "cuda":
            release_device_memory()  # the cases' pools (up to ~17 GiB for huge_pool) leave CuPy's cache
    report.seconds = time.perf_counter() - start
    return report
