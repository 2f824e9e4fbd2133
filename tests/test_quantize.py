"""kgen/quantize.py's fp8_ds_mla quantizer, the bit-exact oracle of cache_write, against FlashMLA's
rule written out independently (tests/quant.py of deepseek-ai/FlashMLA, V32 layout: per 128-value
tile, scale = 2^ceil(log2(max(amax / 448, 1e-4))) in fp32, stored = e4m3(x / scale)), and against
the properties that rule guarantees."""

import ml_dtypes
import numpy as np
import pytest

from kgen.formats import ds_mla
from kgen.quantize import ds_mla_tile_scales, pow2_ceil, quantize_ds_mla_rows

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def _flashmla_scale(amax: np.ndarray) -> np.ndarray:
    """FlashMLA's formula as written there: fp32 amax / 448, clamped to 1e-4, 2^ceil(log2(.))."""
    v = np.maximum(np.asarray(amax, np.float32) / np.float32(448.0), np.float32(1e-4))
    return np.exp2(np.ceil(np.log2(v))).astype(np.float32)


def _all_bf16_magnitudes() -> np.ndarray:
    bits = np.arange(0, 0x7F80, dtype=np.uint16)  # +0 .. the largest finite bf16
    return bits.view(BF16).astype(np.float32)


def test_scale_rule_matches_flashmla_formula_for_every_bf16_amax():
    """kgen computes 2^ceil(log2 v) exactly (exponent arithmetic, no log2); for every amax a bf16 row can
    have, that is FlashMLA's log2-based value (no amax / 448 lands close enough above a power of two for
    fp32 log2 to round down to it)."""
    amax = _all_bf16_magnitudes()
    rows = np.zeros((amax.size, ds_mla.HEAD_DIM), dtype=BF16)
    rows[:, 5] = amax.astype(BF16)  # tile 0 holds the amax; tiles 1..3 are zero
    got = ds_mla_tile_scales(rows)
    assert np.array_equal(got[:, 0], _flashmla_scale(amax))
    assert np.all(got[:, 1:] == np.float32(2.0 ** -13))  # zero tiles: the 1e-4 floor, rounded up to 2^-13


def test_pow2_ceil_is_the_smallest_power_of_two_not_below():
    rng = np.random.default_rng(0)
    v = np.concatenate([np.exp2(rng.integers(-126, 127, 2000)),  # powers of two stay
                        rng.uniform(1e-30, 1e30, 2000), [np.float32(1.0) + np.float32(2.0 ** -23)]]).astype(np.float32)
    p = pow2_ceil(v)
    m, _ = np.frexp(p)
    assert np.all(m == 0.5) and np.all(p >= v) and np.all(p / 2 < v)
    assert pow2_ceil(np.float32(np.inf)) == np.inf


def _nearest_e4m3(y: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto the finite e4m3 grid, by search over its 254 finite codes (no cast),
    saturating to +-448: the rounding FlashMLA's .to(float8_e4m3fn) makes below 480."""
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(E4M3).astype(np.float64)
    ok = np.isfinite(vals)
    codes, vals = codes[ok], vals[ok]
    d = np.abs(y[:, None].astype(np.float64) - vals[None, :])
    best = d.min(axis=1, keepdims=True)
    tie = d == best
    even = (codes & 1) == 0  # the even mantissa wins a tie (e4m3's low code bit is the mantissa's last)
    pick = np.where(tie & even[None, :], 1, 0) + np.where(tie, 1, 0)
    out = vals[np.argmax(pick, axis=1)]
    return np.where(np.signbit(y) & (out == 0), -0.0, out)


def test_stored_values_are_the_nearest_e4m3_of_x_over_scale():
    rng = np.random.default_rng(1)
    gains = np.concatenate([np.repeat(np.exp2(rng.integers(-18, 18, (64, 4))), 128, axis=1), np.ones((64, 64))], axis=1)
    x = rng.standard_normal((64, ds_mla.HEAD_DIM)) * gains
    x = x.astype(BF16)
    rows = quantize_ds_mla_rows(x)
    latent, scales, rope = ds_mla.split_rows(rows)
    assert np.array_equal(scales, ds_mla_tile_scales(x))
    y = (x[:, :512].astype(np.float32).reshape(64, 4, 128) / scales[:, :, None]).reshape(-1)
    want = _nearest_e4m3(y).reshape(64, 512)
    got = latent.astype(np.float64)
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    assert np.array_equal(rope.view(np.uint16), np.ascontiguousarray(x[:, 512:]).view(np.uint16))  # rope: the bits


def test_the_rule_never_saturates_and_uses_the_range():
    """scale >= amax / 448, so no value leaves e4m3's range; the smallest such power of two, so a tile
    above the floor puts its amax in (224, 448]."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((500, ds_mla.HEAD_DIM)) *
         np.exp2(rng.integers(-30, 30, (500, 1)))).astype(BF16)
    s = ds_mla_tile_scales(x)
    amax = np.abs(x[:, :512].astype(np.float32)).reshape(500, 4, 128).max(axis=2)
    r = amax / s
    assert np.all(r <= 448)
    above = amax / 448 > 1e-4
    assert np.all(r[above] > 224) and np.all(s[~above] == np.float32(2.0 ** -13))


def test_tiles_of_very_different_magnitudes_each_keep_their_precision():
    x = np.zeros(ds_mla.HEAD_DIM)
    rng = np.random.default_rng(3)
    for t, gain in enumerate([2.0 ** -20, 1.0, 2.0 ** 20, 0.0]):
        x[t * 128:(t + 1) * 128] = rng.standard_normal(128) * gain
    x[512:] = rng.standard_normal(64)
    x = x.astype(BF16)
    back = ds_mla.dequantize_rows(quantize_ds_mla_rows(x[None]))[0].astype(np.float64)
    xf = x.astype(np.float64)
    s = ds_mla_tile_scales(x[None])[0]
    for t in range(3):
        sl = slice(t * 128, (t + 1) * 128)
        # e4m3: 3 mantissa bits (relative error <= 2^-4), or half the subnormal step 2^-9 of the scale
        assert np.all(np.abs(back[sl] - xf[sl]) <= np.maximum(np.abs(xf[sl]) * 2.0 ** -4, s[t] * 2.0 ** -10))
    assert np.all(back[384:512] == 0) and np.array_equal(back[512:], xf[512:])


def test_refuses_rows_of_another_width():
    with pytest.raises(ValueError, match="576"):
        quantize_ds_mla_rows(np.zeros((2, 512), dtype=BF16))
