"""nvfp4's part of the cache kinds' verification inputs (docs/verification.md): tensor scales and
rows that reach every rounding rule of kgen/formats/nvfp4.py (e2m1 ties, e4m3 subnormal and
saturating block scales, -0, all-zero groups, NaN and infinities)."""

from __future__ import annotations

import numpy as np

from kgen.formats import nvfp4

TENSOR_SCALES = ("k_tensor_scale", "v_tensor_scale")


def tensor_scales(rng: np.random.Generator, pow2: bool) -> dict[str, np.ndarray]:
    """k/v tensor scales, log-uniform over 1e-5 .. 30: unit-normal rows then take block scales from
    saturated (448) through normal to e4m3 subnormals; powers of two for the edge rows."""
    if pow2:
        return {n: np.asarray(np.exp2(rng.integers(-6, 1)), np.float32) for n in TENSOR_SCALES}
    return {n: np.asarray(10.0 ** rng.uniform(-5, 1.5), np.float32) for n in TENSOR_SCALES}


def edge_rows(shape: tuple, ts: float, rng: np.random.Generator) -> np.ndarray:
    """Rows [..., D] whose groups each hold 6 * s * ts (so the group's scale is exactly s, an e4m3 value
    from subnormal to 448) and the other elements at e2m1 values and the midpoints between them
    (ties), both signs, times s * ts; a few groups all zero, and single NaN, ±inf and -tiny elements."""
    *lead, D = shape
    groups = int(np.prod(lead)) * (D // nvfp4.GROUP)
    all_e4m3 = np.arange(256, dtype=np.uint8)
    codes = all_e4m3[(all_e4m3 & 0x7F) > 0]
    codes = codes[(codes & 0x7F) != 0x7F]  # finite and nonzero
    s = np.abs(nvfp4.e4m3_decode(rng.choice(codes, groups))).astype(np.float64)
    grid = nvfp4.E2M1_VALUES.astype(np.float64)
    points = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2])
    vals = rng.choice(points, (groups, nvfp4.GROUP)) * rng.choice([-1.0, 1.0], (groups, nvfp4.GROUP))
    vals[np.arange(groups), rng.integers(0, nvfp4.GROUP, groups)] = 6.0
    x = vals * (s * float(ts))[:, None]
    x[rng.random(groups) < 0.05] = 0.0
    flat = x.reshape(-1)
    for special in (np.nan, np.inf, -np.inf, -1e-30):
        flat[rng.integers(0, flat.size)] = special
    return flat.reshape(shape)


def expected_rows(x: np.ndarray, ts) -> tuple[np.ndarray, np.ndarray]:
    """(packed bytes, block-scale bytes) the kernel must store for rows x."""
    return nvfp4.quantize(np.asarray(x).astype(np.float32), float(ts))
