"""Kernel families: one module per `kind` (docs/architecture.md); the registry maps a spec to its family."""

from __future__ import annotations

from kgen.errors import UnsupportedError
from kgen.families.attention.decode import PAGED_DECODE
from kgen.families.attention.mla import MLA_DECODE, MLA_PREFILL
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.base import Family
from kgen.families.cache.copy import COPY_BLOCKS
from kgen.families.cache.mla_write import MLA_CACHE_WRITE
from kgen.families.cache.write import CACHE_WRITE

FAMILIES: dict[str, Family] = {PAGED_DECODE.kind: PAGED_DECODE, PAGED_PREFILL.kind: PAGED_PREFILL,
                               CACHE_WRITE.kind: CACHE_WRITE, COPY_BLOCKS.kind: COPY_BLOCKS}
# The mla layout's kernels (docs/abi.md "MLA"): latent rows read once for K and V, their own bodies.
MLA_FAMILIES: dict[str, Family] = {MLA_DECODE.kind: MLA_DECODE, MLA_PREFILL.kind: MLA_PREFILL,
                                   MLA_CACHE_WRITE.kind: MLA_CACHE_WRITE}


def family_for(spec) -> Family:
    """The family that generates `spec`, or UnsupportedError naming what is missing."""
    family = (MLA_FAMILIES if spec.kv_cache.layout == "mla" else FAMILIES).get(spec.kind)
    if family is None and spec.kv_cache.layout == "mla" and spec.kind in FAMILIES:
        raise UnsupportedError(f"{spec.name}: kind '{spec.kind}' is not built for kv_cache.layout mla yet "
                               f"(mla kinds: {', '.join(sorted(MLA_FAMILIES))})")
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
    kv = spec.kv_cache
    out = []
    if kv.dtype == "nvfp4" and kv.layout == "mla":
        out.append("kv_cache.dtype: nvfp4 caches in the mla layout are not built yet (nvfp4 is built for the "
                   "separate layout, NHD and HND)")
    if kv.dtype == "nvfp4" and spec.v_head_dim_value != spec.attention.head_dim:
        out.append("attention.v_head_dim: nvfp4 caches with a V head dim of its own are not built yet (allowed: "
                   "v_head_dim equal to head_dim, or another cache dtype)")
    return out


def support_problems(spec) -> list[str]:
    """Every reason kgen cannot generate `spec` yet (empty when it can)."""
    try:
        family_for(spec)
    except UnsupportedError as e:
        return str(e).splitlines()
    return []
