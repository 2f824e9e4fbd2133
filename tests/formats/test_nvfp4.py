"""The nvfp4 reference quantizer (kgen/formats/nvfp4.py) against ml_dtypes' own e2m1 and e4m3
types and against the format's rule (docs/abi.md) written out element by element."""

import ml_dtypes
import numpy as np
import pytest

from kgen.formats import nvfp4


def _ml_e2m1_codes(y: np.ndarray) -> np.ndarray:
    """ml_dtypes' float4_e2m1fn rounding (saturated to ±6 first: it has no inf) as nibbles."""
    y = np.clip(np.asarray(y, np.float32), -6, 6)
    return y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def test_e2m1_every_tie_and_neighbour_matches_ml_dtypes():
    values = nvfp4.E2M1_VALUES.astype(np.float64)
    mids = (values[1:] + values[:-1]) / 2
    probes = np.concatenate([values, mids, np.nextafter(mids, 0), np.nextafter(mids, 10), [6.5, 7, 1e30, 1e-30]])
    y = np.concatenate([probes, -probes]).astype(np.float32)
    assert np.array_equal(nvfp4.e2m1_codes(y), _ml_e2m1_codes(y))


def test_e2m1_random_values_match_ml_dtypes():
    y = np.random.default_rng(0).normal(0, 3, 100_000).astype(np.float32)
    assert np.array_equal(nvfp4.e2m1_codes(y), _ml_e2m1_codes(y))


def test_e2m1_negative_zero_and_nan():
    codes = nvfp4.e2m1_codes(np.array([-0.1, -0.25, -0.0, 0.1, np.nan, -np.nan, np.inf, -np.inf], np.float32))
    assert codes.tolist() == [8, 8, 8, 0, 0, 0, 7, 15]


def test_e2m1_decode_matches_ml_dtypes_bit_patterns():
    nibbles = np.arange(16, dtype=np.uint8)
    ours = nvfp4.e2m1_decode(nibbles)
    theirs = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # -0 included


def _brute_e4m3(x: float) -> int:
    """Nearest finite e4m3 by exhaustive search, ties to the even code, saturated to ±448."""
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ok = np.isfinite(vals)
    if np.isnan(x):
        return -1
    x = float(np.clip(x, -448, 448))
    dist = np.where(ok, np.abs(vals - x), np.inf)
    best = np.nonzero(dist == dist.min())[0]
    same_sign = [int(c) for c in best if np.signbit(vals[c]) == np.signbit(x)] or [int(c) for c in best]
    return min(same_sign, key=lambda c: (c & 1, c))


def test_e4m3_rounding_ties_subnormals_and_saturation():
    all_vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    fin = np.unique(all_vals[np.isfinite(all_vals) & (all_vals >= 0)])
    mids = (fin[1:] + fin[:-1]) / 2  # includes the subnormal ties (2^-10 steps)
    probes = np.concatenate([fin, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [460, 1e6, 2.0 ** -12]])
    probes = np.concatenate([probes, -probes]).astype(np.float32)
    ours = nvfp4.e4m3_rn_sat(probes)
    for x, c in zip(probes, ours, strict=True):
        assert int(c) == _brute_e4m3(float(x)), x


def _rule(row: np.ndarray, ts: float) -> tuple[list[int], list[int]]:
    """The nvfp4 rule (docs/abi.md) written out one group and one element at a time, in np.float32 scalars."""
    ts = np.float32(ts)
    nibbles, scales = [], []
    for g in range(0, row.size, 16):
        grp = row[g:g + 16].astype(np.float32)
        amax = np.float32(0)
        for v in grp:
            if not np.isnan(v):
                amax = max(amax, np.float32(abs(v)))
        with np.errstate(all="ignore"):
            y = np.float32(amax / np.float32(np.float32(6) * ts))
        s = _brute_e4m3(float(y))
        scales.append(s)
        sv = np.float32(np.uint8(s).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
        t = np.float32(sv * ts)
        for v in grp:
            if sv == 0 or np.isnan(v):
                nibbles.append(0)
                continue
            with np.errstate(all="ignore"):
                q = np.float32(v / t)
            code = int(_ml_e2m1_codes(np.array([q]))[0])
            if q < 0 and code == 0:
                code = 8
            nibbles.append(code)
    return nibbles, scales


@pytest.mark.parametrize("ts", [1.0, 0.0123, 3.7e-5, 250.0])
def test_quantize_matches_the_rule(ts):
    rng = np.random.default_rng(1)
    rows = rng.normal(0, 2, (6, 64)).astype(np.float32) * rng.choice([1e-6, 1e-3, 1, 50, 3000], (6, 1))
    rows[0, :16] = 0.0                       # an all-zero group: scale 0, nibbles 0
    rows[1, 3] = np.nan                      # NaN: +0, left out of amax
    rows[2, 20] = np.inf                     # inf: the group's scale saturates
    rows[3, 40:56] = -1e-30                  # a group whose scale underflows to 0
    rows[4, 5] = -1e-9                       # a negative that rounds to -0 next to large values
    rows[4, 6] = 5.0
    packed, scales = nvfp4.quantize(rows, ts)
    for r in range(rows.shape[0]):
        nib, sc = _rule(rows[r], ts)
        assert scales[r].tolist() == sc
        assert nvfp4.unpack(packed[r]).tolist() == nib


def test_roundtrip_error_is_bounded_by_one_scale_unit():
    x = np.random.default_rng(2).normal(0, 1, (100, 128)).astype(np.float32)
    ts = float(np.abs(x).max() / (448 * 6))
    packed, scales = nvfp4.quantize(x, ts)
    real = nvfp4.dequantize(packed, scales, ts)
    group_max = np.repeat(np.abs(x).reshape(100, 8, 16).max(-1), 16, axis=1)
    # half of e2m1's largest step (4 -> 6) is one unit t of the group, t <= amax / 6 * (1 + 2^-4)
    # (e4m3 rounds the scale by at most half an ulp); saturation past 6 costs less than that
    assert np.all(np.abs(real - x) <= group_max / 6 * (1 + 2.0 ** -4) + 1e-12)
    assert packed.shape == (100, 64) and scales.shape == (100, 8)


def test_rows_must_hold_whole_byte_pairs_of_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        nvfp4.quantize(np.zeros((2, 48), np.float32), 1.0)
