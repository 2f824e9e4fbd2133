"""A spec's KV-cache format as an object (CacheFormat, built once from the spec) and what every
kernel kind shares about the paged pool (docs/abi.md): the ABI shape of each layout, ONE canonical
index order and the conversions to and from it, the strides a kernel receives for each cache
array, the scale shapes, and the constants the templates take.

Canonical order (numpy, host side): K and V pools [num_blocks, block_size, num_kv_heads, head_dim]
(V's last dim is v_head_dim, which attention.v_head_dim may set apart from K's head_dim),
per_token_head scale pools [num_blocks, block_size, num_kv_heads]. NHD is that order itself.
The mla layout's one pool [num_blocks, block_size, head_dim] is K with num_kv_heads 1, and V its
first v_head_dim elements (a view of the same rows); its per-token scales are [num_blocks, block_size].

Kernel strides (device side): each K or V array is described by (block, head, token, run)
strides in elements. head_dim is cut into runs of K_RUN / V_RUN contiguous elements, `run` is
the stride between runs (0 when head_dim is one run): NHD/HND/fused one run; vLLM K runs of x,
vLLM V runs of 1.

The argument rows, call binding, template constants and bytes per token of each kind of pool (PagedPool,
LatentPool) are kgen/families/pool.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kgen.formats import ds_mla
from kgen.formats.dtypes import DType, dtype
from kgen.quantize import quantize_ds_mla_rows

AXES = ("block", "head", "token", "run")  # the order of a cache array's kernel strides
SCALE_AXES = ("block", "head", "token")  # the order of a per_token_head scale pool's kernel strides
# kgen::ScaleMode (templates/common/attention/traits.cuh): its names, and the integers of a Cfg that
# spells SCALE_MODE as a bare int (the MLA templates, and sources written before the enum)
SCALE_MODES = {"none": 0, "per_tensor": 1, "per_head": 2, "per_token_head": 3, "block": 4}
BLOCK_GROUP = 16  # nvfp4: elements per e4m3 block scale (kgen/formats/nvfp4.py)


@dataclass(frozen=True)
class CacheFormat:
    """One spec's cache: layout, order, element type, scale granularity and sizes, with the
    questions every module asks of it answered here (not by comparing strings)."""

    layout: str  # separate | fused | vllm | mla
    order: str  # NHD | HND | vllm (resolved)
    dtype: DType
    scale: str  # none | per_tensor | per_head | per_token_head
    block_size: int
    num_kv_heads: int
    head_dim: int  # K's last dim
    v_head_dim: int  # V's last dim (head_dim unless attention.v_head_dim says otherwise)

    @classmethod
    def of(cls, spec) -> CacheFormat:
        kv, a = spec.kv_cache, spec.attention
        return cls(kv.layout, kv.resolved_order, dtype(kv.dtype), kv.scale, kv.block_size, a.num_kv_heads,
                   a.head_dim, spec.v_head_dim_value)

    @property
    def separate(self) -> bool:
        """K and V in two arrays of their own."""
        return self.layout == "separate"

    @property
    def fused(self) -> bool:
        return self.layout == "fused"

    @property
    def vllm(self) -> bool:
        return self.layout == "vllm"

    @property
    def mla(self) -> bool:
        """One pool of latent rows: K the whole row, V its first v_head_dim elements."""
        return self.layout == "mla"

    @property
    def ds_mla(self) -> bool:
        """fp8_ds_mla: mla rows of 656 bytes carrying their own tile scales (kgen/formats/ds_mla.py)."""
        return self.dtype.row_format

    @property
    def token_major(self) -> bool:
        """Tokens before heads in a block (NHD; mla has one head): the canonical order itself."""
        return self.order == "NHD" or self.mla

    @property
    def quantized(self) -> bool:
        return self.dtype.quantized

    @property
    def scaled(self) -> bool:
        """The call takes k_scale and v_scale."""
        return self.quantized and (self.scale != "none" or self.block_scaled)

    @property
    def scale_pools(self) -> bool:
        """The scales are pools with a row per (block, slot, head), copied and gathered with the cache:
        per_token_head, or nvfp4's block scales."""
        return self.per_token or self.block_scaled

    @property
    def per_token(self) -> bool:
        return self.scale == "per_token_head"

    @property
    def block_scaled(self) -> bool:
        """nvfp4: packed values with an e4m3 scale per BLOCK_GROUP elements and a tensor scale (the call
        takes k_scale/v_scale block-scale pools and k_tensor_scale/v_tensor_scale)."""
        return self.dtype.packed

    @property
    def scale_mode(self) -> str:
        """The kgen::ScaleMode enumerator a template's Cfg names (a key of SCALE_MODES)."""
        return "block" if self.block_scaled else self.scale

    @property
    def row_len(self) -> int:
        """Array elements of one head row: head_dim, or its bytes for a packed type."""
        return self.dtype.bytes_for(self.head_dim) if self.dtype.packed else self.head_dim

    @property
    def v_row_len(self) -> int:
        """Array elements of one V head row: v_head_dim, or its bytes for a packed type."""
        return self.dtype.bytes_for(self.v_head_dim) if self.dtype.packed else self.v_head_dim

    @property
    def x(self) -> int:
        """vLLM's K-cache packing factor: 16 bytes of elements."""
        return 16 * 8 // self.dtype.bits

    @property
    def names(self) -> tuple[str, ...]:
        return ("kv_cache",) if self.fused or self.mla else ("k_cache", "v_cache")

    def describe(self) -> str:
        return f"{self.dtype.name} ({self.layout}" + ("" if self.vllm or self.mla else f", {self.order}") + ")"


