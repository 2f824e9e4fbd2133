"""The paged pool's part of every kind's argument table and call binding (docs/abi.md): the cache
and scale parameters, their stride parameters, and the binding of the dequantization scales. The
format itself (shapes, strides, canonical views) is kgen/formats/cache.py's."""

from __future__ import annotations

from dataclasses import replace

from kgen.arrays import ArrayArg, scale_value
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, array, stride
from kgen.families.binding import TENSOR_SCALE_NAMES  # nvfp4's per-tensor fp32 scales
from kgen.formats.cache import (
    AXES,
    SCALE_AXES,
    CacheFormat,
    CacheStrides,
    block_scale_copy,
    cache_shapes,
    half_shapes,
    scale_pool_strides,
    scale_shape,
    vllm_x,
)


def bind_scales(binder, spec, num_blocks: int, detail: str = "") -> tuple[list, list[tuple[int, int, int]]]:
    """Take and check k_scale and v_scale: ([k_scale, v_scale] (None when absent), their pool
    strides ((0, 0, 0) unless per_token_head)). `detail` ends the message of a missing scale."""
    kv, f = spec.kv_cache, CacheFormat.of(spec)
    if f.block_scaled:
        return _bind_block_scales(binder, spec, num_blocks)
    if kv.scale == "per_tensor":  # a Python float or a 0-d / one-element array of any float dtype
        scales = [_take_per_tensor(binder, name) for name in ("k_scale", "v_scale")]
    else:
        scales = [binder.take("k_scale", False), binder.take("v_scale", False)]
    pool_strides = [(0, 0, 0), (0, 0, 0)]
    if not f.quantized:
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
        binder.check(s, sshape, "fp32", contiguous=not f.per_token)
        if f.per_token:
            pool_strides[i] = scale_pool_strides(spec, s)
    return scales, pool_strides


def _bind_block_scales(binder, spec, num_blocks: int) -> tuple[list, list[tuple[int, int, int]]]:
    """nvfp4's k_scale and v_scale: e4m3 block-scale pools (uint8 bits or float8_e4m3fn), the cache's
    leading dims and head_dim / 16, each row aligned for the kernels' copies of it."""
    sshape, align = scale_shape(spec, num_blocks), block_scale_copy(spec.attention.head_dim)
    scales, pool_strides = [], []
    for name in ("k_scale", "v_scale"):
        s = binder.take(name, False)
        if s is None:
            raise ArgumentError(f"{name}: required for an nvfp4 cache: its e4m3 block scales, uint8 (e4m3 bits) or "
                                f"float8_e4m3fn, shape {list(sshape)}")
        binder.check(s, sshape, "fp8_e4m3")
        strides = scale_pool_strides(spec, s)
        if s.ptr % align or any(x % align for x in strides):
            raise ArgumentError(f"{name}: each row of block scales is copied {align} bytes at a time, so the data "
                                f"pointer and the block, head and token strides {list(s.strides[:3])} must be "
                                f"multiples of {align} bytes")
        scales.append(s)
        pool_strides.append(strides)
    return scales, pool_strides


def bind_tensor_scales(binder, spec) -> dict[str, ArrayArg]:
    """nvfp4's k_tensor_scale and v_tensor_scale (a Python float, or a 0-d / one-element float array);
    none for other caches (given ones are refused)."""
    taken = {name: _take_per_tensor(binder, name) for name in TENSOR_SCALE_NAMES}
    if not CacheFormat.of(spec).block_scaled:
        for name, s in taken.items():
            if s is not None:
                raise ArgumentError(f"{name}: only nvfp4 caches take a tensor scale (this cache is "
                                    f"{spec.kv_cache.dtype}; its scales are k_scale and v_scale)")
        return {}
    for name, s in taken.items():
        if s is None:
            raise ArgumentError(f"{name}: required for an nvfp4 cache (fp32 [], real = e2m1 * e4m3 block scale * "
                                f"{name}); a Python float is accepted")
        if s.shape == (1,):
            s.shape, s.strides = (), ()
        binder.check(s, (), "fp32")
    return taken


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
    rows += [stride(f"{p}_s_{axis}", f"{what} scale-pool stride between {axis}s (per_token_head or nvfp4; else 0)")
             for p, what in (("ks", "K"), ("vs", "V")) for axis in SCALE_AXES]
    return rows


