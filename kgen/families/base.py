"""The interface every kernel family implements, and the config (tuning parameters) type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kgen.runtime.base import Launch

Config = dict[str, int]


@dataclass(frozen=True)
class TunableParam:
    name: str
    default: int
    help: str


class Family(Protocol):
    kind: str
    template: str  # file under templates/
    params: dict[str, TunableParam]

    def unsupported(self, spec) -> list[str]: ...

    def check_config(self, spec, config: Config) -> list[str]: ...

    def template_context(self, spec, config: Config) -> dict[str, Any]: ...

    def kernel_names(self, spec, config: Config) -> list[str]: ...

    def plan(self, spec, config: Config, call: dict[str, Any], alloc) -> tuple[list[Launch], Any]: ...


def threads_problems(threads: int) -> list[str]:
    """The thread-block size rule every family shares (whole warps, at most 1024 threads)."""
    if threads % 32 or not 32 <= threads <= 1024:
        return [f"threads must be a multiple of 32 in 32..1024 (got {threads})"]
    return []


class SingleKernelFamily:
    """A family with one kernel per spec whose only tunable is `threads`."""

    def check_config(self, spec, config: Config) -> list[str]:
        return threads_problems(config["threads"])

    def kernel_names(self, spec, config: Config) -> list[str]:
        return [spec.name]


def resolve_config(family: Family, spec, config: Config | None) -> Config:
    """Fill defaults (family's, then the spec's tuning.defaults), refuse unknown parameters."""
    resolved = {name: p.default for name, p in family.params.items()}
    tuning = getattr(spec, "tuning", None)
    if tuning is not None:
        resolved.update({k: v for k, v in tuning.defaults.items() if k in resolved})
    for key, value in (config or {}).items():
        if key not in family.params:
            from kgen.errors import KgenUserError

            raise KgenUserError(
                f"{spec.name}: tuning parameter '{key}' is not known to the {family.kind} template "
                f"(known: {', '.join(sorted(family.params))})"
            )
        resolved[key] = int(value)
    return resolved
