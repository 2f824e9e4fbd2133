"""Audits in service: `kern.audit(rate)` checks a random sample of a kernel's calls (docs/ai-kernels.md).

The wrapper returns exactly what the audited kernel returns; on a sampled call it also
recomputes the call with a trusted computation and compares the two with the verifier's own
derived bound (kgen/verify/judge/bounds.py), so "within the bound" means in service what it
means in `kgen verify`:

- CPU backend: the float64 reference and the input-precision model of
  kgen/families/attention/reference.py, judged by `check_output` / `check_lse` per (row, head),
  exactly as a verification case is. The reference is computed from the inputs before the call,
  so a kernel that changes its inputs is compared against what they were.
- CUDA backend (written, not yet run on a GPU): kgen's own verified kernel for the spec recomputes
  the call on the caller's stream right after it (so it reads the same inputs before anything
  later changes them) into the auditor's own buffers; the comparison (device reductions) and the
  copy of its per-row figures to pinned host memory run on a side stream, and the verdict is read
  when that stream's event has completed, at a later call (never waiting) or when `.stats` /
  `.flush()` asks; a mismatch is raised (or warned) there, naming the audited call's number.
  Unaudited calls add no launch and no host synchronisation.

Sampling: one draw per call from `np.random.default_rng(seed)` (seed None: a fresh one, kept in
`.seed`), so the same seed audits the same call numbers. Rate 0 draws nothing and adds one
branch per call; rate 1 checks every call. The cache kinds (cache_write, copy_blocks) are not
audited yet (their outputs are in-place pool writes; a bit-exact shadow needs a copy of the pool).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kgen.arrays import to_numpy
from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin, resources_as_dict
from kgen.errors import AuditError, AuditWarning, UnsupportedError
from kgen.families.attention.reference import attention_reference
from kgen.families.registry import FAMILIES, family_for
from kgen.formats.cache import cache_names
from kgen.formats.dtypes import dtype
from kgen.optional import module_of
from kgen.render import render
from kgen.runtime.cuda import CudaModule, cupy_module, device_arch, loaded_cubin
from kgen.seeds import fresh_seed
from kgen.verify.judge.bounds import (
    EPS_FP32,
    K_FACTOR,
    check_lse,
    check_output,
    head_dims,
    row_floor,
)
from kgen.verify.judge.report import CaseResult, describe_failure
from kgen.verify.runner import verify as run_verify

AUDITED_KINDS = tuple(kind for kind, by_pool in FAMILIES.items() if any(f.auditable for f in by_pool.values()))
ON_MISMATCH = ("raise", "warn")
_FP8 = ("fp8_e4m3", "fp8_e5m2")
_RECENT = 1024  # call numbers of the most recent audited calls kept in stats.checked_calls


@dataclass
class AuditStats:
    """What an audited kernel has seen: calls, the calls checked, mismatches, and the worst
    comparison (largest error relative to its bound)."""

    calls: int = 0
    checked: int = 0
    mismatches: int = 0
    worst_error: float = 0.0  # the error of the worst (row, head) seen, and its bound
    worst_bound: float = 0.0
    worst_ratio: float = 0.0  # worst_error / worst_bound (> 1: a mismatch)
    pending: int = 0  # CUDA: audited calls whose comparison has not completed yet
    checked_calls: deque = field(default_factory=lambda: deque(maxlen=_RECENT))  # call numbers (1-based)
    last_mismatch: CaseResult | None = None

    def record(self, result: CaseResult) -> None:
        ratio = (math.inf if not math.isfinite(result.max_error) else
                 result.max_error / result.bound if result.bound > 0 else (0.0 if result.max_error == 0 else math.inf))
        if ratio >= self.worst_ratio:
            self.worst_ratio, self.worst_error, self.worst_bound = ratio, result.max_error, result.bound
        if not result.passed:
            self.mismatches += 1
            self.last_mismatch = result

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "checked": self.checked, "mismatches": self.mismatches,
                "worst_error": self.worst_error, "worst_bound": self.worst_bound, "worst_ratio": self.worst_ratio,
                "pending": self.pending}


def auditable(spec) -> bool:
    """Whether kern.audit can check this spec's calls (its family's `auditable`)."""
    return bool(family_for(spec).auditable)


def check_rate(rate: Any) -> float:
    """`rate` as a float in [0, 1]; ValueError naming what was given otherwise."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"audit rate must be a number in [0, 1] (the fraction of calls recomputed and checked: "
                         f"0 = none, 0.01 = one call in a hundred, 1 = every call), got {rate!r}")
    return float(rate)


