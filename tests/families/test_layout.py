"""kgen/formats/cache.py, the one home of the cache layouts: canonical <-> layout round trips,
and the kernel strides read back element by element from memory, padded pools included."""

from __future__ import annotations

import numpy as np
import pytest

import kgen
from kgen.arrays import as_array_arg
from kgen.formats.cache import (
    cache_shapes,
    cache_strides,
    from_layout,
    scale_from_layout,
    scale_pool_strides,
    scale_shape,
    scale_to_layout,
    to_layout,
    vllm_x,
)

BASE = {
    "kgen": 1, "name": "layout", "kind": "paged_decode",
    "attention": {"num_q_heads": 6, "num_kv_heads": 3, "head_dim": 32},
    "kv_cache": {"block_size": 4, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
LAYOUTS = [("separate", "NHD"), ("separate", "HND"), ("fused", "NHD"), ("fused", "HND"), ("vllm", None)]
N = 5


def _spec(layout, order, **more):
    return kgen.spec_from_dict(BASE).with_overrides(kv_cache={"layout": layout, "order": order}, **more)


def _canonical(spec):
    """K and V [N, B, H, D] with every element distinct."""
    a, kv = spec.attention, spec.kv_cache
    n = N * kv.block_size * a.num_kv_heads * a.head_dim
    shape = (N, kv.block_size, a.num_kv_heads, a.head_dim)
    return np.arange(n, dtype=np.float32).reshape(shape), -np.arange(n, dtype=np.float32).reshape(shape)


def _padded(arr):
    """`arr` as a view into a larger buffer (every axis padded), and that buffer."""
    big = np.full(tuple(2 * n + 1 for n in arr.shape), np.nan, arr.dtype)
    view = big[tuple(slice(1, 1 + n) for n in arr.shape)]
    view[...] = arr
    return view, big


@pytest.mark.parametrize("layout,order", LAYOUTS)
def test_layout_round_trip_and_abi_shapes(layout, order):
    spec = _spec(layout, order)
    k, v = _canonical(spec)
    arrays = to_layout(spec, k, v)
    assert {n: a.shape for n, a in arrays.items()} == cache_shapes(spec, N)
    gk, gv = from_layout(spec, arrays)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, v)


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("layout,order", LAYOUTS)
def test_kernel_strides_address_every_element(layout, order, padded):
    """Element (block n, token t, head h, dim d) read through the strides, as the kernels do:
    base + n*s_block + h*s_head + t*s_token + (d // RUN)*s_run + d % RUN."""
    spec = _spec(layout, order)
    a = spec.attention
    k, v = _canonical(spec)
    arrays = to_layout(spec, k, v)
    buffers = {}
    for name in list(arrays):
        if padded:
            arrays[name], buffers[name] = _padded(arrays[name])
        else:
            buffers[name] = arrays[name]
    st = cache_strides(spec, [as_array_arg(n, x) for n, x in arrays.items()])
    runs = (vllm_x(spec), 1) if layout == "vllm" else (a.head_dim, a.head_dim)
    n, t, h, d = np.meshgrid(*(np.arange(s) for s in k.shape), indexing="ij")
    for which, base, strides, run, want in (("k", st.k_base, st.k, runs[0], k), ("v", st.v_base, st.v, runs[1], v)):
        owner = buffers["kv_cache" if layout == "fused" else f"{which}_cache"]
        address = base if isinstance(base, int) else base.ctypes.data
        offset = (address - owner.ctypes.data) // owner.itemsize
        sb, sh, stok, srun = strides
        index = offset + n * sb + h * sh + t * stok + (d // run) * srun + d % run
        np.testing.assert_array_equal(owner.reshape(-1)[index], want, err_msg=which)
    if layout == "fused":
        assert st.v_offset == arrays["kv_cache"].strides[1] // arrays["kv_cache"].itemsize


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_scale_pools_round_trip_and_strides(order):
    spec = _spec("separate", order, **{"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"})
    canon = np.arange(N * 4 * 3, dtype=np.float32).reshape(N, 4, 3)
    pool = scale_to_layout(spec, canon)
    assert pool.shape == scale_shape(spec, N)
    np.testing.assert_array_equal(scale_from_layout(spec, pool), canon)
    view, big = _padded(np.ascontiguousarray(pool))
    sb, sh, stok = scale_pool_strides(spec, as_array_arg("k_scale", view))
    offset = (view.ctypes.data - big.ctypes.data) // big.itemsize
    n, t, h = np.meshgrid(*(np.arange(s) for s in canon.shape), indexing="ij")
    np.testing.assert_array_equal(big.reshape(-1)[offset + n * sb + h * sh + t * stok], canon)
