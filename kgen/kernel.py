"""A built kernel: an ordinary Python callable over the spec's ABI (docs/abi.md)."""

from __future__ import annotations

from typing import Any

from kgen.arrays import checks_values
from kgen.families.base import Config
from kgen.families.registry import family_for
from kgen.runtime.base import Module


class Kernel:
    """Call with keyword arguments: kern(q=..., k_cache=..., v_cache=..., block_tables=..., seq_lens=...).

    Every argument's shape, dtype, device and strides is checked (host metadata only). The
    values the kernel trusts (seq_lens, the used block-table entries, the tail_masking
    contract, slots) are checked too when `debug` is True; None (the default) defers to
    KGEN_DEBUG, and when that is unset checks them on the CPU backend only, where they are
    host arrays: on a GPU the check would copy them to the host, a synchronisation per call.
    """

    def __init__(self, spec, source: str, config: Config, module: Module, kernel_names: list[str],
                 resources: dict[str, Any] | None = None, report=None, artifacts: dict[str, Any] | None = None):
        self.spec = spec
        self.source = source
        self.config = dict(config)
        self.module = module
        self.kernel_names = list(kernel_names)
        self.resources = resources or {}
        self.report = report
        self.artifacts = artifacts or {}
        self.debug: bool | None = None
        self._family = family_for(spec)

    @property
    def backend(self) -> str:
        return self.module.backend

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, **arguments: Any):
        checked = checks_values(self.backend, self.debug)
        launches, result = self._family.plan(self.spec, self.config, arguments, checked=checked)
        for launch in launches:
            self.module.launch(launch)
        return result

    def __repr__(self) -> str:
        verdict = "unverified" if self.report is None else ("passed" if self.report.passed else "FAILED")
        return f"<kgen.Kernel {self.name} kind={self.spec.kind} backend={self.backend} config={self.config} {verdict}>"
