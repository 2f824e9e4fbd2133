"""Pool formats (docs/architecture.md, "Families by kind and pool"): what every kind takes from the
spec's cache layout, one object per kind of pool, chosen from the spec in one place (`pool_of`):

- PagedPool: K and V pools (separate NHD or HND, fused, vLLM), float or quantized, with k_scale and
  v_scale (per tensor, head or token; nvfp4: e4m3 block-scale pools and a tensor scale each);
- LatentPool: the mla layout's one pool of latent rows (K the whole row, V its first v_head_dim
  elements) with one scale set, kv_scale; fp8_ds_mla rows carry their own scales.

Each gives its argument rows (the cache, scale and stride parameters of a kind's table), the binding
of a call's cache and scale arguments (checked, with their launch values), its template constants
and the bytes one token of context takes. The format itself (shapes, strides, canonical views) is
kgen/formats/cache.py's; the registry (kgen/families/registry.py) picks a kind's family by `name`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kgen.arrays import ArrayArg, scale_value
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, array, stride
from kgen.families.binding import TENSOR_SCALE_NAMES  # nvfp4's per-tensor fp32 scales
from kgen.formats import ds_mla
from kgen.formats.cache import (
    AXES,
    BLOCK_GROUP,
    SCALE_AXES,
    CacheFormat,
    CacheStrides,
    block_scale_copy,
    cache_shapes,
    cache_strides,
    half_shapes,
    scale_pool_strides,
    scale_shape,
    vllm_x,
)
from kgen.formats.dtypes import dtype


@dataclass
class BoundPool:
    """One call's checked cache arrays, then (bind_scales) its scales, and the launch values of the
    pool's parameters (pointers and strides, by name)."""

    caches: list[ArrayArg]
    num_blocks: int
    strides: CacheStrides | None = None  # the paged pool's K/V bases and strides
    scales: list[ArrayArg | None] = field(default_factory=list)  # in the order of the pool's scale rows
    tensor_scales: dict[str, ArrayArg] = field(default_factory=dict)  # nvfp4's
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def reached(self) -> list[Any]:
        """What the launch must map for the kernel (a fused pool's K/V are reached by address)."""
        return [c.native for c in self.caches]


class PoolFormat:
    """What a kind asks of the spec's pool; PagedPool and LatentPool answer."""

    name = ""  # the registry's key (kgen/families/registry.py)
    cache_word = ""  # `kgen abi`'s call line: "the cache arrays:" or "the cache array:"

    def __init__(self, spec):
        self.spec, self.format = spec, CacheFormat.of(spec)

    # ---- the argument rows ----------------------------------------------------------------
    @property
    def cache_names(self) -> tuple[str, ...]:
        return self.format.names

    @property
    def scale_names(self) -> list[str]:
        """The scale arguments a call passes (none for an unscaled cache)."""
        raise NotImplementedError

    @property
    def scale_text(self) -> str:
        """The scales in words (`kgen abi`)."""
        return f"scale {self.spec.kv_cache.scale}"

    def cache_args(self, role: str, const: bool) -> list[Arg]:
        raise NotImplementedError

    def scale_args(self, role: str = "input", const: bool = True, use: str = "real = stored * scale") -> list[Arg]:
        raise NotImplementedError

    def stride_args(self) -> list[Arg]:
        raise NotImplementedError

    # ---- the binding ----------------------------------------------------------------------
    def take_caches(self, b) -> BoundPool:
        """The call's cache arrays: names (other layouts' refused), shapes and dtype."""
        b.refuse_other_layouts()
        caches = [b.take(n, True) for n in self.cache_names]
        N = caches[0].shape[0] if caches[0].shape else 0
        for c, shape in zip(caches, cache_shapes(self.spec, N).values(), strict=True):
            b.check(c, shape, self.spec.kv_cache.dtype)
        return BoundPool(caches, N)

    def bind_scales(self, b, pool: BoundPool, detail: str = "") -> None:
        """Take and check the scale arguments into `pool` (`detail` ends a missing scale's message)."""
        raise NotImplementedError

    # ---- what the template and the models take --------------------------------------------
    def template_constants(self, args: list[Arg]) -> dict[str, Any]:
        """The Cfg constants of the pool (`args`: the main kernel's table)."""
        raise NotImplementedError

    def bytes_per_token(self) -> int:
        """The bytes one token of context takes a kernel to read: its stored rows and per-token
        scales (a tensor's scales are read once)."""
        raise NotImplementedError


