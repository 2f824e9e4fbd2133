"""kgen/families/pool.py: the pool format a spec's cache layout picks, and what it gives the kinds (their
cache, scale and stride rows; template constants; bytes per token, checked against the arrays' shapes)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import kgen
from kgen.errors import ArgumentError
from kgen.families.base import resolve_config
from kgen.families.pool import LatentPool, PagedPool, pool_of
from kgen.families.registry import family_for
from kgen.formats.cache import CacheFormat, cache_shapes, scale_dtype, scale_shape
from kgen.formats.dtypes import dtype

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
# cache formats over a bundled decode spec (head_dim 128) and the bundled mla decode spec
PAGED = [{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor", "targets": ["sm_90"]},
         {"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "kv_cache.order": "HND"},
         {"kv_cache.dtype": "nvfp4", "kv_cache.scale": "none", "targets": ["sm_90"]}, {"kv_cache.layout": "fused"},
         {"kv_cache.layout": "vllm", "kv_cache.order": None}]
LATENT = [{}, {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"}, {"kv_cache.dtype": "fp8_ds_mla"}]
FORMATS = [("llama3_8b_decode", o) for o in PAGED] + [("deepseek_v3_mla_decode", o) for o in LATENT]


def _spec(stem: str, overrides: dict):
    spec = kgen.load_spec(ROOT / "specs" / f"{stem}.yaml")
    return spec.with_overrides(**overrides) if overrides else spec


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_the_layout_picks_the_pool(path):
    spec = kgen.load_spec(path)
    assert type(pool_of(spec)) is (LatentPool if spec.kv_cache.layout == "mla" else PagedPool)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_kind_takes_its_pool_rows_from_the_pool(path):
    """The cache, scale and stride parameters of a kind's table are its pool's rows (in the pool's order);
    copy_blocks takes the pool as call arguments (its kernel reads a plane table)."""
    spec = kgen.load_spec(path)
    family, pool = family_for(spec), pool_of(spec)
    table = family.arguments(spec, resolve_config(family, spec, family.abi_config(spec)))
    names = [a.name for a in table]
    if spec.kind == "copy_blocks":
        return
    cache_names = [a.name for a in pool.cache_args("input", const=True)]
    assert cache_names == list(pool.cache_names) or cache_names == ["k_cache", "v_cache"]  # a fused pool's halves
    for rows in (pool.cache_args("input", const=True), pool.scale_args()):
        found = [n for n in names if n in {a.name for a in rows}]
        assert found == [a.name for a in rows]
    strides = [a.name for a in table if a.role == "stride"][-len(pool.stride_args()):]
    if spec.kind == "cache_write" and isinstance(pool, LatentPool):  # cache_write's names: c_s_*, cs_s_*
        assert strides == [a.name for a in pool.stride_args("c", "cs")]
    else:
        assert strides == [a.name for a in pool.stride_args()]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_template_context_carries_the_pool_constants(path):
    spec = kgen.load_spec(path)
    family = family_for(spec)
    if spec.kind == "copy_blocks":
        return
    config = resolve_config(family, spec, None)
    kernels = family.kernels(spec, config)
    ctx = family.template_context(spec, config, kernels)
    want = pool_of(spec).template_constants(list(kernels[0].params))
    assert {k: ctx[k] for k in want} == want


@pytest.mark.parametrize("stem,overrides", FORMATS, ids=lambda x: str(x))
def test_bytes_per_token_is_what_the_arrays_hold(stem, overrides):
    """From the ABI shapes of one block: the cache arrays' bytes and, when the scales are pools with a row
    per token, theirs, over block_size tokens."""
    spec = _spec(stem, overrides)
    f = CacheFormat.of(spec)
    element = 1 if f.dtype.packed else f.dtype.itemsize  # a packed cache's ABI shapes count bytes
    cache = sum(math.prod(shape) for shape in cache_shapes(spec, 1).values()) * element
    scales = 0
    if f.per_token or f.block_scaled:
        per = math.prod(scale_shape(spec, 1)) * dtype(scale_dtype(spec)).itemsize
        scales = per * (1 if f.mla else 2)  # the latent pool's one scale set; k_scale and v_scale
    assert pool_of(spec).bytes_per_token() == (cache + scales) / spec.kv_cache.block_size


def test_latent_pool_refuses_k_and_v_scales():
    spec = _spec("deepseek_v3_mla_decode", {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"})
    family = family_for(spec)
    config = resolve_config(family, spec, None)
    D, B = spec.attention.head_dim, spec.kv_cache.block_size
    call = {"q": np.zeros((1, spec.attention.num_q_heads, D), dtype("bf16").numpy),
            "kv_cache": np.zeros((2, B, D), np.uint8).view(dtype("fp8_e4m3").numpy),
            "block_tables": np.zeros((1, 1), np.int32), "seq_lens": np.ones(1, np.int32), "k_scale": 1.0}
    with pytest.raises(ArgumentError, match="k_scale: not an argument of the mla layout"):
        family.bind(spec, config, call)
