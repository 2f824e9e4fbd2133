"""The paged-decode family: template context, tunable parameters, and the call ABI
(argument checks + launch plan) of DESIGN.md §3."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, as_array_arg, empty_like_library
from kgen.dtypes import QUANTIZED, dtype
from kgen.errors import ArgumentError
from kgen.families.base import Config, TunableParam, threads_problems
from kgen.families.binding import CallBinder, cache_names, host_values
from kgen.runtime.base import Launch

SCALE_MODES = {"none": 0, "per_tensor": 1, "per_head": 2, "per_token_head": 3}
MERGE_THREADS = 128


def vector_width(spec) -> int:
    """Elements per load: 16 bytes when head_dim allows, else the widest power of two that divides it."""
    item = dtype(spec.kv_cache.dtype).itemsize
    vec = 16 // item
    while spec.attention.head_dim % vec:
        vec //= 2
    return vec


def vllm_x(spec) -> int:
    """vLLM's K-cache packing factor: 16 bytes of elements."""
    return 16 // dtype(spec.kv_cache.dtype).itemsize


def layout_problems(spec) -> list[str]:
    """Why the spec's cache layout cannot hold its head_dim (vLLM packs K in runs of x)."""
    if spec.kv_cache.layout == "vllm" and spec.attention.head_dim % vllm_x(spec):
        return [f"kv_cache.layout vllm packs K in runs of x = {vllm_x(spec)} elements, so head_dim must be a "
                f"multiple of {vllm_x(spec)} (got {spec.attention.head_dim})"]
    return []


