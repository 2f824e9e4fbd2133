"""cache_write for the mla layout (docs/abi.md "MLA", docs/cache-kernels.md): store each token's
latent row `kv` [num_tokens, head_dim] into the one pool kv_cache [num_blocks, block_size,
head_dim] at slot_mapping, converted or quantized as every cache_write does (kgen/quantize.py),
writing the per-token kv_scale of each written row when the scales are per token."""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array, scalar, stride
from kgen.families.base import Config, FamilyBase
from kgen.families.binding import CallBinder, refuse_plan
from kgen.families.cache import mla_write_cases
from kgen.families.cache.write_rules import check_slots_and_scales, conversion_rule
from kgen.families.pool import LatentPool
from kgen.formats.cache import CacheFormat, cache_rows, describe
from kgen.formats.dtypes import dtype

THREADS = 32  # one warp per token: lanes stride over head_dim, lane 0 writes a per-token scale


class MlaCacheWriteFamily(FamilyBase):
    kind = "cache_write"
    template = "cache_write_mla.cu.j2"
    params: dict = {}  # the geometry is fixed: one warp per token

    def unsupported(self, spec) -> list[str]:
        if spec.kv_cache.dtype == "nvfp4":  # (refused today by family_for's unbuilt_features too)
            return ["kv_cache.dtype: nvfp4 is not built for the mla layout (allowed: fp16, bf16, fp32, fp8_e4m3, "
                    "fp8_e5m2, int8)"]
        return []

    def check_config(self, spec, config: Config) -> list[str]:
        return []

    def default_space(self, spec) -> dict[str, list[int]]:
        return {}

    def arguments(self, spec, config: Config) -> list[Arg]:
        a, f, pool = spec.attention, CacheFormat.of(spec), LatentPool(spec)
        return [
            array("kv", spec.dtype.q, "input", ("num_tokens", a.head_dim),
                  f"new latent rows (latent {spec.v_head_dim_value}, then rope {a.head_dim - spec.v_head_dim_value}; "
                  "last dim contiguous)"),
            *pool.cache_args("output"),
            *pool.scale_args("output" if f.per_token else "input", const=False,
                             use="WRITTEN for each written slot: max|x| / QMAX (1.0 if that is not > 0)" if f.per_token
                             else "read: stored = real / scale (positive, finite)"),
            array("slot_mapping", "int32", "input", ("num_tokens",),
                  "slot = block * block_size + offset of each token; -1 = skip; no slot twice"),
            scalar("num_tokens", "int32", "rows of kv"),
            scalar("num_slots", "int64", "num_blocks * block_size (slots past it are never written)"),
            stride("kv_s_tok", "kv stride between tokens"),
            *pool.stride_args("c", "cs"),
        ]

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        return [KernelDecl(spec.name, tuple(self.arguments(spec, config)), ("num_tokens", 1, 1), THREADS)]

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        return {"in_ctype": dtype(spec.dtype.q).ctype, **LatentPool(spec).template_constants(), "threads": THREADS,
                "main": kernels[0]}

    def abi_notes(self, spec) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        names = ["kv", "kv_cache", "slot_mapping", *LatentPool(spec).scale_names]
        return [f"mla layout: head_dim {a.head_dim} (latent {spec.v_head_dim_value} + rope "
                f"{a.head_dim - spec.v_head_dim_value}), block_size {kv.block_size}, cache {describe(spec)}, "
                f"inputs {spec.dtype.q}", "",
                f"Call: kern({', '.join(names)}) -> None (the cache is written in place); the cache array:",
                *cache_rows(spec), "", "Conversion: " + conversion_rule(kv.dtype), "One warp per token."]

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan=None,
             target_blocks: int | None = None):
        refuse_plan(spec, plan)
        return _bind(CallBinder(spec, call), self.kernels(spec, config)[0], checked)

    def cases(self, spec, config: Config, rng: np.random.Generator):
        return mla_write_cases.cases()

    def run_case(self, kernel, case, rng: np.random.Generator):
        return mla_write_cases.run_case(kernel, case, rng)

    def bucket_of(self, spec, call):
        """batch = tokens written, context = the pool's tokens per token written."""
        slots, pool = call.get("slot_mapping"), call.get("kv_cache")
        if slots is None or pool is None or len(slots.shape) != 1 or not slots.shape[0] or not len(pool.shape):
            return None
        batch = int(slots.shape[0])
        return batch, max(1, int(pool.shape[0]) * spec.kv_cache.block_size // batch)

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        return mla_write_cases.bench(spec, bucket, rng)


def _bind(b: CallBinder, kernel: KernelDecl, checked: bool):
    spec, D, B = b.spec, b.spec.attention.head_dim, b.spec.kv_cache.block_size
    f = CacheFormat.of(spec)
    kv = b.take("kv", True)
    b.device = kv.device
    if len(kv.shape) != 2:
        raise ArgumentError(f"kv: expected shape [num_tokens, {D}] (the mla layout's latent rows), "
                            f"got {list(kv.shape)}")
    T = kv.shape[0]
    b.check(kv, (T, D), spec.dtype.q)
    sm = b.take("slot_mapping", True)
    b.check(sm, (T,), "int32", contiguous=True)
    pool_format = LatentPool(spec)
    pool = pool_format.take_caches(b, "c")
    cache, N = pool.caches[0], pool.num_blocks
    if f.ds_mla and (cache.ptr % 16 or any(st % 16 for st in cache.strides[:2])):
        raise ArgumentError(f"kv_cache: fp8_ds_mla rows are written with 4- and 16-byte stores: the pointer and the "
                            f"block and token strides (got {list(cache.strides[:2])} bytes) must be multiples of 16")
    pool_format.bind_scales(b, pool, "the scale pool this kernel writes" if f.per_token else "given by the caller",
                            "cs")
    scale = pool.scales[0]
    b.refuse_unknown()
    b.refuse_aliasing([cache, *([scale] if f.per_token else [])], [kv, sm, *([] if f.per_token else [scale])])
    if checked:
        check_slots_and_scales(spec, sm, [scale], N)
    if T == 0:
        return [], None
    p = b.pointer
    values = {"kv": p(kv), "slot_mapping": p(sm), "num_tokens": T, "num_slots": N * B, "kv_s_tok": kv.strides[0],
              **pool.values}
    return [kernel.launch({"num_tokens": T}, values, reached=pool.reached)], None


MLA_CACHE_WRITE = MlaCacheWriteFamily()