class AuditedKernel:
    """`kern.audit(...)`: the same callable (plan(), spec, backend... are the kernel's), with
    sampled shadow checks; see the module docstring."""

    def __init__(self, kernel, rate: float, on_mismatch: str = "raise", seed: int | None = None):
        self.rate = check_rate(rate)
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {', '.join(ON_MISMATCH)}, got {on_mismatch!r}")
        if not auditable(kernel.spec):
            raise UnsupportedError(f"{kernel.spec.name}: kind {kernel.spec.kind} cannot be audited yet (audits "
                                   f"cover {', '.join(AUDITED_KINDS)})")
        self.kernel = getattr(kernel, "kernel", kernel)  # auditing an audited kernel audits the kernel
        self.on_mismatch = on_mismatch
        self.seed = int(seed if seed is not None else fresh_seed())
        self._rng = np.random.default_rng(self.seed)
        self._stats = AuditStats()
        self._always = self.rate >= 1.0
        self._never = self.rate <= 0.0
        self._shadow = None
        if not self._never:
            self._shadow = DeviceShadow(self.kernel) if self.kernel.backend == "cuda" else None

    def __call__(self, plan=None, **arguments: Any):
        stats = self._stats
        stats.calls += 1
        if self._shadow is not None and self._shadow.pending:
            self._judge_all(self._shadow.completed())
        if self._never or not (self._always or self._rng.random() < self.rate):
            return self.kernel(plan=plan, **arguments)
        stats.checked += 1
        stats.checked_calls.append(stats.calls)
        if self._shadow is not None:
            result = self.kernel(plan=plan, **arguments)
            self._shadow.submit(stats.calls, plan, arguments, result)
            stats.pending = len(self._shadow.pending)
            return result
        return self._audit_on_host(stats.calls, plan, arguments)

    # -- the CPU backend: the float64 reference and the verifier's bound ----------------------
    def _audit_on_host(self, number: int, plan, arguments: dict[str, Any]):
        spec = self.kernel.spec
        args = host_arguments(self.kernel, arguments)
        ref, lowp = _references(spec, args)
        result = self.kernel(plan=plan, **arguments)
        out, lse = result if isinstance(result, tuple) else (result, None)
        self._judge(number, judge_call(spec, f"audited call {number}", args, out, lse, ref, lowp))
        return result

    def _judge_all(self, verdicts) -> None:
        for number, result in verdicts:
            self._judge(number, result)
        self._stats.pending = len(self._shadow.pending) if self._shadow is not None else 0

    def _judge(self, number: int, result: CaseResult) -> None:
        self._stats.record(result)
        if result.passed:
            return
        message = (f"kgen audit: {self.kernel.spec.name} call {number} disagrees with the trusted recomputation "
                   f"beyond the verifier's bound: {describe_failure(result)}")
        if self.on_mismatch == "raise":
            raise AuditError(message, result)
        warnings.warn(message, AuditWarning, stacklevel=4)

    # -- what the caller sees ----------------------------------------------------------------
    @property
    def stats(self) -> AuditStats:
        """The counts so far (CUDA: first collects every comparison that has completed, without waiting)."""
        if self._shadow is not None and self._shadow.pending:
            self._judge_all(self._shadow.completed())
        return self._stats

    def flush(self) -> AuditStats:
        """Wait for every pending comparison (CUDA) and judge it; the stats."""
        if self._shadow is not None:
            self._judge_all(self._shadow.completed(wait=True))
        return self._stats

    def audit(self, rate: float, on_mismatch: str = "raise", seed: int | None = None) -> AuditedKernel:
        return AuditedKernel(self.kernel, rate, on_mismatch, seed)

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        s = self._stats
        return (f"<kgen audit rate={self.rate} of {self.kernel!r}: {s.calls} calls, {s.checked} checked, "
                f"{s.mismatches} mismatches>")


