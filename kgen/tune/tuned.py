"""A kernel that uses its tuning results: one built variant per winning config, the
variant for the nearest bucket picked per call.

The pick is a lookup on shapes only (the family's bucket_of: for decode, batch = q.shape[0],
context = block_tables.shape[1] x block_size; never device values: reading them would sync),
nearest in log space on each axis. Nothing is tuned or compiled on the call path.
"""

from __future__ import annotations

import bisect
import math
import warnings
from typing import Any

from kgen.build import build, select_backend
from kgen.errors import KernelRuntimeError, KgenUserError
from kgen.families.registry import family_for
from kgen.tune.results import (
    TuningWarning,
    check_results,
    device_info,
    load_results,
    mismatches,
)
from kgen.verify.runner import verify as run_verify


def _nearest(axis: list[int], value: int) -> int:
    """The axis value closest to `value` in log space (ties go to the smaller one)."""
    i = bisect.bisect_left(axis, value)
    if i == 0:
        return axis[0]
    if i == len(axis):
        return axis[-1]
    lo, hi = axis[i - 1], axis[i]
    return lo if math.log(value / lo) <= math.log(hi / value) else hi


class TunedKernel:
    """Call like a Kernel; `select(batch, context)` tells which config a call would use."""

    def __init__(self, spec, results: dict, backend: str = "auto", verify: bool = True, base=None):
        self.spec = spec
        self._family = family_for(spec)
        self.results = results
        self.batch_axis = sorted(results["buckets"]["batch"])
        self.context_axis = sorted(results["buckets"]["context"])
        fallback = results["default_winner"]
        self._table: dict[tuple[int, int], str] = {}
        self.variants: dict[str, Any] = {}
        if base is not None:
            self.variants[_key(base.config)] = base
        for name, config in results["winners"].items():
            b, c = (int(x) for x in name.split("x"))
            config = config or fallback  # every config failed there: use the overall winner
            key = _key(config)
            if key not in self.variants:
                # Verified again here: tuning checked each winner's output, but this build is new.
                kernel = build(spec, backend=backend, verify=verify, config=config)
                if kernel.report is not None and not kernel.report.passed:
                    raise KernelRuntimeError(f"tuned config {config} failed verification: {kernel.report.summary()}")
                self.variants[key] = kernel
            self._table[(b, c)] = key

    def select(self, batch: int, context: int):
        return self.variants[self._table[(_nearest(self.batch_axis, batch), _nearest(self.context_axis, context))]]

    def __call__(self, **arguments: Any):
        bucket = self._family.bucket_of(self.spec, arguments)
        if bucket is None:  # the arguments don't say: let the kernel's checks word the error
            bucket = (self.batch_axis[0], self.context_axis[0])
        return self.select(*bucket)(**arguments)

    @property
    def backend(self) -> str:
        return next(iter(self.variants.values())).backend

    @property
    def configs(self) -> dict[str, dict]:
        return {f"{b}x{c}": self.variants[k].config for (b, c), k in sorted(self._table.items())}

    def __repr__(self) -> str:
        return f"<kgen.TunedKernel {self.spec.name} {len(self.variants)} variant(s) over {len(self._table)} buckets>"


def _key(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


def build_tuned(spec, backend: str = "auto", results: dict | None = None, verify: bool = True):
    """The spec's kernel using this device's tuning results; without usable results, the
    untuned defaults (a TuningWarning says why)."""
    backend = select_backend(backend)
    if results is None:
        results = load_results(spec, backend)
    if results is None:
        return build(spec, backend=backend, verify=verify)
    return TunedKernel(spec, results, backend, verify=verify)


def tuned_from_manifest(base, tuning: dict | None, backend: str):
    """The hook of generated modules: `base` (the manifest's verified build) unless the
    manifest holds tuning results for this device and spec; then a TunedKernel sharing
    `base` for the configs it covers. A mismatch warns and builds the untuned defaults."""
    if not tuning:
        return base
    try:
        results = check_results(tuning, "manifest.json")
        problems = mismatches(results, base.spec, device_info(backend))
    except KgenUserError as e:
        problems = [str(e)]
    if not problems:
        return TunedKernel(base.spec, results, backend, base=base)
    warnings.warn(f"{base.spec.name}: ignoring the manifest's tuning results: {'; '.join(problems)}; using the "
                  "untuned defaults (re-run `kgen build --tune`)", TuningWarning, stacklevel=3)
    defaults = build(base.spec, backend=backend, verify=False, config=None)
    if defaults.config == base.config:
        return base
    defaults.report = run_verify(defaults)
    if not defaults.report.passed:
        raise KernelRuntimeError(f"untuned default config failed verification: {defaults.report.summary()}")
    return defaults
