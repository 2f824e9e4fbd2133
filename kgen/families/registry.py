"""Kernel families: one module per `kind` (docs/architecture.md); the registry maps a spec to its
family: by its kind, then by its pool format (kgen/families/pool.py's `pool_of`)."""

from __future__ import annotations

from collections.abc import Iterator

from kgen.errors import UnsupportedError
from kgen.families.attention.decode import PAGED_DECODE
from kgen.families.attention.mla import MLA_DECODE, MLA_PREFILL
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.base import Family
from kgen.families.cache.copy import COPY_BLOCKS
from kgen.families.cache.mla_write import MLA_CACHE_WRITE
from kgen.families.cache.write import CACHE_WRITE
from kgen.families.pool import LatentPool, PagedPool, pool_of

# {kind: {pool format name: the family that builds the kind over that pool}}. The mla layout's latent
# pool (docs/abi.md "MLA": latent rows read once for K and V) has bodies of its own.
FAMILIES: dict[str, dict[str, Family]] = {
    "paged_decode": {PagedPool.name: PAGED_DECODE, LatentPool.name: MLA_DECODE},
    "paged_prefill": {PagedPool.name: PAGED_PREFILL, LatentPool.name: MLA_PREFILL},
    "cache_write": {PagedPool.name: CACHE_WRITE, LatentPool.name: MLA_CACHE_WRITE},
    "copy_blocks": {PagedPool.name: COPY_BLOCKS},
}


def registered() -> Iterator[Family]:
    """Every registered family (each kind's, over each pool it is built for)."""
    for by_pool in FAMILIES.values():
        yield from by_pool.values()


def family_for(spec) -> Family:
    """The family that generates `spec`, or UnsupportedError naming what is missing."""
    by_pool = FAMILIES.get(spec.kind)
    if by_pool is None:
        raise UnsupportedError(
            f"{spec.name}: kind '{spec.kind}' is not supported yet "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    pool = pool_of(spec)
    family = by_pool.get(pool.name)
    if family is None:
        built = sorted(kind for kind, families in FAMILIES.items() if pool.name in families)
        raise UnsupportedError(f"{spec.name}: kind '{spec.kind}' is not built for kv_cache.layout "
                               f"{spec.kv_cache.layout} yet ({spec.kv_cache.layout} kinds: {', '.join(built)})")
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
