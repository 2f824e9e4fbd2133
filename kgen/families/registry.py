"""Kernel families: one module per `kind` (docs/architecture.md); the registry maps a spec to its family."""

from __future__ import annotations

from kgen.errors import UnsupportedError
from kgen.families.attention.decode import PAGED_DECODE
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.base import Family
from kgen.families.cache.copy import COPY_BLOCKS
from kgen.families.cache.write import CACHE_WRITE

FAMILIES: dict[str, Family] = {PAGED_DECODE.kind: PAGED_DECODE, PAGED_PREFILL.kind: PAGED_PREFILL,
                               CACHE_WRITE.kind: CACHE_WRITE, COPY_BLOCKS.kind: COPY_BLOCKS}


def family_for(spec) -> Family:
    """The family that generates `spec`, or UnsupportedError naming what is missing."""
    family = FAMILIES.get(spec.kind)
    if family is None:
        raise UnsupportedError(
            f"{spec.name}: kind '{spec.kind}' is not supported yet "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    problems = family.unsupported(spec)
    if problems:
        raise UnsupportedError("\n".join(f"{spec.name}: {p}" for p in problems))
    return family


def support_problems(spec) -> list[str]:
    """Every reason kgen cannot generate `spec` yet (empty when it can)."""
    try:
        family_for(spec)
    except UnsupportedError as e:
        return str(e).splitlines()
    return []
