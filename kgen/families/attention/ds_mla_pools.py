"""fp8_ds_mla pools for the mla attention cases (docs/verification.md, kgen/formats/ds_mla.py): real
latent rows stored through the reference quantizer (kgen/quantize.py), each 128-value tile first
given a gain of its own (2^-12 .. 2^2, drawn per row and tile) so that the four scales of one row
differ by orders of magnitude (the smallest at the 1e-4 floor of the scale rule) and a kernel that
applies the wrong tile's scale, or none, fails; gains of at most 4 keep the logits in the range of
the other cases. Rows that are NaN (the cases' poison) become rows that read as NaN everywhere:
e4m3 NaN bytes, NaN scales, NaN rope."""

from __future__ import annotations

import numpy as np

from kgen.formats import ds_mla
from kgen.formats.dtypes import dtype
from kgen.quantize import quantize_ds_mla_rows

GAIN_OCTAVES = (-12, 2)  # tile gains 2^-12 .. 2^2


def tile_gains(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A gain per (row, latent tile) [*shape, 4]: powers of two."""
    lo, hi = GAIN_OCTAVES
    return np.exp2(rng.integers(lo, hi + 1, (*shape, ds_mla.TILES))).astype(np.float64)


def latent_pool(store: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 kv_cache [N, B, 656] from the canonical real store [N, B, 1, 576] (NaN rows: poison)."""
    rows = np.array(store[:, :, 0, :], dtype=np.float64)
    poisoned = ~np.isfinite(rows).all(axis=-1)
    rows[..., :ds_mla.LATENT] *= np.repeat(tile_gains(rows.shape[:-1], rng), ds_mla.TILE, axis=-1)
    rows[poisoned] = 0.0
    pool = quantize_ds_mla_rows(rows.astype(dtype("bf16").numpy))
    pool[poisoned] = ds_mla.poison_rows((int(poisoned.sum()),))
    return pool
