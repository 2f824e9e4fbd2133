"""The fp8_ds_mla cache row (DeepSeek-V3.2's FP8 MLA cache; vLLM's `fp8_ds_mla`, FlashMLA's V32 FP8
layout), docs/abi.md "MLA": one 656-byte row per token,

    bytes [0, 512)    512 float8_e4m3 latent values (the row's first 512 elements)
    bytes [512, 528)  4 float32 scales, scale t for latent values [128 t, 128 t + 128)
    bytes [528, 656)  64 bfloat16 rope values (the row's last 64 elements), stored exactly

Dequantized latent value = e4m3 * its tile's scale (fp32); the rope part is read as is. How the
scales are chosen when a row is written is kgen/quantize.py's (quantize_ds_mla_rows). This module is
the layout and the read side, shared by the reference, the verification pools and the tests.
"""

from __future__ import annotations

import numpy as np

from kgen.formats.dtypes import ml_dtype

HEAD_DIM, V_HEAD_DIM = 576, 512  # the row's elements; the latent part (V)
LATENT, ROPE = 512, 64
TILE = 128  # latent values per scale
TILES = LATENT // TILE
SCALES_AT = LATENT  # byte offset of the scales
ROPE_AT = SCALES_AT + 4 * TILES  # byte offset of the rope part: 528
ROW_BYTES = ROPE_AT + 2 * ROPE  # 656

POISON_BYTES = {"latent": 0x7F, "scale": np.float32(np.nan), "rope": np.uint16(0x7FC0)}  # rope: bf16 NaN bits


def split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of uint8 rows [..., 656]: (latent e4m3 [..., 512], scales fp32 [..., 4], rope bf16 [..., 64]).
    The rows' last dim must be contiguous (the views reinterpret its bytes)."""
    rows = np.asarray(rows)
    if rows.shape[-1:] != (ROW_BYTES,) or rows.dtype != np.uint8:
        raise ValueError(f"fp8_ds_mla rows are uint8 [..., {ROW_BYTES}] (got {rows.dtype} {list(rows.shape)})")
    rows = np.ascontiguousarray(rows)
    return (rows[..., :SCALES_AT].view(ml_dtype("float8_e4m3fn")), rows[..., SCALES_AT:ROPE_AT].view(np.float32),
            rows[..., ROPE_AT:].view(ml_dtype("bfloat16")))


def dequantize_rows(rows: np.ndarray) -> np.ndarray:
    """Real values [..., 576] float32 of uint8 rows [..., 656]: latent e4m3 * its tile's scale (one fp32
    product, as the kernels form it before rounding to bf16), then the rope part as stored."""
    latent, scales, rope = split_rows(rows)
    out = np.empty(rows.shape[:-1] + (HEAD_DIM,), dtype=np.float32)
    tiles = latent.astype(np.float32).reshape(*rows.shape[:-1], TILES, TILE)
    with np.errstate(invalid="ignore", over="ignore"):  # poison rows: NaN scales and values
        out[..., :LATENT] = (tiles * scales[..., :, None]).reshape(*rows.shape[:-1], LATENT)
    out[..., LATENT:] = rope.astype(np.float32)
    return out


def poison_rows(shape: tuple[int, ...]) -> np.ndarray:
    """uint8 rows [*shape, 656] that read as NaN everywhere: e4m3 NaN bytes, NaN scales, NaN rope."""
    rows = np.empty((*shape, ROW_BYTES), dtype=np.uint8)
    rows[..., :SCALES_AT] = POISON_BYTES["latent"]
    rows[..., SCALES_AT:ROPE_AT] = np.frombuffer(np.full(TILES, POISON_BYTES["scale"]).tobytes(), np.uint8)
    rows[..., ROPE_AT:] = np.frombuffer(np.full(ROPE, POISON_BYTES["rope"]).tobytes(), np.uint8)
    return rows
