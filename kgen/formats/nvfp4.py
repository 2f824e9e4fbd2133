"""NVFP4 (docs/abi.md, NVFP4 caches): the exact numpy model of kgen's nvfp4 cache writes, and the
decoding the golden reads. templates/common/cache_write.cuh (writes) and convert.cuh (decoding) do
the same on the device; the verifier compares the two bit for bit, so a change on one side must be
made on the other.

A row of head_dim values is cut into groups of GROUP = 16. All arithmetic is fp32 with IEEE
round-to-nearest-even division and products:

    amax_g = max |x| over the group        (NaN ignored, as fmaxf does; starts at 0)
    d      = 6 * tensor_scale
    s_g    = e4m3_rn_sat(amax_g / d)       (round to nearest even, saturating to ±448)
    t_g    = float(s_g) * tensor_scale
    q_i    = e2m1_rn_sat(x_i / t_g)        (round to nearest even, saturating to ±6)

A negative value that rounds to zero stores -0 (nibble 8); a group whose s_g is zero stores nibble
0 for every element. NaN and infinities (a decision of kgen's, the format has neither): a NaN
element stores +0 and does not take part in amax; ±inf makes amax inf, so s_g saturates to 448
and the element stores ±6. Element 2i of a row is the low nibble of byte i, 2i+1 the high one.
"""

from __future__ import annotations

import numpy as np

from kgen.formats.dtypes import ml_dtype

GROUP = 16  # elements per e4m3 block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# The 8 magnitudes of e2m1 by code (bits e1 e0 m); bit 3 of a nibble is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# Round to nearest even: code = number of these a magnitude reaches (the midpoints between codes; a
# midpoint goes to the even code, so `>` where the lower code is even and `>=` where it is odd).
_UP_STRICT = np.array([0.25, 1.25, 2.5, 5.0], dtype=np.float32)   # lower code even: ties stay down
_UP_TIES = np.array([0.75, 1.75, 3.5], dtype=np.float32)          # lower code odd: ties go up


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """Nibbles (uint8, sign in bit 3) of fp32 values y, rounded to nearest even and saturated to ±6;
    -0 for a negative value that rounds to zero, +0 for NaN."""
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y)
    code = (a[..., None] > _UP_STRICT).sum(-1) + (a[..., None] >= _UP_TIES).sum(-1)
    sign = np.signbit(y) & ~np.isnan(y)
    return (code.astype(np.uint8) | (sign.astype(np.uint8) << 3)).astype(np.uint8)


def e2m1_decode(nibbles: np.ndarray) -> np.ndarray:
    """fp32 values of nibbles (-0 stays -0)."""
    n = np.asarray(nibbles, dtype=np.uint8)
    mag = E2M1_VALUES[n & 7]
    return np.where(n & 8, -mag, mag).astype(np.float32)


def e4m3_rn_sat(x: np.ndarray) -> np.ndarray:
    """fp32 -> e4m3 bits (uint8), round to nearest even, saturated to ±448 (NaN stays NaN)."""
    x = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtype("float8_e4m3fn")).view(np.uint8)


def e4m3_decode(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint8).view(ml_dtype("float8_e4m3fn")).astype(np.float32)


def _check_rows(x: np.ndarray) -> None:
    if x.ndim < 1 or x.shape[-1] % (2 * GROUP):
        raise ValueError(f"nvfp4 rows: the last dim must be a multiple of {2 * GROUP} (got shape {list(x.shape)})")


def quantize(x: np.ndarray, tensor_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(packed [..., D/2] uint8, block scales [..., D/16] uint8 e4m3 bits) of rows x [..., D]."""
    x = np.asarray(x).astype(np.float32)
    _check_rows(x)
    ts = np.float32(tensor_scale)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = np.fmax.reduce(np.abs(groups), axis=-1, initial=np.float32(0))
    d = np.float32(E2M1_MAX) * ts
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        s = e4m3_rn_sat(amax / d)  # fp32 division, then one rounding to e4m3
        t = (e4m3_decode(s) * ts).astype(np.float32)
        codes = e2m1_codes(groups / t[..., None])
    codes = np.where(e4m3_decode(s)[..., None] == 0, np.uint8(0), codes).reshape(x.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, s


def unpack(packed: np.ndarray) -> np.ndarray:
    """Nibbles [..., D] of packed bytes [..., D/2] (element 2i the low nibble of byte i)."""
    p = np.asarray(packed, dtype=np.uint8)
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def scaled_values(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e2m1 * e4m3 of each element, fp32 [..., D] (exact: 2 and 4 significant bits, and also exact in
    fp16 and bf16); times the tensor scale it is the real value."""
    e = e2m1_decode(unpack(packed))
    s = e4m3_decode(scales)
    return (e.reshape(*s.shape, GROUP) * s[..., None]).reshape(e.shape).astype(np.float32)


def dequantize(packed: np.ndarray, scales: np.ndarray, tensor_scale: float) -> np.ndarray:
    """Real values [..., D] in float64: e2m1 * e4m3 * tensor_scale."""
    return scaled_values(packed, scales).astype(np.float64) * float(np.float32(tensor_scale))
