"""The fp8_ds_mla row (kgen/formats/ds_mla.py): byte positions written out by hand, dequantization
(e4m3 * its tile's scale, rope as stored), poison rows, and the pool's place in kgen/formats/cache.py."""

import struct

import ml_dtypes
import numpy as np
import pytest

import kgen
from kgen.formats import ds_mla
from kgen.formats.cache import cache_shapes, from_layout

E4M3 = ml_dtypes.float8_e4m3fn


def _row_by_hand(latent_codes: np.ndarray, scales: list[float], rope: np.ndarray) -> np.ndarray:
    """One row assembled with struct: 512 code bytes, 4 little-endian fp32, 64 bf16 bit patterns."""
    raw = bytes(latent_codes.tolist()) + struct.pack("<4f", *scales) + \
        struct.pack("<64H", *rope.astype(ml_dtypes.bfloat16).view(np.uint16).tolist())
    assert len(raw) == 656
    return np.frombuffer(raw, dtype=np.uint8).copy()


def test_dequantize_reads_each_part_at_its_bytes():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, 512, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN codes
    scales = [2.0 ** -13, 0.5, 3.0, 2.0 ** 20]
    rope = rng.standard_normal(64)
    row = _row_by_hand(codes, scales, rope)
    got = ds_mla.dequantize_rows(row[None])[0]
    want = codes.view(E4M3).astype(np.float64) * np.repeat(scales, 128)
    assert np.array_equal(got[:512].astype(np.float64), want)
    assert np.array_equal(got[512:], rope.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_poison_rows_read_nan_everywhere():
    got = ds_mla.dequantize_rows(ds_mla.poison_rows((2, 3)))
    assert got.shape == (2, 3, 576) and np.isnan(got).all()


def test_split_rows_refuses_other_shapes():
    with pytest.raises(ValueError, match="656"):
        ds_mla.split_rows(np.zeros((2, 576), dtype=np.uint8))


def _spec(kind="paged_decode"):
    return kgen.spec_from_dict({
        "kgen": 1, "name": "ds", "kind": kind, "tail_masking": True, "targets": ["sm_90"],
        "attention": {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 576, "v_head_dim": 512, "softmax_scale": 0.1},
        "kv_cache": {"block_size": 4, "layout": "mla", "dtype": "fp8_ds_mla"}, "dtype": {"q": "bf16"}})


def test_pool_shape_and_canonical_views_are_dequantized_rows():
    spec = _spec()
    assert cache_shapes(spec, 3) == {"kv_cache": (3, 4, 656)}
    rows = np.stack([ds_mla.poison_rows(()) for _ in range(12)]).reshape(3, 4, 656)
    rows[1, 2] = _row_by_hand(np.full(512, 0x38, np.uint8), [1.0, 2.0, 4.0, 8.0], np.arange(64.0))  # e4m3 0x38 = 1.0
    k, v = from_layout(spec, {"kv_cache": rows})
    assert k.shape == (3, 4, 1, 576) and v.shape == (3, 4, 1, 512)
    assert np.array_equal(k[1, 2, 0, :512], np.repeat([1.0, 2.0, 4.0, 8.0], 128))
    assert np.array_equal(k[1, 2, 0, 512:], np.arange(64.0)) and np.isnan(k[0]).all()


def test_to_layout_quantizes_the_latent_rows():
    from kgen.formats.cache import to_layout
    from kgen.quantize import quantize_ds_mla_rows
    k = np.random.default_rng(2).standard_normal((3, 4, 1, 576)).astype(ml_dtypes.bfloat16).astype(np.float64)
    pool = to_layout(_spec(), k, k[..., :512])["kv_cache"]
    assert np.array_equal(pool, quantize_ds_mla_rows(k[:, :, 0].astype(ml_dtypes.bfloat16)))
