"""The fp8_ds_mla verification pools (kgen/families/attention/case_pools.py): NaN rows of the
canonical store become rows that read as NaN everywhere, the others are the quantizer's rows of the
store with a power-of-two gain per tile, so one row's four scales differ by orders of magnitude."""

import ml_dtypes
import numpy as np

from kgen.families.attention import case_pools
from kgen.formats import ds_mla
from kgen.quantize import quantize_ds_mla_rows


def test_poison_rows_and_per_tile_gains():
    rng = np.random.default_rng(4)
    store = rng.standard_normal((6, 8, 1, 576))
    store[2, 3:] = np.nan  # a partly filled block's tail
    store[5] = np.nan  # an unused block
    pool = case_pools.latent_pool(store, np.random.default_rng(9))
    assert pool.shape == (6, 8, 656) and pool.dtype == np.uint8
    poisoned = np.isnan(store[:, :, 0, 0])
    assert np.array_equal(pool[poisoned], ds_mla.poison_rows((int(poisoned.sum()),)))
    real = ds_mla.dequantize_rows(pool)
    assert np.isnan(real[poisoned]).all() and np.isfinite(real[~poisoned]).all()
    # the same draw of gains, applied by hand, quantizes to the same bytes
    gains = case_pools.tile_gains(store.shape[:2], np.random.default_rng(9))
    by_hand = store[:, :, 0].copy()
    by_hand[..., :512] *= np.repeat(gains, 128, axis=-1)
    live = ~poisoned
    assert np.array_equal(pool[live], quantize_ds_mla_rows(by_hand[live].astype(ml_dtypes.bfloat16)))
    scales = ds_mla.split_rows(pool[live])[1]
    assert (scales.max(axis=-1) / scales.min(axis=-1)).max() >= 2.0 ** 8  # tiles far apart within a row
    assert (scales == 2.0 ** -13).any()  # and some at the 1e-4 floor
