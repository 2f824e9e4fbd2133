"""The cache-write family (docs/cache-kernels.md, docs/abi.md): store new K/V rows into the
paged pool at slot_mapping, quantizing to the cache dtype (rules: kgen/quantize.py), and, for
per_token_head scales, writing each written row's scale into the scale pool."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array, scalar, stride
from kgen.families.base import Config, SingleKernelFamily
from kgen.families.binding import CallBinder, refuse_plan
from kgen.families.cache import write_cases as cache_write_cases
from kgen.families.cache.write_rules import check_slots_and_scales, conversion_rule
from kgen.families.pool import PagedPool
from kgen.formats.cache import (
    CacheFormat,
    cache_rows,
    describe,
    head_dims_text,
    layout_problems,
)
from kgen.formats.dtypes import dtype


class CacheWriteFamily(SingleKernelFamily):
    kind = "cache_write"
    template = "cache_write.cu.j2"

    def unsupported(self, spec) -> list[str]:
        return layout_problems(spec)

    def arguments(self, spec, config: Config) -> list[Arg]:
        a = spec.attention
        H, D, DV = a.num_kv_heads, a.head_dim, spec.v_head_dim_value
        written, pool = CacheFormat.of(spec).scale_pools, PagedPool(spec)
        return [
            array("key", spec.dtype.q, "input", ("num_tokens", H, D), "new K rows (last dim contiguous)"),
            array("value", spec.dtype.q, "input", ("num_tokens", H, DV), "new V rows (last dim contiguous)"),
            *pool.cache_args("output", const=False),
            *pool.scale_args("output" if written else "input", const=False,
                             use="WRITTEN for each written (slot, head): max|x| / QMAX (1.0 if that is not > 0)" if written
                             else "read: stored = real / scale (positive, finite)"),
            array("slot_mapping", "int32", "input", ("num_tokens",),
                  "slot = block * block_size + offset of each token; -1 = skip; no slot twice"),
            scalar("num_slots", "int64", "num_blocks * block_size (slots past it are never written)"),
            stride("key_s_tok", "key stride between tokens"), stride("key_s_head", "key stride between heads"),
            stride("val_s_tok", "value stride between tokens"), stride("val_s_head", "value stride between heads"),
            *pool.stride_args(),
        ]

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        warps = config["threads"] // 32  # one warp per K or V row
        grid = ("num_tokens", -(-2 * spec.attention.num_kv_heads // warps), 1)
        return [KernelDecl(spec.name, tuple(self.arguments(spec, config)), grid, config["threads"])]

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        return {
            "in_ctype": dtype(spec.dtype.q).ctype,
            **PagedPool(spec).template_constants(list(kernels[0].params)),
            "threads": config["threads"],
            "main": kernels[0],
        }

    def abi_notes(self, spec) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        pool = PagedPool(spec)
        names = ["key", "value", *pool.cache_names, "slot_mapping", *pool.scale_names]
        lines = [
            f"num_kv_heads {a.num_kv_heads}, {head_dims_text(spec)}, block_size {kv.block_size}, cache {describe(spec)}, "
            f"inputs {spec.dtype.q}",
            "",
            f"Call: kern({', '.join(names)}) -> None (the caches are written in place); the cache arrays:",
        ]
        return lines + [*cache_rows(spec), "", "Conversion: " + conversion_rule(kv.dtype), "One warp per K or V row of a token."]

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan=None,
             target_blocks: int | None = None):
        """Check the call's arguments against the ABI; return (launches, None): the writes are in place."""
        refuse_plan(spec, plan)
        return _bind(CallBinder(spec, call), self.kernels(spec, config)[0], checked)

    # ---- verification and benchmarks (kgen/families/cache/write_cases.py) --------------------
    def cases(self, spec, config: Config, rng: np.random.Generator):
        return cache_write_cases.cases()

    def run_case(self, kernel, case, rng: np.random.Generator):
        return cache_write_cases.run_case(kernel, case, rng)

    def bucket_of(self, spec, call):
        """As bench() builds it: batch = tokens written, context = the pool's tokens per token written."""
        slots = call.get("slot_mapping")
        pool = call.get("k_cache", call.get("kv_cache"))
        if slots is None or pool is None or len(slots.shape) != 1 or not slots.shape[0] or not len(pool.shape):
            return None
        batch = int(slots.shape[0])
        return batch, max(1, int(pool.shape[0]) * spec.kv_cache.block_size // batch)

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        return cache_write_cases.bench(spec, bucket, rng)


def _bind(b: CallBinder, kernel: KernelDecl, checked: bool):
    spec, a, kv = b.spec, b.spec.attention, b.spec.kv_cache
    H, D, DV, B = a.num_kv_heads, a.head_dim, spec.v_head_dim_value, kv.block_size
    key = b.take("key", True)
    b.device = key.device
    if len(key.shape) != 3:
        raise ArgumentError(f"key: expected shape [num_tokens, {H}, {D}], got {list(key.shape)}")
    T = key.shape[0]
    b.check(key, (T, H, D), spec.dtype.q)
    value = b.take("value", True)
    b.check(value, (T, H, DV), spec.dtype.q)
    sm = b.take("slot_mapping", True)
    b.check(sm, (T,), "int32", contiguous=True)

    pool_format = PagedPool(spec)
    pool = pool_format.take_caches(b)
    detail = "the scale pool this kernel writes" if CacheFormat.of(spec).per_token else "given by the caller"
    pool_format.bind_scales(b, pool, detail)
    caches, scales, tensor = pool.caches, pool.scales, pool.tensor_scales
    b.refuse_unknown()
    pools = CacheFormat.of(spec).scale_pools  # then the scales are pools this kernel writes, like the caches
    b.refuse_aliasing([*caches, *(scales if pools else [])],
                      [key, value, sm, *([] if pools else scales), *tensor.values()])

    if checked:
        check_slots_and_scales(spec, sm, [*scales, *tensor.values()] if tensor else scales, pool.num_blocks)
    if T == 0:
        return [], None
    p = b.pointer
    values = {
        "key": p(key), "value": p(value), "slot_mapping": p(sm), "num_slots": pool.num_blocks * B,
        "key_s_tok": key.strides[0], "key_s_head": key.strides[1], "val_s_tok": value.strides[0],
        "val_s_head": value.strides[1], **pool.values,
    }
    return [kernel.launch({"num_tokens": T}, values, reached=pool.reached)], None


CACHE_WRITE = CacheWriteFamily()
