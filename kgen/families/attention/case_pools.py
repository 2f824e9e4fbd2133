"""The attention cases' pools of the cache formats that store rows in a representation of their own
(docs/verification.md): real rows stored through the format's reference quantizer, and what a
kernel must not read made of values that show when it does.

nvfp4 (kgen/formats/nvfp4.py): garbage where nothing may be read: random cache bytes and block scales
that decode to NaN in e4m3 (0x7F, 0xFF), so a kernel that reads an unread slot's scale turns its
output into NaN.

fp8_ds_mla (kgen/formats/ds_mla.py, its writer's oracle kgen/quantize.py): each 128-value tile first
given a gain of its own (2^-12 .. 2^2, drawn per row and tile) so that the four scales of one row
differ by orders of magnitude (the smallest at the 1e-4 floor of the scale rule) and a kernel that
applies the wrong tile's scale, or none, fails; gains of at most 4 keep the logits in the range of
the other cases. Rows that are NaN (the cases' poison) become rows that read as NaN everywhere:
e4m3 NaN bytes, NaN scales, NaN rope."""

from __future__ import annotations

import numpy as np

from kgen.formats import ds_mla, nvfp4
from kgen.formats.cache import scale_to_layout, to_layout
from kgen.formats.dtypes import dtype
from kgen.quantize import quantize_ds_mla_rows

# ---- nvfp4 ----------------------------------------------------------------------------------
NAN_SCALES = np.array([0x7F, 0xFF], dtype=np.uint8)  # e4m3 NaN, both signs
PAD_BYTE = 0x77  # cache padding: two e2m1 6.0 (its scale padding is NaN)
E2M1_RANGE = nvfp4.E2M1_MAX * nvfp4.E4M3_MAX  # what one tensor scale unit reaches: 6 x 448


def tensor_scales(real_range: tuple[float, float], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """k/v_tensor_scale sized so |values| up to each range fill e2m1 x e4m3 (the NVFP4 recipe), +-10%."""
    return {f"{w}_tensor_scale": np.asarray(r / E2M1_RANGE * rng.uniform(0.9, 1.1), dtype=np.float32)
            for w, r in zip("kv", real_range, strict=True)}


def garbage(packed: np.ndarray, scales: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> None:
    """Random bytes in the cache rows `rows` (a bool mask over the leading dims) and NaN or random
    block scales, in place."""
    n = int(rows.sum())
    packed[rows] = rng.integers(0, 256, (n, packed.shape[-1]), dtype=np.uint8)
    scales[rows] = np.where(rng.random((n, scales.shape[-1])) < 0.5, rng.choice(NAN_SCALES, (n, scales.shape[-1])),
                            rng.integers(0, 256, (n, scales.shape[-1]), dtype=np.uint8))


def store(real: np.ndarray, ts, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(packed, block scales) of real rows [..., D]; rows that are all NaN (the cases' poison) become
    garbage. A quarter of the other rows is shrunk by up to 10^-6 first, so their block scales run
    through e4m3's subnormals down to zero."""
    real = np.array(real, dtype=np.float64)
    poisoned = np.isnan(real).all(axis=-1)
    shrink = np.where(rng.random(real.shape[:-1]) < 0.25, 10.0 ** -rng.uniform(0, 6, real.shape[:-1]), 1.0)
    packed, scales = nvfp4.quantize(np.where(poisoned[..., None], 0.0, real * shrink[..., None]), float(ts))
    garbage(packed, scales, poisoned, rng)
    return packed, scales


def layout_pools(spec, k_real: np.ndarray, v_real: np.ndarray, tensor: dict[str, np.ndarray],
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The call's k_cache, v_cache, k_scale and v_scale from canonical real pools [N, B, H, D]."""
    pk, sk = store(k_real, tensor["k_tensor_scale"], rng)
    pv, sv = store(v_real, tensor["v_tensor_scale"], rng)
    return {**to_layout(spec, pk, pv), "k_scale": scale_to_layout(spec, sk), "v_scale": scale_to_layout(spec, sv)}


# ---- fp8_ds_mla -----------------------------------------------------------------------------
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
