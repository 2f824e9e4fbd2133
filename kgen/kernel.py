"""A built kernel: an ordinary Python callable over the spec's ABI (docs/abi.md)."""

from __future__ import annotations

from typing import Any

from kgen.families.base import Config
from kgen.families.registry import family_for
from kgen.runtime.base import Module


class Kernel:
    """Call with keyword arguments: kern(q=..., k_cache=..., v_cache=..., block_tables=..., seq_lens=...).

    Every argument's shape, dtype, device and strides is checked; with `checked=True`
    (the default) the values the kernel trusts (seq_lens, the used block-table
    entries, the tail_masking contract) are checked on the host before launch.
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
        self.checked = True
        self._family = family_for(spec)

    @property
    def backend(self) -> str:
        return self.module.backend

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, **arguments: Any):
        launches, result = self._family.plan(self.spec, self.config, arguments, checked=self.checked)
        for launch in launches:
            self.module.launch(launch)
        return result

    def __repr__(self) -> str:
        verdict = "unverified" if self.report is None else ("passed" if self.report.passed else "FAILED")
        return f"<kgen.Kernel {self.name} kind={self.spec.kind} backend={self.backend} config={self.config} {verdict}>"