class PagedPool(PoolFormat):
    """Paged K and V pools: separate (NHD, HND), fused, vLLM; fp16/bf16/fp32, fp8 and int8 with
    k_scale/v_scale, nvfp4 with block-scale pools and tensor scales."""

    name, cache_word = "paged", "arrays"

    @property
    def scale_names(self) -> list[str]:
        f = self.format
        return (["k_scale", "v_scale"] if f.scaled else []) + (list(TENSOR_SCALE_NAMES) if f.block_scaled else [])

    @property
    def scale_text(self) -> str:
        return "scales: e4m3 per 16 elements and a tensor scale" if self.format.block_scaled else super().scale_text

    def cache_args(self, role: str, const: bool) -> list[Arg]:
        """k_cache and v_cache (a fused pool's halves: same strides, V one plane further)."""
        spec, kv = self.spec, self.spec.kv_cache
        pool = "[" + ", ".join(str(s) for s in cache_shapes(spec).get("kv_cache", ())) + "]"
        where = {"fused": ["K half of kv_cache " + pool + " (kv_cache[:, 0])", "V half of kv_cache[:, 1]"],
                 "vllm": [f"K vLLM pool, head_dim in runs of x = {vllm_x(spec)}", "V vLLM pool, tokens contiguous"]
                 }.get(kv.layout, [f"K {kv.resolved_order} pool", f"V {kv.resolved_order} pool"])
        if self.format.block_scaled:
            where = [w + ", packed: a byte holds elements 2i (low nibble) and 2i+1" for w in where]
        return [array(name, kv.dtype, role, shape, what + "; block, head and token strides may be padded", const=const)
                for what, (name, shape) in zip(where, half_shapes(spec).items(), strict=True)]

    def scale_args(self, role: str = "input", const: bool = True, use: str = "real = stored * scale") -> list[Arg]:
        """k_scale and v_scale (null pointers for a float cache); nvfp4: the block-scale pools and the
        tensor scales."""
        kv, shape = self.spec.kv_cache, scale_shape(self.spec)
        if self.format.block_scaled:
            return self._block_scale_args(role, const)
        what = "scales: null (the cache is not quantized)" if shape is None else f"{kv.scale} scales; {use}"
        return [array(name, "fp32", role, shape or (), f"{which} {what}", optional=shape is None, const=const)
                for name, which in (("k_scale", "K"), ("v_scale", "V"))]

    def _block_scale_args(self, role: str, const: bool) -> list[Arg]:
        """nvfp4: k_scale and v_scale (e4m3 block-scale pools), then k_tensor_scale and v_tensor_scale;
        the template passes each pool with its tensor scale as one kgen::Fp4Scales argument of the body."""
        shape = scale_shape(self.spec)
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

    def stride_args(self) -> list[Arg]:
        """The cache and scale-pool stride parameters every kind that reads or writes the pool takes."""
        rows = [stride(f"{p}_s_{axis}", f"{what} stride between {axis}s" + (" (0: head_dim is one run)"
                                                                            if axis == "run" else ""))
                for p, what in (("k", "K"), ("v", "V")) for axis in AXES]
        rows += [stride(f"{p}_s_{axis}", f"{what} scale-pool stride between {axis}s (per_token_head or nvfp4; "
                        "else 0)") for p, what in (("ks", "K"), ("vs", "V")) for axis in SCALE_AXES]
        return rows

    def take_caches(self, b) -> BoundPool:
        pool = super().take_caches(b)
        st = pool.strides = cache_strides(self.spec, pool.caches)
        pool.values = {"k_cache": b.raw(st.k_base), "v_cache": b.raw(st.v_base),
                       **{f"k_s_{axis}": s for axis, s in zip(AXES, st.k, strict=True)},
                       **{f"v_s_{axis}": s for axis, s in zip(AXES, st.v, strict=True)}}
        return pool

    def bind_scales(self, b, pool: BoundPool, detail: str = "") -> None:
        """k_scale and v_scale (None when absent) with their pool strides ((0, 0, 0) unless per token
        or nvfp4), then nvfp4's tensor scales."""
        scales, strides = (self._bind_block_scales(b, pool.num_blocks) if self.format.block_scaled
                           else self._bind_scales(b, pool.num_blocks, detail))
        pool.scales, pool.tensor_scales = scales, self._bind_tensor_scales(b)
        pool.values |= {"k_scale": b.pointer(scales[0]), "v_scale": b.pointer(scales[1])}
        pool.values |= {f"{p}_s_{axis}": s for p, st in zip(("ks", "vs"), strides, strict=True)
                        for axis, s in zip(SCALE_AXES, st, strict=True)}
        pool.values |= {name: b.pointer(s) for name, s in pool.tensor_scales.items()}

    def _bind_scales(self, b, num_blocks: int, detail: str) -> tuple[list, list[tuple[int, int, int]]]:
        spec, kv, f = self.spec, self.spec.kv_cache, self.format
        if kv.scale == "per_tensor":  # a Python float or a 0-d / one-element array of any float dtype
            scales = [take_per_tensor(b, name) for name in ("k_scale", "v_scale")]
        else:
            scales = [b.take("k_scale", False), b.take("v_scale", False)]
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
            b.check(s, sshape, "fp32", contiguous=not f.per_token)
            if f.per_token:
                pool_strides[i] = scale_pool_strides(spec, s)
        return scales, pool_strides

    def _bind_block_scales(self, b, num_blocks: int) -> tuple[list, list[tuple[int, int, int]]]:
        """nvfp4's k_scale and v_scale: e4m3 block-scale pools (uint8 bits or float8_e4m3fn), the cache's
        leading dims and head_dim / 16, each row aligned for the kernels' copies of it."""
        spec = self.spec
        sshape, align = scale_shape(spec, num_blocks), block_scale_copy(spec.attention.head_dim)
        scales, pool_strides = [], []
        for name in ("k_scale", "v_scale"):
            s = b.take(name, False)
            if s is None:
                raise ArgumentError(f"{name}: required for an nvfp4 cache: its e4m3 block scales, uint8 (e4m3 bits) "
                                    f"or float8_e4m3fn, shape {list(sshape)}")
            b.check(s, sshape, "fp8_e4m3")
            strides = scale_pool_strides(spec, s)
            if s.ptr % align or any(x % align for x in strides):
                raise ArgumentError(f"{name}: each row of block scales is copied {align} bytes at a time, so the "
                                    f"data pointer and the block, head and token strides {list(s.strides[:3])} must "
                                    f"be multiples of {align} bytes")
            scales.append(s)
            pool_strides.append(strides)
        return scales, pool_strides

    def _bind_tensor_scales(self, b) -> dict[str, ArrayArg]:
        """nvfp4's k_tensor_scale and v_tensor_scale (a Python float, or a 0-d / one-element float array);
        none for other caches (given ones are refused)."""
        taken = {name: take_per_tensor(b, name) for name in TENSOR_SCALE_NAMES}
        if not self.format.block_scaled:
            for name, s in taken.items():
                if s is not None:
                    raise ArgumentError(f"{name}: only nvfp4 caches take a tensor scale (this cache is "
                                        f"{self.spec.kv_cache.dtype}; its scales are k_scale and v_scale)")
            return {}
        for name, s in taken.items():
            if s is None:
                raise ArgumentError(f"{name}: required for an nvfp4 cache (fp32 [], real = e2m1 * e4m3 block scale "
                                    f"* {name}); a Python float is accepted")
            if s.shape == (1,):
                s.shape, s.strides = (), ()
            b.check(s, (), "fp32")
        return taken

    def template_constants(self, args: list[Arg]) -> dict[str, Any]:
        """Element types, the kgen::ScaleMode, the body's scale argument type (nvfp4: kgen::Fp4Scales of
        the block-scale pointer and the tensor scale), block-scale copies and K/V runs (vLLM: x and 1)."""
        spec, f = self.spec, self.format
        ctype = next(a.ctype for a in args if a.name == "k_scale")
        return {"kv_ctype": dtype(spec.kv_cache.dtype).ctype, "scale_mode": f.scale_mode,
                "scale_arg_ctype": f"kgen::Fp4Scales<{ctype}>" if f.block_scaled else ctype,
                "scale_copy": block_scale_copy(spec.attention.head_dim),
                "k_run": vllm_x(spec) if f.vllm else spec.attention.head_dim,
                "v_run": 1 if f.vllm else spec.v_head_dim_value}

    def bytes_per_token(self) -> int:
        """K and V rows of every KV head, plus per-token scales (nvfp4: its e4m3 block scales, a byte per
        16 elements)."""
        a, f = self.spec.attention, self.format
        row = f.dtype.bytes_for(a.head_dim) + f.dtype.bytes_for(self.spec.v_head_dim_value)
        scale = 2 * a.head_dim // BLOCK_GROUP if f.block_scaled else 2 * 4 if f.per_token else 0
        return a.num_kv_heads * (row + scale)


