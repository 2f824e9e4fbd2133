"""A built kernel: an ordinary Python callable over the spec's ABI (docs/abi.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.arrays import as_array_arg, checks_values
from kgen.audit import AuditedKernel
from kgen.bodies import spec_for_arch
from kgen.compile.advisories import advisories_of
from kgen.errors import ArgumentError
from kgen.families.base import Config
from kgen.families.binding import host_values
from kgen.families.registry import family_for
from kgen.plan import BLOCKS_PER_SM, DEFAULT_SMS, Plan, PlannedLaunch, target_blocks
from kgen.plan.arch import DEFAULT_ARCH, limits_for
from kgen.plan.occupancy import occupancy
from kgen.runtime.base import Module, has_blocks
from kgen.runtime.cuda import device_arch, device_sm_count
from kgen.runtime.placement import on_callers_stream


class Kernel:
    """Call with keyword arguments: kern(q=..., k_cache=..., v_cache=..., block_tables=..., seq_lens=...).

    Every argument's shape, dtype, device and strides is checked (host metadata only). The
    values the kernel trusts (seq_lens, the used block-table entries, the tail_masking
    contract, slots) are checked too when `debug` is True; None (the default) defers to
    KGEN_DEBUG, and when that is unset checks them on the CPU backend only, where they are
    host arrays: on a GPU the check would copy them to the host, a synchronisation per call.
    """

    def __init__(self, spec, source: str, config: Config, module: Module, kernel_names: list[str],
                 resources: dict[str, Any] | None = None, report=None, artifacts: dict[str, Any] | None = None,
                 arch: str | None = None):
        self.spec = spec
        # The arch whose body this kernel runs (kgen/bodies.py): its launch geometry is that body's.
        # None: one source for every arch (a hand-written kernel), its geometry the spec's as a whole.
        self.arch = arch
        self.body_spec = spec_for_arch(spec, arch)
        self.source = source
        self.config = dict(config)
        self.module = module
        self.kernel_names = list(kernel_names)
        self.resources = resources or {}
        self.report = report
        self.artifacts = artifacts or {}
        self.debug: bool | None = None
        # A hand-written source (kgen.load_source): held to the kernel ABI, not to what only kgen's
        # own kernels promise beyond it (verification cases with "kgen_only", docs/abi.md).
        self.handwritten = False
        self._family = family_for(spec)
        self._default_target: int | None = None

    @property
    def backend(self) -> str:
        return self.module.backend

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def advisories(self) -> list[dict]:
        """ptxas's performance advisories and local-memory use for every cubin built, each
        {"arch", "code", "message", "kernel"} (kgen/compile/advisories.py); also under
        resources[arch][kernel]["advisories"]. Empty when ptxas had nothing to say."""
        return advisories_of(self.resources)

    def __call__(self, plan: Plan | None = None, **arguments: Any):
        """Run the kernel; with `plan` (from self.plan) the launches and split-KV scratch are the
        plan's and the call does no planning."""
        call = self.bind(plan, **arguments)
        call.launch()
        return call.result

    def bind(self, plan: Plan | None = None, **arguments: Any) -> BoundCall:
        """The call checked, planned and bound once, not run: `.launch()` runs its launches (again)
        with no other host work, on the device and stream the arguments chose; `.result` is what
        the call returns. For timing the kernel alone (kgen tune) and replaying one call."""
        if plan is not None and not isinstance(plan, Plan):
            raise ArgumentError(f"plan: expected a kgen Plan from kern.plan(seq_lens), got {type(plan).__name__}")
        checked = checks_values(self.backend, self.debug)
        if plan is None and self._default_target is None:  # a call without a plan plans for this GPU
            sms = self._gpu_sms()
            self._default_target = target_blocks(sms, self.resident_blocks(sms))
        device = getattr(self.module, "device", None)
        with on_callers_stream(arguments, device):
            launches, result = self._family.bind(self.body_spec, self.config, arguments, checked=checked, plan=plan,
                                                 target_blocks=self._default_target)
        # An empty batch has launches of zero blocks: nothing to run (CuPy would launch one block).
        return BoundCall(self.module, [ln for ln in launches if has_blocks(ln)], result, arguments, device)

    def plan(self, seq_lens: Any, num_sms: int | None = None, partition_tokens: int | None = None,
             workspace: dict | None = None, **lengths: Any) -> Plan:
        """The launches for a batch with these lengths (host-side: device lengths are copied once).
        num_sms: the GPU to fill (None: this GPU's, 132 without one). partition_tokens: force
        the split-KV partition size (a multiple of the config's partition_size), e.g. to test
        partition boundaries. `lengths`: the call's other length arguments by their ABI names, for
        kinds whose calls have them (paged_prefill: q_indptr; the others refuse them). `workspace`:
        a dict shared by plans of this kernel (one per step, say) so that their split-KV scratch
        is allocated once, grown to the largest, not per plan; their calls must then run in one
        stream's order."""
        lens = _host_ints("seq_lens", seq_lens)
        if lens.ndim != 1 or not np.issubdtype(lens.dtype, np.integer) or (lens.size and lens.min() < 0):
            raise ArgumentError(f"seq_lens: expected a 1-d array of lengths >= 0, got {lens!r:.80}")
        num_sms = self._gpu_sms() if num_sms is None else int(num_sms)
        if num_sms < 1:
            raise ArgumentError(f"num_sms: must be >= 1 (got {num_sms})")
        resident = self.resident_blocks(num_sms)
        target = target_blocks(num_sms, resident)
        given = {"seq_lens": lens, **{n: _host_ints(n, v) for n, v in lengths.items() if v is not None}}
        sizes, kernels = self._family.schedule(self.body_spec, self.config, given, target, partition_tokens)
        launches = [PlannedLaunch(k.name, k.grid_for(sizes), (k.block, 1, 1), k.smem) for k in kernels]
        plan = Plan(self.name, int(lens.size), dict(sizes), launches, num_sms, resident, target)
        if workspace is not None:
            plan.workspace = workspace
        return plan

    def resident_blocks(self, num_sms: int) -> int:
        """Blocks of the main (first) kernel a GPU with `num_sms` SMs holds at once: the occupancy of
        its ptxas figures for this GPU's arch (without a GPU: the arch whose body runs, else sm_90
        when built, else the newest target), BLOCKS_PER_SM per SM when none were recorded."""
        main = self._family.kernels(self.body_spec, self.config)[0]
        arch = device_arch() if getattr(self.module, "backend", "cpu") == "cuda" else self.arch
        by_arch = self.resources or {}
        if arch not in by_arch:
            arch = DEFAULT_ARCH if DEFAULT_ARCH in by_arch else max(by_arch, default=None, key=_arch_number)
        figures = by_arch.get(arch, {}).get(main.name) if arch else None
        if not figures:
            return num_sms * BLOCKS_PER_SM
        smem = figures["static_smem"] + main.smem
        per_sm = occupancy(main.block, figures["registers"], smem, limits_for(arch)).blocks
        return num_sms * max(1, per_sm)

    def _gpu_sms(self) -> int:
        return device_sm_count() if getattr(self.module, "backend", "cpu") == "cuda" else DEFAULT_SMS

    def audit(self, rate: float, on_mismatch: str = "raise", seed: int | None = None):
        """The same callable with sampled shadow checks (kgen/audit.py): a random `rate` (0..1) of
        calls is recomputed by a trusted computation (the float64 reference on the CPU backend,
        kgen's own kernel for the spec on CUDA) and compared within the verifier's bound; `.stats`
        counts calls, checked calls and mismatches. A mismatch raises kgen.AuditError, or warns
        (kgen.errors.AuditWarning) with on_mismatch="warn"; the caller always gets this kernel's
        own output. `seed` fixes which calls are checked (None: a fresh seed, kept in `.seed`)."""
        return AuditedKernel(self, rate, on_mismatch, seed)

    def __repr__(self) -> str:
        verdict = "unverified" if self.report is None else ("passed" if self.report.passed else "FAILED")
        return f"<kgen.Kernel {self.name} kind={self.spec.kind} backend={self.backend} config={self.config} {verdict}>"


class BoundCall:
    """A kernel call bound once (Kernel.bind): its launches, holding every array they use alive."""

    def __init__(self, module: Module, launches: list, result: Any, arguments: dict[str, Any], device: int | None):
        self.module, self.launches, self.result = module, launches, result
        self._arguments, self._device = arguments, device

    def launch(self) -> None:
        with on_callers_stream(self._arguments, self._device):
            for launch in self.launches:
                self.module.launch(launch)


def _arch_number(arch: str) -> int:
    return int("".join(ch for ch in arch if ch.isdigit()) or 0)


def _host_ints(name: str, values: Any) -> np.ndarray:
    """A list, host or device array of integers as a host numpy array (a device one is copied)."""
    return np.asarray(host_values(as_array_arg(name, values)) if not isinstance(values, (list, tuple)) else values)