def scale_args(spec, role: str = "input", const: bool = True, use: str = "real = stored * scale") -> list[Arg]:
    """The k_scale and v_scale parameters (null pointers for a float cache); nvfp4: the block-scale
    pools and the tensor scales."""
    kv, shape = spec.kv_cache, scale_shape(spec)
    if CacheFormat.of(spec).block_scaled:
        return block_scale_args(spec, role, const)
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
    if CacheFormat.of(spec).block_scaled:
        where = [w + ", packed: a byte holds elements 2i (low nibble) and 2i+1" for w in where]
    return [array(name, kv.dtype, role, shape, what + "; block, head and token strides may be padded", const=const)
            for what, (name, shape) in zip(where, half_shapes(spec).items(), strict=True)]


def block_scale_args(spec, role: str, const: bool) -> list[Arg]:
    """nvfp4: k_scale and v_scale (e4m3 block-scale pools), then k_tensor_scale and v_tensor_scale; the
    template passes each pool with its tensor scale as one kgen::Fp4Scales argument of the body."""
    shape = scale_shape(spec)
    pools = []
    for p, which in (("k", "K"), ("v", "V")):
        pool = array(f"{p}_scale", "fp8_e4m3", role, shape,
                     f"{which} e4m3 block scales (uint8 bits accepted), one per 16 elements of a row; real = "
                     f"e2m1 * block scale * {p}_tensor_scale", const=const)
        pools.append(replace(pool, forward=f"kgen::fp4_scales({p}_scale, {p}_tensor_scale)",
                             forward_ctype=f"kgen::Fp4Scales<{pool.ctype}>"))
    tensor = [replace(array(name, "fp32", "input", (), f"{name[0].upper()} tensor scale (positive, finite)"),
                      forward="") for name in TENSOR_SCALE_NAMES]
    return pools + tensor


def scale_body_ctype(spec, args: list[Arg]) -> str:
    """The C type of the kernel body's k_scale / v_scale parameter: the pointer itself, or for nvfp4 the
    kgen::Fp4Scales of the block-scale pointer and the tensor scale."""
    ctype = next(a.ctype for a in args if a.name == "k_scale")
    return f"kgen::Fp4Scales<{ctype}>" if CacheFormat.of(spec).block_scaled else ctype


def tensor_scale_values(binder, tensor_scales: dict[str, ArrayArg]) -> dict[str, object]:
    """The launch values of the tensor-scale parameters (none unless nvfp4)."""
    return {name: binder.pointer(s) for name, s in tensor_scales.items()}


# The mla layout's latent pool: one scale set, kv_scale, read by its cache write, decode and prefill.
def kv_scale_arg(spec, role: str, const: bool, use: str) -> Arg:
    """The mla pool's one scale set (null for a float cache)."""
    shape = scale_shape(spec)
    what = f"{spec.kv_cache.scale} scales; {use}" if shape is not None else \
        "null (fp8_ds_mla rows carry their own scales)" if CacheFormat.of(spec).ds_mla else "null (the cache is not quantized)"
    return array("kv_scale", "fp32", role, shape or (), "latent-row scales: " + what, optional=shape is None, const=const)


def take_kv_scale(b, spec, num_blocks: int, detail: str):
    """kv_scale, checked against the mla pool's scale shape (None for a float cache)."""
    f, kv = CacheFormat.of(spec), spec.kv_cache
    for other in ("k_scale", "v_scale"):
        if b.call.get(other) is not None:
            raise ArgumentError(f"{other}: not an argument of the mla layout (its one scale set is kv_scale)")
    s = _take_per_tensor(b, "kv_scale") if kv.scale == "per_tensor" else b.take("kv_scale", False)
    if not f.quantized:
        if s is not None:
            raise ArgumentError("kv_scale: fp8_ds_mla rows carry their own tile scales; leave kv_scale out" if f.ds_mla
                                else f"kv_scale: a {kv.dtype} cache takes no scales (scale: none)")
        return None
    shape = scale_shape(spec, num_blocks)
    if s is None:
        raise ArgumentError(f"kv_scale: required for a {kv.dtype} cache with scale '{kv.scale}' "
                            f"(fp32, shape {list(shape)}; {detail})")
    if s.shape == (1,) and shape == ():
        s.shape, s.strides = (), ()
    b.check(s, shape, "fp32", contiguous=not f.per_token)
    return s
