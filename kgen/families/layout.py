"""What every kernel kind shares about the paged KV cache (docs/abi.md): the ABI shape of each
layout, ONE canonical index order and the conversions to and from it, the strides a kernel
receives for each cache array, and the binding of the dequantization scales.

Canonical order (numpy, host side): K and V pools [num_blocks, block_size, num_kv_heads, head_dim],
per_token_head scale pools [num_blocks, block_size, num_kv_heads]. NHD is that order itself.

Kernel strides (device side): each K or V array is described by (block, head, token, run)
strides in elements. head_dim is cut into runs of K_RUN / V_RUN contiguous elements, `run` is
the stride between runs (0 when head_dim is one run): NHD/HND/fused one run; vLLM K runs of x,
vLLM V runs of 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, scale_value
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, array, stride
from kgen.formats.dtypes import QUANTIZED, dtype

AXES = ("block", "head", "token", "run")  # the order of a cache array's kernel strides
SCALE_AXES = ("block", "head", "token")  # the order of a per_token_head scale pool's kernel strides
SCALE_MODES = {"none": 0, "per_tensor": 1, "per_head": 2, "per_token_head": 3}  # Cfg::SCALE_MODE


# ---- the ABI shapes -------------------------------------------------------------------------
def vllm_x(spec) -> int:
    """vLLM's K-cache packing factor: 16 bytes of elements."""
    return 16 // dtype(spec.kv_cache.dtype).itemsize


def layout_problems(spec) -> list[str]:
    """Why the spec's cache layout cannot hold its head_dim (vLLM packs K in runs of x)."""
    if spec.kv_cache.layout == "vllm" and spec.attention.head_dim % vllm_x(spec):
        return [f"kv_cache.layout vllm packs K in runs of x = {vllm_x(spec)} elements, so head_dim must be a "
                f"multiple of {vllm_x(spec)} (got {spec.attention.head_dim})"]
    return []


def cache_names(spec) -> tuple[str, ...]:
    """The call's cache arguments: one fused pool or separate K and V pools."""
    return ("kv_cache",) if spec.kv_cache.layout == "fused" else ("k_cache", "v_cache")


