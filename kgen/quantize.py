"""The exact numpy model of how kgen's cache kernels store values (docs/abi.md: real = stored * scale).

Every rule here mirrors one line of templates/common/cache_write.cuh; the verifier
compares the kernel against these functions bit for bit, so a change on one side
must be made on the other.

- Float caches (fp16, bf16, fp32): the input is widened to fp32 (exact) and rounded to
  the cache type, round-to-nearest-even (same type: copied as is).
- fp8 caches: stored = fp8(x / scale), the division in fp32 (IEEE, round to nearest),
  then one round-to-nearest-even to fp8 saturating to the finite range
  (__nv_cvt_float_to_fp8(., __NV_SATFINITE, .)): |x| beyond the largest finite value
  (448 for e4m3, 57344 for e5m2), infinities included, store ±that value; NaN stays NaN.
- int8 caches: stored = rint(clamp(x / scale, -127, 127)), round-half-to-even
  (__float2int_rn), a symmetric range (-128 is never written), NaN stores 0.
- per_token_head: the kernel also writes the scale of each written (slot, head):
  scale = fp32(max_d |x[d]|) / QMAX (fp32 division), QMAX = 448, 57344 or 127;
  a scale that is not > 0 (an all-zero row, or one so small the division underflows) is
  replaced by 1.0, so the division never produces 0/0.
- fp8_ds_mla rows (kgen/formats/ds_mla.py; FlashMLA's tests/quant.py, V32 layout): per tile of 128
  latent values, amax = fp32(max |x|) (NaN ignored, as fmaxf does), v = max(amax / 448, 1e-4) (fp32
  division), scale = the smallest power of two >= v (FlashMLA: 2^ceil(log2(v)), a UE8M0 value kept
  as fp32); stored = e4m3(x / scale) (exact division by a power of two, then fp8_e4m3's rounding
  above). The rope part is copied as bf16. mirrors templates/common/cache_write_mla.cuh's
  ds_mla_write_row.
"""

from __future__ import annotations

import numpy as np

from kgen.formats import ds_mla
from kgen.formats.dtypes import (  # QMAX: the largest magnitude each quantized dtype stores
    QMAX,
    QUANTIZED,
    dtype,
)


def to_cache_dtype(x: np.ndarray, name: str) -> np.ndarray:
    """Convert fp32 values (already divided by their scale) to the cache dtype `name`."""
    x = np.asarray(x, dtype=np.float32)
    if name == "int8":
        clamped = np.clip(np.where(np.isnan(x), np.float32(0), x), -127, 127)
        return np.rint(clamped).astype(np.int8)  # numpy's rint rounds half to even
    if name in ("fp8_e4m3", "fp8_e5m2"):
        limit = np.float32(QMAX[name])
        return np.clip(x, -limit, limit).astype(dtype(name).numpy)  # clip keeps NaN
    return x.astype(dtype(name).numpy)


def per_token_head_scale(rows: np.ndarray, name: str) -> np.ndarray:
    """Scales for rows [..., head_dim] (fp32): max|x| / QMAX, 1.0 where that is not > 0."""
    rows = np.asarray(rows, dtype=np.float32)
    # fmax ignores NaN as fmaxf does; the kernel's running max starts at 0
    amax = np.fmax.reduce(np.abs(rows), axis=-1, initial=np.float32(0))
    scale = (amax / np.float32(QMAX[name])).astype(np.float32)
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def quantize(x: np.ndarray, scale: np.ndarray | float | None, name: str) -> np.ndarray:
    """Stored values for inputs `x` (any float dtype) with `scale` broadcast against x (None: float cache)."""
    src = np.asarray(x)
    if name not in QUANTIZED:
        if src.dtype == dtype(name).numpy:
            return src.copy()
        return to_cache_dtype(src.astype(np.float32), name)
    if scale is None:
        raise ValueError(f"a {name} cache needs a scale")
    return to_cache_dtype(src.astype(np.float32) / np.asarray(scale, dtype=np.float32), name)



DS_MLA_SCALE_FLOOR = np.float32(1e-4)  # FlashMLA's clamp_min of amax / 448


def pow2_ceil(v: np.ndarray) -> np.ndarray:
    """The smallest power of two >= v, elementwise (fp32 v > 0; inf stays inf), exactly: a power of two
    is kept, anything else goes to the next power of two up."""
    v = np.asarray(v, dtype=np.float32)
    bits = v.view(np.uint32)
    up = ((bits & np.uint32(0x7F800000)) + np.uint32(0x00800000)).view(np.float32)  # exponent + 1, mantissa 0
    exact = (bits & np.uint32(0x007FFFFF)) == 0
    return np.where(exact | np.isinf(v), v, up).astype(np.float32)


def ds_mla_tile_scales(rows: np.ndarray) -> np.ndarray:
    """The fp32 scales [..., 4] of latent rows [..., 576] (any float dtype; the rule in this module's doc)."""
    x = np.abs(np.asarray(rows)[..., :ds_mla.LATENT].astype(np.float32))
    tiles = x.reshape(*x.shape[:-1], ds_mla.TILES, ds_mla.TILE)
    amax = np.fmax.reduce(tiles, axis=-1, initial=np.float32(0))
    v = np.fmax(amax / np.float32(QMAX["fp8_e4m3"]), DS_MLA_SCALE_FLOOR).astype(np.float32)
    return pow2_ceil(v)


def quantize_ds_mla_rows(rows: np.ndarray) -> np.ndarray:
    """uint8 fp8_ds_mla rows [..., 656] of bf16 latent rows [..., 576] (the bit-exact oracle of cache_write)."""
    src = np.asarray(rows)
    if src.shape[-1:] != (ds_mla.HEAD_DIM,):
        raise ValueError(f"fp8_ds_mla quantizes rows of {ds_mla.HEAD_DIM} elements (got {list(src.shape)})")
    out = np.empty(src.shape[:-1] + (ds_mla.ROW_BYTES,), dtype=np.uint8)
    latent, scales, rope = ds_mla.split_rows(out)  # views of the new rows' bytes
    s = ds_mla_tile_scales(src)
    x = src[..., :ds_mla.LATENT].astype(np.float32).reshape(*src.shape[:-1], ds_mla.TILES, ds_mla.TILE)
    with np.errstate(invalid="ignore"):  # an infinite tile: inf / inf
        q = to_cache_dtype(x / s[..., None], "fp8_e4m3")
    out[..., :ds_mla.SCALES_AT] = q.reshape(*src.shape[:-1], ds_mla.LATENT).view(np.uint8)
    out[..., ds_mla.SCALES_AT:ds_mla.ROPE_AT] = s.view(np.uint8).reshape(*src.shape[:-1], 4 * ds_mla.TILES)
    out[..., ds_mla.ROPE_AT:] = np.ascontiguousarray(
        src[..., ds_mla.LATENT:].astype(dtype("bf16").numpy)).view(np.uint8).reshape(*src.shape[:-1], 2 * ds_mla.ROPE)
    del latent, scales, rope
    return out