def cache_shapes(spec, num_blocks: str | int = "num_blocks") -> dict[str, tuple]:
    """The cache array shapes of the ABI (symbolic or concrete num_blocks)."""
    a, kv = spec.attention, spec.kv_cache
    n, b, h, d = num_blocks, kv.block_size, a.num_kv_heads, a.head_dim
    if kv.layout == "vllm":
        x = vllm_x(spec)
        return {"k_cache": (n, h, d // x, b, x), "v_cache": (n, h, d, b)}
    one = (n, b, h, d) if kv.resolved_order == "NHD" else (n, h, b, d)
    if kv.layout == "fused":
        return {"kv_cache": (n, 2, *one[1:])}  # [N, 2, ...one block]
    return {"k_cache": one, "v_cache": one}


def scale_shape(spec, num_blocks: str | int = "num_blocks") -> tuple | None:
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


class PagedDecodeFamily:
    kind = "paged_decode"
    template = "paged_decode.cu.j2"
    params = {
        "threads": TunableParam("threads", 128, "threads per thread block (multiple of 32, 32..1024)"),
        "partition_size": TunableParam(
            "partition_size", 0, "tokens per split-KV partition (0 = no split; else a multiple of block_size)"
        ),
    }

    # ---- generation -------------------------------------------------------------------
    def unsupported(self, spec) -> list[str]:
        return layout_problems(spec)

    def check_config(self, spec, config: Config) -> list[str]:
        problems = threads_problems(config["threads"])
        p = config["partition_size"]
        if p < 0 or (p and p % spec.kv_cache.block_size):
            problems.append(
                f"partition_size must be 0 or a positive multiple of block_size {spec.kv_cache.block_size} (got {p})"
            )
        return problems

    def kernel_names(self, spec, config: Config) -> list[str]:
        names = [spec.name]
        if config["partition_size"] > 0:
            names.append(f"{spec.name}_merge")
        return names

    def template_context(self, spec, config: Config) -> dict[str, Any]:
        a, kv = spec.attention, spec.kv_cache
        layout_vllm = kv.layout == "vllm"
        return {
            "kernel_name": spec.name,
            "q_ctype": dtype(spec.dtype.q).ctype,
            "out_ctype": dtype(spec.dtype.resolved_out).ctype,
            "kv_ctype": dtype(kv.dtype).ctype,
            "scale_mode": SCALE_MODES[kv.scale],
            "softmax_scale": _c_float(spec.softmax_scale_value),
            "sliding_window": int(a.sliding_window or 0),
            "soft_cap": _c_float(a.logits_soft_cap or 0.0),
            "k_run": vllm_x(spec) if layout_vllm else a.head_dim,
            "v_run": 1 if layout_vllm else a.head_dim,
            "vec": vector_width(spec),
            "threads": config["threads"],
            "partition_size": config["partition_size"],
            "merge_threads": MERGE_THREADS,
        }

    def smem_bytes(self, spec) -> int:
        return spec.group_size * spec.attention.head_dim * 4

    # ---- the call ---------------------------------------------------------------------
    def plan(self, spec, config: Config, call: dict[str, Any], checked: bool = True):
        """Check the call's arguments against the ABI and return (launches, result, keepalive)."""
        b = _Binder(spec, call)
        return b.bind(config, checked)


def _c_float(x: float) -> str:
    if not math.isfinite(x):
        raise ValueError(f"non-finite constant {x}")
    return f"{float(x)!r}f"


class _Binder(CallBinder):
    """Checks one call's arguments (names, shapes, dtypes, devices, strides, values) and plans its launches."""

    def _aligned(self, arg: ArrayArg, vec: int, strides: tuple[int, ...]):
        """Vector loads need the pointer and every stride they step by to stay 16-byte aligned."""
        align = vec * arg.itemsize
        if arg.ptr % align:
            raise ArgumentError(f"{arg.name}: data pointer must be {align}-byte aligned for vector loads")
        bad = [s for s in strides if s % vec]
        if bad:
            raise ArgumentError(
                f"{arg.name}: strides {list(arg.strides)} must be multiples of {vec} elements "
                f"({align} bytes) for the vectorized loads of this kernel"
            )

    def bind(self, config: Config, checked: bool):
        spec, a, kv = self.spec, self.spec.attention, self.spec.kv_cache
        G, D, B, Hq, Hkv = spec.group_size, a.head_dim, kv.block_size, a.num_q_heads, a.num_kv_heads
        q = self.take("q", True)
        self.device = q.device
        if len(q.shape) != 3:
            raise ArgumentError(f"q: expected shape [num_seqs, {Hq}, {D}], got {list(q.shape)}")
        S = q.shape[0]
        self.check(q, (S, Hq, D), spec.dtype.q)

        # caches
        names = cache_names(spec)
        self.refuse_other_layouts()
        caches = [self.take(n, True) for n in names]
        N = caches[0].shape[0] if caches[0].shape else 0
        for c, shape in zip(caches, cache_shapes(spec, N).values(), strict=True):
            self.check(c, shape, kv.dtype)
        vec = vector_width(spec)
        if kv.layout == "fused":
            kvc = caches[0]
            k_ptr_arg, v_ptr_arg = _view(kvc, 0), _view(kvc, 1)
            st = kvc.strides
            k_str = v_str = (st[0], *st[2:])  # block, then as separate
            k_off, v_off = 0, st[1]
        else:
            k_ptr_arg, v_ptr_arg = caches[0].native, caches[1].native
            k_str, v_str = caches[0].strides, caches[1].strides
            k_off = v_off = 0
        if kv.layout == "vllm":
            # K [N, H, D/x, B, x]: block, head, token (x), run (B*x); V [N, H, D, B]: run stride B.
            ksb, ksh, ksr, kst = k_str[0], k_str[1], k_str[2], k_str[3]
            vsb, vsh, vsr, vst = v_str[0], v_str[1], v_str[2], 1
            self._aligned(caches[0], min(vec, vllm_x(spec)), (ksb, ksh, ksr, kst))
        else:
            if kv.resolved_order == "NHD":
                ksb, kst, ksh = k_str[0], k_str[1], k_str[2]
                vsb, vst, vsh = v_str[0], v_str[1], v_str[2]
            else:
                ksb, ksh, kst = k_str[0], k_str[1], k_str[2]
                vsb, vsh, vst = v_str[0], v_str[1], v_str[2]
            ksr = vsr = 0
            for c in caches:
                self._aligned(c, vec, (ksb, ksh, kst, vsb, vsh, vst, k_off, v_off))

        bt = self.take("block_tables", True)
        if len(bt.shape) != 2:
            raise ArgumentError(f"block_tables: expected shape [{S}, max_blocks_per_seq], got {list(bt.shape)}")
        M = bt.shape[1]
        self.check(bt, (S, M), "int32", contiguous=True)
        sl = self.take("seq_lens", True)
        self.check(sl, (S,), "int32", contiguous=True)

        # scales
        quant = kv.dtype in QUANTIZED
        ks = self.take("k_scale", False)
        vs = self.take("v_scale", False)
        sshape = scale_shape(spec, N)
        scale_strides = [(0, 0, 0), (0, 0, 0)]
        if quant:
            for i, s in enumerate((ks, vs)):
                name = ("k_scale", "v_scale")[i]
                if s is None:
                    raise ArgumentError(
                        f"{name}: required for a {kv.dtype} cache with scale '{kv.scale}' "
                        f"(fp32, shape {list(sshape)})"
                    )
                if s.shape == (1,) and sshape == ():
                    s.shape, s.strides = (), ()
                self.check(s, sshape, "fp32", contiguous=kv.scale != "per_token_head")
                if kv.scale == "per_token_head":
                    if kv.resolved_order == "NHD":
                        scale_strides[i] = (s.strides[0], s.strides[2], s.strides[1])
                    else:
                        scale_strides[i] = (s.strides[0], s.strides[1], s.strides[2])
        else:
            for s in (ks, vs):
                if s is not None:
                    raise ArgumentError(f"{s.name}: a {kv.dtype} cache takes no scales (scale: none)")

        alibi = self.take("alibi_slopes", False)
        if a.alibi:
            if alibi is None:
                raise ArgumentError(f"alibi_slopes: required (spec has alibi: true), fp32 shape [{Hq}]")
            self.check(alibi, (Hq,), "fp32", contiguous=True)
        elif alibi is not None:
            raise ArgumentError("alibi_slopes: given, but the spec has alibi: false")

        out = self.take("out", False)
        out_dtype = spec.dtype.resolved_out
        if out is None:
            out = as_array_arg("out", empty_like_library(q, (S, Hq, D), out_dtype))
        self.check(out, (S, Hq, D), out_dtype)
        return_lse = bool(self.call.pop("return_lse", False))
        lse = as_array_arg("lse", empty_like_library(q, (S, Hq), "fp32")) if return_lse else None
        self.refuse_unknown()
        self.refuse_aliasing([out], [q, *caches, bt, sl, ks, vs, alibi])

        if checked:
            self._check_values(bt, sl, N, M)

        P = config["partition_size"]
        max_parts = -(-M * B // P) if P else 1
        part_o = part_ml = None
        if P:
            part_o = as_array_arg("part_o", empty_like_library(q, (S, Hq, max_parts, D), "fp32"))
            part_ml = as_array_arg("part_ml", empty_like_library(q, (S, Hq, max_parts, 2), "fp32"))

        ptr = self.pointer
        i32, i64 = np.int32, np.int64
        args = [
            ptr(out), ptr(q), self.raw(k_ptr_arg), self.raw(v_ptr_arg), ptr(bt), ptr(sl),
            ptr(ks), ptr(vs), ptr(alibi), ptr(part_o), ptr(part_ml), ptr(lse),
            i32(M), i32(max_parts),
            i64(q.strides[0]), i64(q.strides[1]), i64(out.strides[0]), i64(out.strides[1]),
            i64(ksb), i64(ksh), i64(kst), i64(ksr), i64(vsb), i64(vsh), i64(vst), i64(vsr),
            *(i64(x) for x in scale_strides[0]), *(i64(x) for x in scale_strides[1]),
        ]
        launches = [Launch(spec.name, (Hkv, S, max_parts), (config["threads"], 1, 1),
                           G * D * 4, args, reached=[c.native for c in caches])]  # fused: K/V by address
        if P:
            launches.append(Launch(f"{spec.name}_merge", (Hq, S, 1), (MERGE_THREADS, 1, 1), 0, [
                ptr(out), ptr(part_o), ptr(part_ml), ptr(lse), ptr(sl), i32(max_parts),
                i64(out.strides[0]), i64(out.strides[1]),
            ]))
        result = (out.obj, lse.obj) if lse is not None else out.obj
        return launches, result

    def _check_values(self, bt: ArrayArg, sl: ArrayArg, num_blocks: int, max_blocks: int):
        """Host-side checks of the values the kernel trusts (the checked path)."""
        spec, B = self.spec, self.spec.kv_cache.block_size
        lens = host_values(sl)
        table = host_values(bt)
        cap = max_blocks * B
        bad = np.nonzero((lens < 1) | (lens > cap))[0]
        if bad.size:
            i = int(bad[0])
            raise ArgumentError(
                f"seq_lens[{i}] = {int(lens[i])}: must be in 1..{cap} "
                f"(max_blocks_per_seq {max_blocks} × block_size {B})"
            )
        if not spec.tail_masking:
            bad = np.nonzero(lens % B)[0]
            if bad.size:
                i = int(bad[0])
                raise ArgumentError(
                    f"seq_lens[{i}] = {int(lens[i])} is not a multiple of block_size {B}: the spec has "
                    f"tail_masking: false, a promise that every length is"
                )
        # Only the entries the kernel reads: from the window's first block to ceil(seq_len / B).
        n = lens.astype(np.int64)
        window = spec.attention.sliding_window or 0
        first = np.maximum(0, n - window) // B if window else np.zeros_like(n)
        cols = np.arange(table.shape[1])
        used = (cols >= first[:, None]) & (cols < (-(-n // B))[:, None])
        wrong = np.argwhere(used & ((table < 0) | (table >= num_blocks)))
        if wrong.size:
            i, j = (int(x) for x in wrong[0])
            raise ArgumentError(
                f"block_tables[{i}, {j}] = {int(table[i, j])}: not a block of the pool "
                f"(0..{num_blocks - 1}); sequence {i} has {int(n[i])} tokens"
            )


def _view(kvc: ArrayArg, which: int) -> int:
    """Address of the K (0) or V (1) half of a fused cache."""
    return kvc.ptr + which * kvc.strides[1] * kvc.itemsize


PAGED_DECODE = PagedDecodeFamily()
