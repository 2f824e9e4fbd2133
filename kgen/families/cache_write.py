"""The cache-write family: store new K/V rows into the paged pool at slot_mapping, quantizing
to the cache dtype (rules: kgen/quantize.py), and, for per_token_head scales, writing each
written row's scale into the scale pool. ABI: DESIGN.md §3 and docs/cache-kernels.md."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.arrays import ArrayArg
from kgen.dtypes import QUANTIZED, dtype
from kgen.errors import ArgumentError
from kgen.families.base import Config, SingleKernelFamily, TunableParam
from kgen.families.binding import CallBinder as CacheBinder
from kgen.families.binding import cache_names, host_values
from kgen.families.paged_decode import SCALE_MODES, cache_shapes, layout_problems, scale_shape, vllm_x
from kgen.runtime.base import Launch


def kv_strides(spec, caches: list[ArrayArg]) -> tuple[Any, Any, tuple, tuple]:
    """(K base, V base, K strides, V strides): strides as (block, head, token, run) in elements."""
    kv = spec.kv_cache
    if kv.layout == "fused":
        c = caches[0]
        k_base, v_base = c.ptr, c.ptr + c.strides[1] * c.itemsize
        k_str = v_str = (c.strides[0], *c.strides[2:])
    else:
        k_base, v_base = caches[0].native, caches[1].native
        k_str, v_str = caches[0].strides, caches[1].strides
    if kv.layout == "vllm":  # K [N, H, D/x, B, x]; V [N, H, D, B]
        return k_base, v_base, (k_str[0], k_str[1], k_str[3], k_str[2]), (v_str[0], v_str[1], 1, v_str[2])
    if kv.resolved_order == "NHD":  # [N, B, H, D]
        return k_base, v_base, (k_str[0], k_str[2], k_str[1], 0), (v_str[0], v_str[2], v_str[1], 0)
    return k_base, v_base, (k_str[0], k_str[1], k_str[2], 0), (v_str[0], v_str[1], v_str[2], 0)


def scale_pool_strides(spec, s: ArrayArg) -> tuple[int, int, int]:
    """A per_token_head scale pool's (block, head, token) strides."""
    if spec.kv_cache.resolved_order == "NHD":  # [N, B, H]
        return s.strides[0], s.strides[2], s.strides[1]
    return s.strides[0], s.strides[1], s.strides[2]  # [N, H, B]


class CacheWriteFamily(SingleKernelFamily):
    kind = "cache_write"
    template = "cache_write.cu.j2"
    params = {"threads": TunableParam("threads", 128, "threads per thread block (one warp per K or V row)")}

    def unsupported(self, spec) -> list[str]:
        return layout_problems(spec)

    def template_context(self, spec, config: Config) -> dict[str, Any]:
        vllm = spec.kv_cache.layout == "vllm"
        return {
            "kernel_name": spec.name,
            "in_ctype": dtype(spec.dtype.q).ctype,
            "kv_ctype": dtype(spec.kv_cache.dtype).ctype,
            "scale_mode": SCALE_MODES[spec.kv_cache.scale],
            "k_run": vllm_x(spec) if vllm else spec.attention.head_dim,
            "v_run": 1 if vllm else spec.attention.head_dim,
            "threads": config["threads"],
        }

    def plan(self, spec, config: Config, call: dict[str, Any], checked: bool = True):
        """Check the call's arguments against the ABI; return (launches, None): the writes are in place."""
        return _bind(CacheBinder(spec, call), config, checked)


