"""Timing and inputs shared by the decode and prefill measurements: CUDA events around back-to-back
calls (a wall clock in the CPU dry runs), the device copy bandwidth, random tensors in a spec's dtypes."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from kgen.build import build
from kgen.formats.dtypes import dtype


@dataclass
class Options:
    """How a measurement runs (the benchmark scripts pass their argparse namespace, which has the same
    fields): timed GPU time per measurement, whether kgen's builds run the verification matrix, the
    minutes after which the remaining shapes are skipped, and the FlashInfer anchor."""

    budget_ms: float = 100.0
    no_verify: bool = False
    max_minutes: float = 8.0
    no_flashinfer: bool = False
    flashinfer_backends: str = "fa2,fa3"


# ---- timing -----------------------------------------------------------------------------------------
def time_per_call(torch, call, sets: int, budget_s: float, device: str = "cuda", min_calls: int = 10,
                  samples: int = 5) -> tuple[float, float]:
    """(device seconds, host seconds) per call, medians of `samples` samples: CUDA events around n
    back-to-back calls (input set i % sets), n sized so one sample takes about budget_s / samples (at
    least min_calls), min(3, min_calls) warm-up calls first; the host figure is the wall time the loop
    took to enqueue them (when it is close to the device figure, the launches were host-bound). Long
    calls (a 64K-token prefill) take a small min_calls. In the CPU dry run both are the wall clock."""
    for i in range(min(3, min_calls)):
        call(i % sets)
    if device == "cpu":
        samples = []
        for _ in range(3):
            t = time.perf_counter()
            call(len(samples) % sets)
            samples.append(time.perf_counter() - t)
        return statistics.median(samples), statistics.median(samples)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(n: int) -> tuple[float, float]:
        start.record()
        t = time.perf_counter()
        for i in range(n):
            call(i % sets)
        host = time.perf_counter() - t
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / n, host / n

    n = max(min_calls, min(5000, int(budget_s / samples / max(sample(min(5, min_calls))[0], 1e-7))))
    runs = [sample(n) for _ in range(samples)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def copy_bandwidth(budget_s: float) -> float:
    """Device-to-device copy of 1 GiB (CuPy): (bytes read + bytes written) / median time."""
    import cupy

    n = 1 << 30
    # a fill kernel, not cupy.random: the values do not matter to a copy, and cuRAND is not installed
    src, dst = cupy.full(n // 4, 1.5, dtype=cupy.float32), cupy.empty(n // 4, dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(max(10, int(budget_s / 0.5e-3))):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * n / statistics.median(times[2:])


# ---- inputs -----------------------------------------------------------------------------------------
def torch_dtype(torch, name: str):
    return getattr(torch, dtype(name).torch_name)


def random_tensor(torch, shape, name: str, gen):
    t, device = torch_dtype(torch, name), gen.device
    if name == "int8":
        return torch.randint(-100, 101, shape, dtype=t, device=device, generator=gen)
    if name.startswith("fp8"):
        return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(t)
    return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(t)


def build_each(spec, paths, verify: bool, device: str) -> list[tuple[str, object]]:
    """(path name, built kernel) for each (name, config) of `paths`; a path that does not build is
    reported and left out, and each verification's verdict is printed."""

    kerns = []
    for name, config in paths:
        try:
            kern = build(spec, backend=device, verify=verify, seed=1, config=config)
        except Exception as e:  # e.g. a config the family refuses for this spec or GPU
            print(f"{spec.name} [{name}]: not built ({type(e).__name__}: {str(e)[:160]})", flush=True)
            continue
        if kern.report is not None:
            print(f"{spec.name} [{name}]: verification matrix on {device}: "
                  f"{'pass' if kern.report.passed else 'FAIL'} ({kern.report.summary()})", flush=True)
        kerns.append((name, kern))
    return kerns