def host_arguments(kernel, arguments: dict[str, Any]) -> dict[str, np.ndarray]:
    """The call's read arguments as host numpy arrays in the ABI's dtypes (what the reference reads):
    an engine's uint8 fp8 cache viewed as the fp8 type, a Python-float scale as an fp32 array."""
    spec = kernel.spec
    reads = [a.name for a in kernel._family.call_arguments(spec, kernel.config) if a.use == "read"]
    pools = set(cache_names(spec))
    args: dict[str, np.ndarray] = {}
    for name in reads:
        value = arguments.get(name)
        if value is None:
            continue
        if isinstance(value, numbers.Real):
            args[name] = np.asarray(value, dtype=np.float32)
            continue
        host = to_numpy(value)
        if name in pools and host.dtype == np.uint8 and spec.kv_cache.dtype in _FP8:
            host = host.view(dtype(spec.kv_cache.dtype).numpy)
        args[name] = host
    return args


def _references(spec, args: dict):
    """The float64 reference and the input-precision model (the verifier's yardsticks)."""
    round_to = None if spec.dtype.q == "fp32" else dtype(spec.dtype.q).numpy
    return (attention_reference(spec, args["q"], args),
            attention_reference(spec, args["q"], args, dtype=np.float32, round_to=round_to, magnitudes=False))


def judge_call(spec, name: str, args: dict, out, lse, ref, lowp) -> CaseResult:
    """One call's output (and LSE when it returned one) against the reference, per (row, head), with
    the verifier's bound; the worse of the two results (the failing one when either fails)."""
    lens = [int(n) for n in np.asarray(args["seq_lens"]).reshape(-1)]
    ind = args.get("q_indptr")
    result = check_output(name, lens, to_numpy(out), ref.out, lowp.out, spec.dtype.resolved_out, ref.magnitude,
                          ref.logit_magnitude, q_indptr=ind, **head_dims(spec))
    if lse is None or not result.passed:
        return result
    lse_result = check_lse(name + " (lse)", lens, to_numpy(lse), ref.lse, lowp.lse, ref.logit_magnitude,
                           spec.attention.head_dim, q_indptr=ind)
    return lse_result if not lse_result.passed else result


def _trusted_cuda_kernel(kernel):
    """kgen's own kernel for `kernel`'s spec (default config) on this GPU, verified: what kgen.build
    does for the CUDA backend (kgen.build is not imported: it imports kgen.kernel, which imports this
    module), built as the audited kernel's own class."""
    spec = kernel.spec
    rendered = render(spec, arch=device_arch())  # this GPU's body
    art = compile_cubin(rendered.source, device_arch(), origin=f"spec {spec.name} (audit)")
    cubin = loaded_cubin(ArtifactCache(), art.cubin, rendered.source)
    trusted = type(kernel)(spec, rendered.source, rendered.config, CudaModule(cubin, rendered.kernel_names),
                           rendered.kernel_names, resources={device_arch(): resources_as_dict(art.resources)},
                           arch=device_arch())
    trusted.report = run_verify(trusted)
    return trusted