def _bind(b: CacheBinder, config: Config, checked: bool):
    spec, a, kv = b.spec, b.spec.attention, b.spec.kv_cache
    H, D, B = a.num_kv_heads, a.head_dim, kv.block_size
    key = b.take("key", True)
    b.device = key.device
    if len(key.shape) != 3:
        raise ArgumentError(f"key: expected shape [num_tokens, {H}, {D}], got {list(key.shape)}")
    T = key.shape[0]
    b.check(key, (T, H, D), spec.dtype.q)
    value = b.take("value", True)
    b.check(value, (T, H, D), spec.dtype.q)
    sm = b.take("slot_mapping", True)
    b.check(sm, (T,), "int32", contiguous=True)

    b.refuse_other_layouts()
    caches = [b.take(n, True) for n in cache_names(spec)]
    N = caches[0].shape[0] if caches[0].shape else 0
    for c, shape in zip(caches, cache_shapes(spec, N).values(), strict=True):
        b.check(c, shape, kv.dtype)
    k_base, v_base, ks, vs = kv_strides(spec, caches)

    scales = [b.take("k_scale", False), b.take("v_scale", False)]
    pool_strides = [(0, 0, 0), (0, 0, 0)]
    if kv.dtype in QUANTIZED:
        sshape = scale_shape(spec, N)
        for i, s in enumerate(scales):
            name = ("k_scale", "v_scale")[i]
            if s is None:
                what = "the scale pool this kernel writes" if kv.scale == "per_token_head" else "given by the caller"
                raise ArgumentError(f"{name}: required for a {kv.dtype} cache with scale '{kv.scale}' "
                                    f"(fp32, shape {list(sshape)}; {what})")
            if s.shape == (1,) and sshape == ():
                s.shape, s.strides = (), ()
            b.check(s, sshape, "fp32", contiguous=kv.scale != "per_token_head")
            if kv.scale == "per_token_head":
                pool_strides[i] = scale_pool_strides(spec, s)
    else:
        for s in scales:
            if s is not None:
                raise ArgumentError(f"{s.name}: a {kv.dtype} cache takes no scales (scale: none)")
    b.refuse_unknown()
    pools = kv.scale == "per_token_head"  # then the scales are pools this kernel writes, like the caches
    b.refuse_aliasing([*caches, *(scales if pools else [])], [key, value, sm, *([] if pools else scales)])

    if checked:
        _check_values(spec, sm, scales, N)
    if T == 0:
        return [], None
    p = b.pointer
    i64 = np.int64
    warps = config["threads"] // 32
    args = [
        p(key), p(value), b.raw(k_base), b.raw(v_base), p(scales[0]), p(scales[1]), p(sm), i64(N * B),
        i64(key.strides[0]), i64(key.strides[1]), i64(value.strides[0]), i64(value.strides[1]),
        *(i64(x) for x in ks), *(i64(x) for x in vs), *(i64(x) for x in pool_strides[0]),
        *(i64(x) for x in pool_strides[1]),
    ]
    grid = (T, -(-2 * H // warps), 1)
    return [Launch(spec.name, grid, (config["threads"], 1, 1), 0, args, reached=[c.native for c in caches])], None


def _check_values(spec, sm: ArrayArg, scales: list[ArrayArg | None], num_blocks: int) -> None:
    """Host checks of what the kernel trusts: slots in range and distinct, caller scales usable."""
    slots = host_values(sm)
    cap = num_blocks * spec.kv_cache.block_size
    bad = np.nonzero((slots < -1) | (slots >= cap))[0]
    if bad.size:
        i = int(bad[0])
        raise ArgumentError(f"slot_mapping[{i}] = {int(slots[i])}: not a slot of the pool (-1 to skip, or "
                            f"0..{cap - 1} = num_blocks {num_blocks} × block_size {spec.kv_cache.block_size})")
    used = slots[slots >= 0]
    values, first, counts = np.unique(used, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = int(values[np.argmax(counts > 1)])
        where = np.nonzero(slots == dup)[0][:2]
        raise ArgumentError(f"slot_mapping[{int(where[0])}] and slot_mapping[{int(where[1])}] are both slot {dup}: "
                            "two tokens cannot be written to one slot in one call")
    if spec.kv_cache.scale in ("per_tensor", "per_head"):
        for s in scales:
            vals = np.atleast_1d(host_values(s))
            wrong = np.nonzero(~(np.isfinite(vals) & (vals > 0)))[0]
            if wrong.size:
                j = int(wrong[0])
                at = "" if spec.kv_cache.scale == "per_tensor" else f"[{j}]"
                raise ArgumentError(f"{s.name}{at} = {float(vals[j])!r}: scales must be positive and finite "
                                    "(stored = real / scale)")


def abi_lines(spec) -> list[str]:
    """The argument table of `kgen abi` for a cache_write spec."""
    a, kv = spec.attention, spec.kv_cache
    H, D = a.num_kv_heads, a.head_dim
    lines = [
        f"num_kv_heads {H}, head_dim {D}, block_size {kv.block_size}, cache {kv.dtype} ({kv.layout}"
        + ("" if kv.layout == "vllm" else f", {kv.resolved_order}") + f"), inputs {spec.dtype.q}",
        "",
        "Arguments (shapes in elements; the caches are written in place, nothing is returned):",
        f"  key, value    [num_tokens, {H}, {D}]  {spec.dtype.q}  (last dim contiguous)",
        "  slot_mapping  [num_tokens]  int32, slot = block * block_size + offset; -1 = skip the token; "
        "no slot twice",
    ]
    for name, shape in cache_shapes(spec).items():
        lines.append(f"  {name:<13} [{', '.join(str(s) for s in shape)}]  {kv.dtype}  (last dim contiguous)")
    if kv.layout == "vllm":
        lines.append(f"                x = 16 bytes / element size = {vllm_x(spec)}")
    sshape = scale_shape(spec)
    if kv.scale in ("per_tensor", "per_head"):
        lines.append(f"  k_scale, v_scale  [{', '.join(str(s) for s in sshape)}]  float32, read: "
                     "stored = real / scale (positive, finite)")
    elif kv.scale == "per_token_head":
        lines.append(f"  k_scale, v_scale  [{', '.join(str(s) for s in sshape)}]  float32 pools, WRITTEN: for each "
                     "written (slot, head), scale = max|x| / QMAX (1.0 if that is not > 0)")
    lines += ["", "Conversion: " + _rule(kv.dtype), "",
              "Launch (as kgen does it): grid (num_tokens, ceil(2 * num_kv_heads / warps)), one warp per K or V row."]
    return lines


def _rule(name: str) -> str:
    if name == "int8":
        return "int8 = rint_half_even(clamp(x / scale, -127, 127)) (NaN -> 0); QMAX 127"
    if name.startswith("fp8"):
        qmax = 448 if name == "fp8_e4m3" else 57344
        return f"{name} = round-nearest-even(x / scale) saturated to ±{qmax} (__NV_SATFINITE); QMAX {qmax}"
    return f"{name} = round-nearest-even(x) (same dtype: copied)"


CACHE_WRITE = CacheWriteFamily()