def half_shapes(spec, num_blocks: str | int = "num_blocks") -> dict[str, tuple]:
    """The shapes of the K and V arrays a kernel parameter points at (a fused pool's halves too)."""
    a, kv = spec.attention, spec.kv_cache
    n, b, h, d = num_blocks, kv.block_size, a.num_kv_heads, a.head_dim
    if kv.layout == "vllm":
        x = vllm_x(spec)
        return {"k_cache": (n, h, d // x, b, x), "v_cache": (n, h, d, b)}
    one = (n, b, h, d) if kv.resolved_order == "NHD" else (n, h, b, d)
    return {"k_cache": one, "v_cache": one}


def cache_shapes(spec, num_blocks: str | int = "num_blocks") -> dict[str, tuple]:
    """The cache arrays of a call and their ABI shapes (symbolic or concrete num_blocks)."""
    halves = half_shapes(spec, num_blocks)
    if spec.kv_cache.layout == "fused":
        return {"kv_cache": (num_blocks, 2, *halves["k_cache"][1:])}  # [N, 2, ...one block]
    return halves


def scale_shape(spec, num_blocks: str | int = "num_blocks") -> tuple | None:
    """The shape of k_scale and v_scale (None: the cache takes no scales)."""
    kv, h = spec.kv_cache, spec.attention.num_kv_heads
    if kv.scale == "none":
        return None
    if kv.scale == "per_tensor":
        return ()
    if kv.scale == "per_head":
        return (h,)
    if kv.resolved_order == "NHD":
        return (num_blocks, kv.block_size, h)
    return (num_blocks, h, kv.block_size)


# ---- layout <-> canonical (host arrays) -----------------------------------------------------
def to_layout(spec, k: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """The call's cache arrays (C-contiguous) from canonical [N, B, H, D] K and V."""
    kv = spec.kv_cache
    N, B, H, D = k.shape
    if kv.layout == "vllm":
        x = vllm_x(spec)
        return {"k_cache": np.ascontiguousarray(k.reshape(N, B, H, D // x, x).transpose(0, 2, 3, 1, 4)),
                "v_cache": np.ascontiguousarray(v.transpose(0, 2, 3, 1))}
    if kv.resolved_order == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if kv.layout == "fused":
        return {"kv_cache": np.ascontiguousarray(np.stack([k, v], axis=1))}
    return {"k_cache": np.ascontiguousarray(k), "v_cache": np.ascontiguousarray(v)}


def from_layout(spec, arrays: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Canonical [N, B, H, D] K and V (views where possible) from the call's cache arrays."""
    kv = spec.kv_cache
    if kv.layout == "fused":
        pool = np.asarray(arrays["kv_cache"])
        k, v = pool[:, 0], pool[:, 1]
    else:
        k, v = np.asarray(arrays["k_cache"]), np.asarray(arrays["v_cache"])
    if kv.layout == "vllm":
        N, H, Dx, B, x = k.shape
        return k.transpose(0, 3, 1, 2, 4).reshape(N, B, H, Dx * x), v.transpose(0, 3, 1, 2)
    if kv.resolved_order == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return k, v


def scale_to_layout(spec, s: np.ndarray) -> np.ndarray:
    """A per_token_head scale pool in the ABI's order from canonical [N, B, H]."""
    return s if spec.kv_cache.resolved_order == "NHD" else np.ascontiguousarray(s.transpose(0, 2, 1))


def scale_from_layout(spec, s: np.ndarray) -> np.ndarray:
    """Canonical [N, B, H] (a view) from a per_token_head scale pool in the ABI's order."""
    s = np.asarray(s)
    return s if spec.kv_cache.resolved_order == "NHD" else s.transpose(0, 2, 1)


def canonical_scale(spec, scale, num_blocks: int) -> np.ndarray:
    """Any scale argument broadcast to canonical [N, B, H] in float64 (ones for a float cache)."""
    kv, h = spec.kv_cache, spec.attention.num_kv_heads
    shape = (num_blocks, kv.block_size, h)
    if kv.dtype not in QUANTIZED or kv.scale == "none":
        return np.ones(shape)
    s = np.asarray(scale, dtype=np.float64)
    if kv.scale == "per_tensor":
        return np.full(shape, float(s.reshape(-1)[0]))
    if kv.scale == "per_head":
        return np.broadcast_to(s[None, None, :], shape).copy()
    return scale_from_layout(spec, s)


# ---- kernel strides (device side) -----------------------------------------------------------
@dataclass
class CacheStrides:
    """Where a kernel finds K and V: base pointers and (block, head, token, run) strides in elements."""

    k_base: Any  # the K array (separate layouts) or the address of a fused pool's K half
    v_base: Any
    k: tuple[int, int, int, int]
    v: tuple[int, int, int, int]
    v_offset: int = 0  # elements from a fused pool's K half to its V half (0 otherwise)


def cache_strides(spec, caches: list[ArrayArg]) -> CacheStrides:
    """The strides of the call's (checked) cache arrays."""
    kv = spec.kv_cache
    v_offset = 0
    if kv.layout == "fused":
        c = caches[0]
        v_offset = c.strides[1]
        k_base, v_base = c.ptr, c.ptr + v_offset * c.itemsize
        k_str = v_str = (c.strides[0], *c.strides[2:])  # block, then as one separate pool
    else:
        k_base, v_base = caches[0].native, caches[1].native
        k_str, v_str = caches[0].strides, caches[1].strides
    if kv.layout == "vllm":  # K [N, H, D/x, B, x]; V [N, H, D, B] (its last dim is contiguous)
        return CacheStrides(k_base, v_base, (k_str[0], k_str[1], k_str[3], k_str[2]),
                            (v_str[0], v_str[1], 1, v_str[2]))
    if kv.resolved_order == "NHD":  # [N, B, H, D]
        return CacheStrides(k_base, v_base, (k_str[0], k_str[2], k_str[1], 0), (v_str[0], v_str[2], v_str[1], 0),
                            v_offset)
    return CacheStrides(k_base, v_base, (k_str[0], k_str[1], k_str[2], 0), (v_str[0], v_str[1], v_str[2], 0),
                        v_offset)


def scale_pool_strides(spec, s: ArrayArg) -> tuple[int, int, int]:
    """A per_token_head scale pool's (block, head, token) strides."""
    if spec.kv_cache.resolved_order == "NHD":  # [N, B, H]
        return s.strides[0], s.strides[2], s.strides[1]
    return s.strides[0], s.strides[1], s.strides[2]  # [N, H, B]


def bind_scales(binder, spec, num_blocks: int, detail: str = "") -> tuple[list, list[tuple[int, int, int]]]:
    """Take and check k_scale and v_scale: ([k_scale, v_scale] (None when absent), their pool
    strides ((0, 0, 0) unless per_token_head)). `detail` ends the message of a missing scale."""
    kv = spec.kv_cache
    if kv.scale == "per_tensor":  # a Python float or a 0-d / one-element array of any float dtype
        scales = [_take_per_tensor(binder, name) for name in ("k_scale", "v_scale")]
    else:
        scales = [binder.take("k_scale", False), binder.take("v_scale", False)]
    pool_strides = [(0, 0, 0), (0, 0, 0)]
    if kv.dtype not in QUANTIZED:
        for s in scales:
            if s is not None:
                raise ArgumentError(f"{s.name}: a {kv.dtype} cache takes no scales (scale: none)")
        return scales, pool_strides
    sshape = scale_shape(spec, num_blocks)
    for i, s in enumerate(scales):
        if s is None:
            name = ("k_scale", "v_scale")[i]
            raise ArgumentError(f"{name}: required for a {kv.dtype} cache with scale '{kv.scale}' "
                                f"(fp32, shape {list(sshape)}{'; ' + detail if detail else ''})")
        if s.shape == (1,) and sshape == ():  # a one-element array stands for a per-tensor scalar
            s.shape, s.strides = (), ()
        binder.check(s, sshape, "fp32", contiguous=kv.scale != "per_token_head")
        if kv.scale == "per_token_head":
            pool_strides[i] = scale_pool_strides(spec, s)
    return scales, pool_strides


def _take_per_tensor(binder, name: str) -> ArrayArg | None:
    value = binder.call.pop(name, None)
    return None if value is None else scale_value(name, value, binder.first, ())


def stride_values(strides: CacheStrides, scale_strides: list[tuple[int, int, int]]) -> dict[str, int]:
    """The stride parameters of stride_args(), by name."""
    values = {f"k_s_{axis}": s for axis, s in zip(AXES, strides.k, strict=True)}
    values |= {f"v_s_{axis}": s for axis, s in zip(AXES, strides.v, strict=True)}
    values |= {f"ks_s_{axis}": s for axis, s in zip(SCALE_AXES, scale_strides[0], strict=True)}
    values |= {f"vs_s_{axis}": s for axis, s in zip(SCALE_AXES, scale_strides[1], strict=True)}
    return values


def stride_args() -> list[Arg]:
    """The cache and scale-pool stride parameters every kind that reads or writes the pool takes."""
    rows = [stride(f"{p}_s_{axis}", f"{what} stride between {axis}s" + (" (0: head_dim is one run)"
                                                                        if axis == "run" else ""))
            for p, what in (("k", "K"), ("v", "V")) for axis in AXES]
    rows += [stride(f"{p}_s_{axis}", f"{what} scale-pool stride between {axis}s (per_token_head; else 0)")
             for p, what in (("ks", "K"), ("vs", "V")) for axis in SCALE_AXES]
    return rows


def scale_args(spec, role: str = "input", const: bool = True, use: str = "real = stored * scale") -> list[Arg]:
    """The k_scale and v_scale parameters (null pointers for a float cache)."""
    kv, shape = spec.kv_cache, scale_shape(spec)
    what = "scales: null (the cache is not quantized)" if shape is None else f"{kv.scale} scales; {use}"
    return [array(name, "fp32", role, shape or (), f"{which} {what}", optional=shape is None, const=const)
            for name, which in (("k_scale", "K"), ("v_scale", "V"))]


def cache_args(spec, role: str, const: bool) -> list[Arg]:
    """The k_cache and v_cache parameters (a fused pool's halves: same strides, V one plane further)."""
    kv = spec.kv_cache
    pool = "[" + ", ".join(str(s) for s in cache_shapes(spec).get("kv_cache", ())) + "]"
    where = {"fused": ["K half of kv_cache " + pool + " (kv_cache[:, 0])", "V half of kv_cache[:, 1]"],
             "vllm": [f"K vLLM pool, head_dim in runs of x = {vllm_x(spec)}", "V vLLM pool, tokens contiguous"]
             }.get(kv.layout, [f"K {kv.resolved_order} pool", f"V {kv.resolved_order} pool"])
    return [array(name, kv.dtype, role, shape, what + "; block, head and token strides may be padded", const=const)
            for what, (name, shape) in zip(where, half_shapes(spec).items(), strict=True)]


# ---- `kgen abi` text ------------------------------------------------------------------------
def describe(spec) -> str:
    """The cache in words, e.g. 'fp16 (separate, NHD)'."""
    kv = spec.kv_cache
    return f"{kv.dtype} ({kv.layout}" + ("" if kv.layout == "vllm" else f", {kv.resolved_order}") + ")"


def cache_rows(spec, note: str = "") -> list[str]:
    """One line per cache array of a call: name, ABI shape, dtype."""
    return [f"  {name:<13} [{', '.join(str(s) for s in shape)}]  {spec.kv_cache.dtype}" + (f"  ({note})" if note else "")
            for name, shape in cache_shapes(spec).items()]
