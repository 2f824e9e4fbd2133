"""The interface every kernel family implements (docs/architecture.md: how to add a family).

A family owns everything specific to one `kind`: its tunable parameters and default tuning
space, its argument table and kernels (launch geometry, shared memory), the template context,
the call binding, the verification cases (inputs, reference, comparison) and the benchmark
inputs of the tuner. Nothing outside kgen/families/ branches on the kind.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kgen.errors import KgenUserError
from kgen.families.argtable import Arg, KernelDecl
from kgen.families.binding import CallArg, table_call_arguments
from kgen.runtime.base import Launch
from kgen.verify.judge.report import CaseResult

Config = dict[str, int]
Bucket = tuple[int, int]  # (batch, context) of the tuner


@dataclass(frozen=True)
class TunableParam:
    name: str
    default: int


@dataclass
class Case:
    """One case of a family's verification matrix; `params` are the family's own."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # what a report shows of it (attention: its sequence lengths)


@dataclass
class Bench:
    """One benchmark call of the tuner: host (numpy) keyword arguments, the names of the
    arguments the kernel writes, and the check of those after the timed launches."""

    args: dict[str, Any]
    outputs: list[str]
    check: Callable[[dict[str, np.ndarray]], CaseResult]


class PerfModel(enum.Enum):
    """Which static model of kgen/perf reads a family's main kernel (`kgen perf`, docs/performance.md)."""

    NONE = "none"            # none: `kgen perf` refuses the kernel
    STREAMING = "streaming"  # kgen/perf/model.py: a KV-streaming kernel read from its SASS; the family's
    #                          template context carries `geo` (its DecodeGeometry) and `tensor_cores`
    TILES = "tiles"          # kgen/perf/prefill_model.py: tensor-core tiles (`kgen perf`: resources only)
    LATENT = "latent"        # kgen/perf/mla_model.py: MLA decode over latent rows


class Family(Protocol):
    kind: str
    template: str  # file under templates/
    params: dict[str, TunableParam]
    # Capabilities the code outside kgen/families/ asks instead of comparing families (FamilyBase's defaults):
    rows: Any  # attention kinds: their query-row axis (kgen.families.attention.common.Rows); else None
    perf_model: PerfModel
    fib_kind: str | None  # the FlashInfer-Bench definition kind its kernel is exported as (kgen/fib), or None

    def unsupported(self, spec) -> list[str]:
        """Why kgen cannot generate this spec (empty: it can)."""

    def check_config(self, spec, config: Config) -> list[str]:
        """Why a (resolved) config is invalid for this spec."""

    def abi_config(self, spec) -> Config:
        """The config of the hand-written-kernel contract (ABI 1); resolve_config fills the rest."""

    def default_space(self, spec) -> dict[str, list[int]]:
        """A tuning space worth searching when the spec gives none (`tuning.params` form)."""

    def arguments(self, spec, config: Config) -> list[Arg]:
        """The argument table: every parameter of the main kernel, in parameter order."""

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        """The kernels of one launch sequence, in launch order (geometry, shared memory, parameters)."""

    def kernel_names(self, spec, config: Config) -> list[str]: ...

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        """The template's variables; `kernels`: kernels(spec, config), which the caller built (render()
        builds the argument table once, for the template and the kernel names)."""

    def abi_notes(self, spec) -> list[str]:
        """The kind's part of `kgen abi`: the specialised sizes, the call arguments, the rules."""

    def call_arguments(self, spec, config: Config) -> list[CallArg]:
        """The arguments of `kern(...)` and its torch op, in ABI order (FamilyBase: the argument
        table's, kgen.families.binding.table_call_arguments)."""

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True,
             plan: Any = None, target_blocks: int | None = None) -> tuple[list[Launch], Any]:
        """Check one call's arguments; return (launches, the call's result). `plan`: a kgen.plan.Plan
        made by schedule(), which fixes the launch sizes (kinds without one refuse it); without
        one a kind that plans aims for `target_blocks` blocks with work (kgen.plan.target_blocks)."""

    def schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                 partition_tokens: int | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Call-time plan: (launch sizes, kernels launched) for the call's length arguments (host
        arrays by their ABI names, seq_lens and whatever else the kind's call has), aiming for
        `target_blocks` thread blocks with work (kgen.plan.target_blocks)."""

    def cases(self, spec, config: Config, rng: np.random.Generator) -> list[Case]:
        """The verification matrix."""

    def run_case(self, kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
        """Make the case's inputs, call `kernel`, judge its outputs against the reference."""

    def case_device_bytes(self, spec, case: Case) -> int:
        """The device memory one case's arrays take when they are larger than usual (verification
        with a device budget runs such a case on the host instead); 0 for an ordinary case."""

    def bench(self, spec, config: Config, bucket: Bucket, rng: np.random.Generator) -> Bench:
        """Inputs for timing one (batch, context) bucket, and the check of what the kernel wrote."""

    def bucket_of(self, spec, call: dict[str, Any]) -> Bucket | None:
        """The (batch, context) bucket of one call, from array shapes only (never device values:
        reading them would sync); None when the call's arguments don't say (its checks will)."""


class FamilyBase:
    """What most families share: names from the kernels, the ABI config, a threads-only space."""

    rows = None
    perf_model = PerfModel.NONE
    fib_kind: str | None = None
    # Whether `kern.audit(rate)` can shadow-check this kind's calls (kgen/audit.py: a returned output
    # judged against the float64 reference with the verifier's bound); in-place kinds cannot yet.
    auditable = False

    def abi_config(self, spec) -> Config:
        return {}

    def default_space(self, spec) -> dict[str, list[int]]:
        return {"threads": [64, 128, 256]}

    def kernel_names(self, spec, config: Config) -> list[str]:
        return [k.name for k in self.kernels(spec, config)]

    def case_device_bytes(self, spec, case: Case) -> int:
        return 0

    def call_arguments(self, spec, config: Config) -> list[CallArg]:
        return table_call_arguments(self, spec, config)

    def schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                 partition_tokens: int | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        raise KgenUserError(f"{spec.name}: kind {spec.kind} has no call-time plan (its launches do not depend "
                            "on sequence lengths): call the kernel without one")


class SingleKernelFamily(FamilyBase):
    """A family with one kernel per spec whose only tunable is `threads`."""

    params = {"threads": TunableParam("threads", 128)}

    def check_config(self, spec, config: Config) -> list[str]:
        return threads_problems(config["threads"])


def threads_problems(threads: int) -> list[str]:
    """The thread-block size rule every family shares (whole warps, at most 1024 threads)."""
    if threads % 32 or not 32 <= threads <= 1024:
        return [f"threads must be a multiple of 32 in 32..1024 (got {threads})"]
    return []


def resolve_config(family: Family, spec, config: Config | None) -> Config:
    """Fill defaults (family's, then the spec's tuning.defaults), refuse unknown parameters."""
    resolved = {name: p.default for name, p in family.params.items()}
    tuning = getattr(spec, "tuning", None)
    if tuning is not None:
        resolved.update({k: v for k, v in tuning.defaults.items() if k in resolved})
    for key, value in (config or {}).items():
        if key not in family.params:
            raise KgenUserError(
                f"{spec.name}: tuning parameter '{key}' is not known to the {family.kind} template "
                f"(known: {', '.join(sorted(family.params))})"
            )
        resolved[key] = int(value)
    return resolved
