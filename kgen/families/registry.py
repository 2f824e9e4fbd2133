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
    problems = unbuilt_features(spec) + family.unsupported(spec)
    if problems:
        raise UnsupportedError("\n".join(f"{spec.name}: {p}" for p in problems))
    return family


def unbuilt_features(spec) -> list[str]:
    """Spec features the format accepts (docs/abi.md) whose kernels are not built yet: one line each,
    removed as each lands, so a spec that asks for one is refused instead of silently ignored."""
    a, kv = spec.attention, spec.kv_cache
    out = []
    if a.sinks:
        out.append("attention.sinks: attention sinks are not built yet")
    if a.v_head_dim is not None and kv.layout != "mla":
        out.append("attention.v_head_dim: a V head dim of its own is not built yet")
    if kv.layout == "mla":
        out.append("kv_cache.layout: the mla layout is not built yet")
    if kv.dtype == "nvfp4" and kv.layout == "mla":
        out.append("kv_cache.dtype: nvfp4 caches in the mla layout are not built yet (nvfp4 is built for the "
                   "separate layout, NHD and HND)")
    return out


def support_problems(spec) -> list[str]:
    """Every reason kgen cannot generate `spec` yet (empty when it can)."""
    try:
        family_for(spec)
    except UnsupportedError as e:
        return str(e).splitlines()
    return []