def cache_format(spec) -> CacheFormat:
    return CacheFormat.of(spec)


# ---- the ABI shapes -------------------------------------------------------------------------
def vllm_x(spec) -> int:
    """vLLM's K-cache packing factor: 16 bytes of elements."""
    return CacheFormat.of(spec).x


def layout_problems(spec) -> list[str]:
    """Why the spec's cache layout cannot hold its head_dim (vLLM packs K in runs of x)."""
    if CacheFormat.of(spec).vllm and spec.attention.head_dim % vllm_x(spec):
        return [f"kv_cache.layout vllm packs K in runs of x = {vllm_x(spec)} elements, so head_dim must be a "
                f"multiple of {vllm_x(spec)} (got {spec.attention.head_dim})"]
    return []


def cache_names(spec) -> tuple[str, ...]:
    """The call's cache arguments: one fused pool or separate K and V pools."""
    return CacheFormat.of(spec).names


def half_shapes(spec, num_blocks: str | int = "num_blocks") -> dict[str, tuple]:
    """The shapes of the K and V arrays a kernel parameter points at (a fused pool's halves too)."""
    f = CacheFormat.of(spec)
    n, b, h, d, dv = num_blocks, f.block_size, f.num_kv_heads, f.row_len, f.v_row_len
    if f.vllm:
        return {"k_cache": (n, h, d // f.x, b, f.x), "v_cache": (n, h, dv, b)}
    if f.token_major:
        return {"k_cache": (n, b, h, d), "v_cache": (n, b, h, dv)}
    return {"k_cache": (n, h, b, d), "v_cache": (n, h, b, dv)}


def cache_shapes(spec, num_blocks: str | int = "num_blocks") -> dict[str, tuple]:
    """The cache arrays of a call and their ABI shapes (symbolic or concrete num_blocks)."""
    if CacheFormat.of(spec).mla:
        row = ds_mla.ROW_BYTES if CacheFormat.of(spec).ds_mla else spec.attention.head_dim
        return {"kv_cache": (num_blocks, spec.kv_cache.block_size, row)}
    halves = half_shapes(spec, num_blocks)
    if CacheFormat.of(spec).fused:
        return {"kv_cache": (num_blocks, 2, *halves["k_cache"][1:])}  # [N, 2, ...one block]
    return halves


def scale_shape(spec, num_blocks: str | int = "num_blocks") -> tuple | None:
    """The shape of k_scale and v_scale (None: the cache takes no scales)."""
    f = CacheFormat.of(spec)
    if f.block_scaled:  # one e4m3 per BLOCK_GROUP elements of each row, the cache's leading dims
        return (*half_shapes(spec, num_blocks)["k_cache"][:-1], f.head_dim // BLOCK_GROUP)
    if f.scale == "none":
        return None
    if f.scale == "per_tensor":
        return ()
    if f.scale == "per_head":
        return (f.num_kv_heads,)
    if f.mla:  # one latent head: a scale per token
        return (num_blocks, f.block_size)
    if f.token_major:
        return (num_blocks, f.block_size, f.num_kv_heads)
    return (num_blocks, f.num_kv_heads, f.block_size)


def scale_dtype(spec) -> str:
    """The dtype of k_scale / v_scale: fp32, or nvfp4's e4m3 block scales (given as uint8 bits or
    float8_e4m3fn)."""
    return "fp8_e4m3" if CacheFormat.of(spec).block_scaled else "fp32"


def block_scale_copy(head_dim: int) -> int:
    """Bytes the kernels copy of an nvfp4 block-scale row at a time: 16, 8 or 4 when they divide the
    row's head_dim / 16 bytes, else 1 (plain byte copies)."""
    row = head_dim // BLOCK_GROUP
    return next((n for n in (16, 8, 4) if row % n == 0), 1)


# ---- layout <-> canonical (host arrays) -----------------------------------------------------
def to_layout(spec, k: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """The call's cache arrays (C-contiguous) from canonical [N, B, H, D] K and [N, B, H, Dv] V."""
    f = CacheFormat.of(spec)
    N, B, H, D = k.shape
    if f.ds_mla:  # quantized rows (kgen/quantize.py; finite K rows)
        return {"kv_cache": quantize_ds_mla_rows(k[:, :, 0, :].astype(dtype("bf16").numpy))}
    if f.mla:  # V is the rows' first v_head_dim elements: only K is stored
        return {"kv_cache": np.ascontiguousarray(k[:, :, 0, :])}
    if f.vllm:
        x = f.x
        return {"k_cache": np.ascontiguousarray(k.reshape(N, B, H, D // x, x).transpose(0, 2, 3, 1, 4)),
                "v_cache": np.ascontiguousarray(v.transpose(0, 2, 3, 1))}
    if not f.token_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if f.fused:
        return {"kv_cache": np.ascontiguousarray(np.stack([k, v], axis=1))}
    return {"k_cache": np.ascontiguousarray(k), "v_cache": np.ascontiguousarray(v)}


def from_layout(spec, arrays: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Canonical [N, B, H, D] K and [N, B, H, Dv] V (views where possible) from the call's cache arrays."""
    f = CacheFormat.of(spec)
    if f.mla:
        pool = np.asarray(arrays["kv_cache"])
        if f.ds_mla:  # the rows' real values (fp32: e4m3 * tile scale, rope as stored)
            pool = ds_mla.dequantize_rows(pool.view(np.uint8))
        pool = pool[:, :, None, :]
        return pool, pool[..., :spec.v_head_dim_value]
    if f.fused:
        pool = np.asarray(arrays["kv_cache"])
        k, v = pool[:, 0], pool[:, 1]
    else:
        k, v = np.asarray(arrays["k_cache"]), np.asarray(arrays["v_cache"])
    if f.vllm:
        N, H, Dx, B, x = k.shape
        return k.transpose(0, 3, 1, 2, 4).reshape(N, B, H, Dx * x), v.transpose(0, 3, 1, 2)
    if not f.token_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return k, v


def scale_to_layout(spec, s: np.ndarray) -> np.ndarray:
    """A per_token_head scale pool in the ABI's order from canonical [N, B, H] (nvfp4 block scales:
    [N, B, H, D/16])."""
    if CacheFormat.of(spec).mla:
        return np.ascontiguousarray(s[:, :, 0])
    return s if CacheFormat.of(spec).token_major else np.ascontiguousarray(s.swapaxes(1, 2))


def scale_from_layout(spec, s: np.ndarray) -> np.ndarray:
    """Canonical [N, B, H] (a view) from a per_token_head scale pool in the ABI's order (nvfp4 block
    scales: [N, B, H, D/16])."""
    s = np.asarray(s)
    if CacheFormat.of(spec).mla:
        return s[:, :, None]
    return s if CacheFormat.of(spec).token_major else s.swapaxes(1, 2)


# ---- kernel strides (device side) -----------------------------------------------------------
@dataclass
class CacheStrides:
    """Where a kernel finds K and V: base pointers and (block, head, token, run) strides in elements."""

    k_base: Any  # the K array (separate layouts) or the address of a fused pool's K half
    v_base: Any
    k: tuple[int, int, int, int]
    v: tuple[int, int, int, int]
    v_offset: int = 0  # elements from a fused pool's K half to its V half (0 otherwise)


def cache_strides(spec, caches: list) -> CacheStrides:
    """The strides of the call's (checked) cache arrays (kgen.arrays.ArrayArg)."""
    f = CacheFormat.of(spec)
    v_offset = 0
    if f.mla:  # [N, B, D]: K and V the same rows
        c = caches[0]
        return CacheStrides(c.native, c.native, (c.strides[0], 0, c.strides[1], 0), (c.strides[0], 0, c.strides[1], 0))
    if f.fused:
        c = caches[0]
        v_offset = c.strides[1]
        k_base, v_base = c.ptr, c.ptr + v_offset * c.itemsize
        k_str = v_str = (c.strides[0], *c.strides[2:])  # block, then as one separate pool
    else:
        k_base, v_base = caches[0].native, caches[1].native
        k_str, v_str = caches[0].strides, caches[1].strides
    if f.vllm:  # K [N, H, D/x, B, x]; V [N, H, D, B] (its last dim is contiguous)
        return CacheStrides(k_base, v_base, (k_str[0], k_str[1], k_str[3], k_str[2]),
                            (v_str[0], v_str[1], 1, v_str[2]))
    if f.token_major:  # [N, B, H, D]
        return CacheStrides(k_base, v_base, (k_str[0], k_str[2], k_str[1], 0), (v_str[0], v_str[2], v_str[1], 0),
                            v_offset)
    return CacheStrides(k_base, v_base, (k_str[0], k_str[1], k_str[2], 0), (v_str[0], v_str[1], v_str[2], 0),
                        v_offset)


def scale_pool_strides(spec, s) -> tuple[int, int, int]:
    """A per_token_head scale pool's (block, head, token) strides."""
    if CacheFormat.of(spec).mla:  # [N, B]
        return s.strides[0], 0, s.strides[1]
    if CacheFormat.of(spec).token_major:  # [N, B, H]
        return s.strides[0], s.strides[2], s.strides[1]
    return s.strides[0], s.strides[1], s.strides[2]  # [N, H, B]


# ---- `kgen abi` text ------------------------------------------------------------------------
def describe(spec) -> str:
    """The cache in words, e.g. 'fp16 (separate, NHD)'."""
    return CacheFormat.of(spec).describe()


def head_dims_text(spec) -> str:
    """The head dims in words: 'head_dim 128', or both when V's differs."""
    a = spec.attention
    if spec.v_head_dim_value == a.head_dim:
        return f"head_dim {a.head_dim}"
    return f"head_dim {a.head_dim} (q, K), v_head_dim {spec.v_head_dim_value} (V, out)"


def cache_rows(spec, note: str = "") -> list[str]:
    """One line per cache array of a call: name, ABI shape, dtype."""
    return [f"  {name:<13} [{', '.join(str(s) for s in shape)}]  {spec.kv_cache.dtype}" + (f"  ({note})" if note else "")
            for name, shape in cache_shapes(spec).items()]