class DeviceShadow:
    """The CUDA path of an audit (not yet run on a GPU; tested against the strict driver model).

    On an audited call, after the audited launches on the caller's stream: copy its output (and
    LSE) into the auditor's buffers, run kgen's own verified kernel for the spec on the same inputs
    into its own buffers, both on the caller's stream, so they read the inputs before later work
    changes them; record an event. A side stream waits for that event, reduces |audited - trusted|
    and |trusted| per (row, head) on the device, copies those two small arrays to pinned host
    memory and records its own event. `completed()` judges the calls whose event has fired (without
    waiting, unless asked): per row, error <= 2 * bound, the bound being the verifier's floor
    (bounds.row_floor, the table's capacity standing for the length) plus K times one rounding of
    the row in the input precision (the model the verifier computes from the reference, which the
    device does not have); two kernels each within the bound of the reference are within twice
    it of each other."""

    def __init__(self, kernel, trusted=None):
        self.cp = cupy_module()
        self.spec = kernel.spec
        # kgen's own kernel, verified before use (`trusted`: one the caller built and verified)
        self.trusted = trusted if trusted is not None else _trusted_cuda_kernel(kernel)
        if not self.trusted.report.passed:
            raise AuditError(f"kgen audit: kgen's own kernel for {kernel.spec.name} failed verification, so it "
                             f"cannot audit: {self.trusted.report.summary()}")
        self.side = self.cp.cuda.Stream(non_blocking=True)
        self.pending: deque = deque()

    def submit(self, number: int, plan, arguments: dict[str, Any], result) -> None:
        cp = self.cp
        out, lse = result if isinstance(result, tuple) else (result, None)
        got = self._f32(out)  # on the caller's stream: a copy the caller cannot change
        got_lse = self._f32(lse) if lse is not None else None
        call = {k: v for k, v in arguments.items() if k not in ("out", "lse", "return_lse")}
        trusted = self.trusted(**call, return_lse=lse is not None)
        t_out, t_lse = trusted if isinstance(trusted, tuple) else (trusted, None)
        want = self._f32(t_out)
        want_lse = self._f32(t_lse) if t_lse is not None else None
        ready = cp.cuda.get_current_stream().record()
        self.side.wait_event(ready)
        with self.side:
            err = cp.abs(got - want).max(axis=-1)  # NaN propagates: judged as a mismatch
            mag = cp.abs(want).max(axis=-1)
            figures = [err, mag]
            if got_lse is not None:
                figures.append(cp.abs(cp.where(cp.isneginf(want_lse) & cp.isneginf(got_lse), 0, got_lse - want_lse)))
            host = [cp.cuda.alloc_pinned_memory(f.nbytes) for f in figures]
            views = [np.frombuffer(h, np.float32, f.size).reshape(f.shape) for h, f in zip(host, figures, strict=True)]
            for f, v in zip(figures, views, strict=True):
                f.get(stream=self.side, out=v, blocking=False)  # the caller never waits for an audit
            done = self.side.record()
        width = int(np.prod(call["block_tables"].shape[1:])) * self.spec.kv_cache.block_size
        # Everything the side stream reads stays referenced until its event has fired: the pool would
        # hand memory freed now to the caller's stream while the side stream still reads it.
        in_use = (got, want, got_lse, want_lse, figures, host)
        self.pending.append((number, done, views, in_use, width))

    def _f32(self, x):
        """A new float32 CuPy copy of a device output (torch or CuPy; bf16 from its bits: CuPy has no bf16)."""
        cp = self.cp
        if module_of(x) == "torch":
            return cp.from_dlpack(x.detach().float().contiguous())
        if x.dtype.itemsize == 2 and x.dtype != cp.float16:  # kgen's bf16 on CuPy: a 2-byte view of the bits
            return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        return x.astype(cp.float32)

    def completed(self, wait: bool = False):
        """(call number, CaseResult) of each pending comparison that has finished, in call order."""
        eps_q = float(np.finfo(np.float32).eps) if self.spec.dtype.q == "fp32" else \
            float(np.finfo(dtype(self.spec.dtype.q).numpy).eps)
        while self.pending and (wait or self.pending[0][1].done):
            number, done, views, _in_use, width = self.pending.popleft()
            done.synchronize()  # fired already unless `wait`
            err, mag = views[0].astype(np.float64), views[1].astype(np.float64)
            lens = np.full(err.shape[0], width)
            floor = row_floor(np.zeros((*mag.shape, 1)), self.spec.dtype.resolved_out, lens, magnitude=mag)
            bound = 2.0 * (K_FACTOR * eps_q * mag + floor + np.finfo(np.float64).tiny)
            bad = ~np.isfinite(err) | (err > bound)
            if len(views) > 2:
                lse_err = views[2].astype(np.float64)
                lse_bound = 2.0 * EPS_FP32 * (64.0 + 4.0 * np.sqrt(width)) * 8.0
                bad |= ~np.isfinite(lse_err) | (lse_err > lse_bound)
            ratio = np.where(bad & ~np.isfinite(err), np.inf, err / bound)
            worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else None
            result = CaseResult(f"audited call {number}", [], float(err[worst]) if worst else 0.0,
                                float(bound[worst]) if worst else 0.0, not bad.any(), int((~np.isfinite(err)).sum()))
            if bad.any():
                r, h = (int(i) for i in np.argwhere(bad)[0])
                result.note = (f"row {r}, head {h}: |audited - kgen's kernel| = {err[r, h]:.3g} > {bound[r, h]:.3g} "
                               "(CUDA audit: twice the verifier's bound, estimated from kgen's own output)")
            yield number, result