class LatentPool(PoolFormat):
    """The mla layout: one pool [num_blocks, block_size, head_dim] of latent rows read once for K and V
    (fp8_ds_mla: 656-byte rows), one scale set kv_scale (per tensor or per token)."""

    name, cache_word = "latent", "array"

    @property
    def scale_names(self) -> list[str]:
        return ["kv_scale"] if self.format.scaled else []

    @property
    def row_bytes(self) -> int:
        """The bytes of a latent row as stored (fp8_ds_mla: 656)."""
        return ds_mla.ROW_BYTES if self.format.ds_mla else self.spec.attention.head_dim * self.format.dtype.itemsize

    def cache_args(self, role: str, const: bool | None = None) -> list[Arg]:
        """kv_cache: read by the attention kinds, written by cache_write."""
        spec, ds = self.spec, self.format.ds_mla
        if role == "input":
            what = (f"latent rows: K the whole row, V its first {spec.v_head_dim_value} elements; block and token "
                    "strides may be padded" + ("; fp8_ds_mla: 656 bytes a row (512 e4m3, 4 fp32 tile scales, 64 bf16 "
                                               "rope), strides multiples of 16" if ds else ""))
        else:
            what = ("the latent pool; block and token strides may be padded"
                    + (" (multiples of 16 bytes; 656-byte fp8_ds_mla rows)" if ds else ""))
        return [array("kv_cache", spec.kv_cache.dtype, role, cache_shapes(spec)["kv_cache"], what, const=const)]

    def scale_args(self, role: str = "input", const: bool = True, use: str = "real = stored * scale") -> list[Arg]:
        """kv_scale, the pool's one scale set (null for a float cache)."""
        shape = scale_shape(self.spec)
        what = f"{self.spec.kv_cache.scale} scales; {use}" if shape is not None else \
            "null (fp8_ds_mla rows carry their own scales)" if self.format.ds_mla else "null (the cache is not quantized)"
        return [array("kv_scale", "fp32", role, shape or (), "latent-row scales: " + what, optional=shape is None,
                      const=const)]

    def stride_args(self, cache: str = "kv", scale: str = "ks") -> list[Arg]:
        """kv_cache's block and token strides, then a per-token kv_scale's (`cache`, `scale`: the names'
        prefixes, kv and ks; cache_write's c and cs)."""
        return [stride(f"{cache}_s_block", "kv_cache stride between blocks"),
                stride(f"{cache}_s_token", "kv_cache stride between tokens"),
                stride(f"{scale}_s_block", "per-token kv_scale stride between blocks (else 0)"),
                stride(f"{scale}_s_token", "per-token kv_scale stride between tokens (else 0)")]

    def take_caches(self, b, cache: str = "kv") -> BoundPool:
        pool = super().take_caches(b)
        c = pool.caches[0]
        pool.values = {"kv_cache": b.pointer(c), f"{cache}_s_block": c.strides[0], f"{cache}_s_token": c.strides[1]}
        return pool

    def bind_scales(self, b, pool: BoundPool, detail: str = "", scale: str = "ks") -> None:
        """kv_scale, checked against the pool's scale shape (None for a float cache); k_scale and v_scale
        are refused by name."""
        f, kv = self.format, self.spec.kv_cache
        for other in ("k_scale", "v_scale"):
            if b.call.get(other) is not None:
                raise ArgumentError(f"{other}: not an argument of the mla layout (its one scale set is kv_scale)")
        s = take_per_tensor(b, "kv_scale") if kv.scale == "per_tensor" else b.take("kv_scale", False)
        if not f.quantized:
            if s is not None:
                raise ArgumentError("kv_scale: fp8_ds_mla rows carry their own tile scales; leave kv_scale out"
                                    if f.ds_mla else f"kv_scale: a {kv.dtype} cache takes no scales (scale: none)")
            s = None
        else:
            shape = scale_shape(self.spec, pool.num_blocks)
            if s is None:
                raise ArgumentError(f"kv_scale: required for a {kv.dtype} cache with scale '{kv.scale}' "
                                    f"(fp32, shape {list(shape)}; {detail})")
            if s.shape == (1,) and shape == ():
                s.shape, s.strides = (), ()
            b.check(s, shape, "fp32", contiguous=not f.per_token)
        per_token = (s.strides[0], s.strides[1]) if f.per_token and s is not None else (0, 0)
        pool.scales = [s]
        pool.values |= {"kv_scale": b.pointer(s), f"{scale}_s_block": per_token[0], f"{scale}_s_token": per_token[1]}

    def template_constants(self, args: list[Arg] | None = None) -> dict[str, Any]:
        """The element type, the kgen::ScaleMode and fp8_ds_mla."""
        return {"kv_ctype": dtype(self.spec.kv_cache.dtype).ctype, "scale_mode": self.format.scale_mode,
                "ds_mla": self.format.ds_mla}

    def bytes_per_token(self) -> int:
        """One latent row (K and V both), plus its per-token scale."""
        return self.row_bytes + (4 if self.format.per_token else 0)


def pool_of(spec) -> PoolFormat:
    """The pool format of `spec`'s cache: the one place that reads the layout to choose it."""
    return LatentPool(spec) if CacheFormat.of(spec).mla else PagedPool(spec)


def take_per_tensor(b, name: str) -> ArrayArg | None:
    """A per-tensor scale: a Python float, or a 0-d / one-element array of any float dtype."""
    value = b.call.pop(name, None)
    return None if value is None else scale_value(name, value, b.first, ())
