"""The paged-decode family (docs/decode-family.md, docs/abi.md): one query token per sequence
against its paged KV cache, optionally split over KV partitions (flash-decoding) with a
merge kernel. The argument table here is the kernel ABI; the call binding checks a call
against it and packs the launches."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, as_array_arg, empty_like_library
from kgen.dtypes import dtype
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array, scalar, stride
from kgen.families.attention import decode_cases
from kgen.families.attention.decode_geometry import decode_geometry, vector_width, vllm_v_copy
from kgen.families.base import Config, FamilyBase, TunableParam, threads_problems
from kgen.families.binding import CallBinder, host_values
from kgen.families.decode_split import check_forced_partition, choose_split
from kgen.families.layout import (
    SCALE_MODES,
    bind_scales,
    cache_args,
    cache_names,
    cache_rows,
    cache_shapes,
    cache_strides,
    describe,
    layout_problems,
    scale_args,
    stride_args,
    stride_values,
    vllm_x,
)
from kgen.plan import DEFAULT_TARGET_BLOCKS, Plan

MERGE_THREADS = 128
_PARTITION_TOKENS = scalar("partition_tokens", "int32", "keys per partition, chosen by the call's plan (split only)")
# The device code of the kernels, in include order (templates/): platform, cp.async, packed
# conversions, the decode body.
DEVICE_HEADERS = ("common/platform.cuh", "common/async_copy.cuh", "common/convert.cuh", "common/paged_decode.cuh")


class PagedDecodeFamily(FamilyBase):
    kind = "paged_decode"
    template = "paged_decode.cu.j2"
    params = {"threads": TunableParam("threads", 128), "partition_size": TunableParam("partition_size", 64),
              "stages": TunableParam("stages", 0), "heads_per_thread": TunableParam("heads_per_thread", 0)}

    # ---- generation -------------------------------------------------------------------
    def unsupported(self, spec) -> list[str]:
        return layout_problems(spec)

    def check_config(self, spec, config: Config) -> list[str]:
        problems = threads_problems(config["threads"])
        p = config["partition_size"]
        if p < 0 or p % 16:
            problems.append(f"partition_size must be 0 or a positive multiple of 16 tokens (got {p})")
        if not problems:
            problems += decode_geometry(spec, config)[1]
        return problems

    def abi_config(self, spec) -> Config:
        return {"partition_size": 0}  # a hand-written kernel implements the single-pass launch

    def default_space(self, spec) -> dict[str, list[int]]:
        return {"threads": [64, 128, 256], "partition_size": [0, 64, 256], "stages": [2, 3]}

    def arguments(self, spec, config: Config) -> list[Arg]:
        a, d = spec.attention, spec.dtype
        Hq, D = a.num_q_heads, a.head_dim
        single_pass = not config["partition_size"]
        return [
            array("out", d.resolved_out, "output", ("num_seqs", Hq, D), "attention output of each query head"),
            array("q", d.q, "input", ("num_seqs", Hq, D), "query of each sequence's last token"),
            *cache_args(spec, "input", const=True),
            array("block_tables", "int32", "input", ("num_seqs", "max_blocks_per_seq"),
                  "physical block ids; entries past ceil(seq_len / block_size) are never read"),
            array("seq_lens", "int32", "input", ("num_seqs",),
                  "tokens in the KV cache of each sequence, 1 .. max_blocks_per_seq * block_size"),
            *scale_args(spec),
            array("alibi_slopes", "fp32", "input", (Hq,),
                  "ALiBi slope of each query head" if a.alibi else "null: the spec has no ALiBi", optional=not a.alibi),
            array("part_o", "fp32", "scratch", ("num_seqs", Hq, "max_partitions", D),
                  "split-KV: each partition's normalised output (null without split)", optional=single_pass),
            array("part_ml", "fp32", "scratch", ("num_seqs", Hq, "max_partitions", 2),
                  "split-KV: each partition's (max, sum) of exp (null without split)", optional=single_pass),
            array("lse", "fp32", "output", ("num_seqs", Hq),
                  "natural-log log-sum-exp of the final logits, -inf for no key (null unless requested)",
                  optional=True),
            scalar("max_blocks_per_seq", "int32", "columns of block_tables"),
            scalar("max_partitions", "int32", "partitions per sequence (grid z); 1 without split"),
            stride("q_s_seq", "q stride between sequences"), stride("q_s_head", "q stride between heads"),
            stride("o_s_seq", "out stride between sequences"), stride("o_s_head", "out stride between heads"),
            *stride_args(),
            *([] if single_pass else [_PARTITION_TOKENS]),
        ]

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        a, P = spec.attention, config["partition_size"]
        table = self.arguments(spec, config)
        # ABI 1 launches G x head_dim fp32 of dynamic shared memory (the group's queries); kgen's own
        # split configs keep everything in static shared memory and launch none, for occupancy.
        main = KernelDecl(spec.name, tuple(table), (a.num_kv_heads, "num_seqs", "max_partitions" if P else 1),
                          config["threads"], smem=0 if P else spec.group_size * a.head_dim * 4)
        if not P:
            return [main]
        by_name = {arg.name: arg for arg in table}
        reads = [replace(by_name[n], ctype="const " + by_name[n].ctype, role="input") for n in ("part_o", "part_ml")]
        merge = KernelDecl(f"{spec.name}_merge", (by_name["out"], *reads, *(by_name[n] for n in (
            "lse", "seq_lens", "max_partitions", "partition_tokens", "o_s_seq", "o_s_head"))),
            (a.num_q_heads, "num_seqs", 1), MERGE_THREADS)
        return [main, merge]

    def schedule(self, spec, config: Config, seq_lens: np.ndarray, target_blocks: int, partition_tokens: int | None = None,
                 q_indptr: np.ndarray | None = None) -> tuple[dict[str, int], list[KernelDecl]]:
        """Launch sizes for these lengths (kgen/families/decode_split.py) and the kernels launched."""
        if q_indptr is not None:
            raise ArgumentError(f"q_indptr: {spec.kind} has one query row per sequence; plan it with "
                                "kern.plan(seq_lens) alone")
        granule = config["partition_size"]
        check_forced_partition(partition_tokens, granule)
        split = choose_split(seq_lens, spec.attention.num_kv_heads, target_blocks, granule,
                             spec.attention.sliding_window or 0, partition_tokens)
        sizes = {"num_seqs": int(np.size(seq_lens)), "max_partitions": split.max_partitions,
                 "partition_tokens": split.partition_tokens}
        kernels = self.kernels(spec, config)
        return sizes, kernels if split.merged else kernels[:1]

    def template_context(self, spec, config: Config) -> dict[str, Any]:
        a, kv = spec.attention, spec.kv_cache
        layout_vllm = kv.layout == "vllm"
        kernels = self.kernels(spec, config)
        geo, problems = decode_geometry(spec, config)
        if geo is None:
            raise ValueError("; ".join(problems))  # render() runs check_config first
        return {
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
            "geo": geo,
            "main": kernels[0],
            "merge": kernels[1] if len(kernels) > 1 else None,
        }

    def abi_notes(self, spec) -> list[str]:
        a, kv = spec.attention, spec.kv_cache
        names = ["q", *cache_names(spec), "block_tables", "seq_lens"]
        names += ["k_scale", "v_scale"] if kv.scale != "none" else []
        names += ["alibi_slopes"] if a.alibi else []
        return [
            f"num_q_heads {a.num_q_heads}, num_kv_heads {a.num_kv_heads} (query head h reads KV head h / "
            f"{spec.group_size}), head_dim {a.head_dim}, block_size {kv.block_size}, cache {describe(spec)}, "
            f"scale {kv.scale}",
            f"softmax scale {spec.softmax_scale_value!r}"
            + (f", sliding window {a.sliding_window} (query at seq_len-1 sees keys seq_len-{a.sliding_window} .. "
               "seq_len-1)" if a.sliding_window else "")
            + (f", logits soft-cap {a.logits_soft_cap} (s = cap*tanh(s/cap), applied before ALiBi)"
               if a.logits_soft_cap else "")
            + (", ALiBi: logit += alibi_slopes[h] * (j - (seq_len - 1))" if a.alibi else ""),
            "",
            f"Call: kern({', '.join(names)}, out=None, return_lse=False) -> out, or (out, lse); the cache arrays:",
            *cache_rows(spec),
            "",
            "Rules: slots past a sequence's length in its last block hold garbage and must not be read"
            + ("" if spec.tail_masking else
               " (tail_masking: false: every seq_len is promised to be a multiple of block_size)") + ".",
            f"Loads: {vector_width(spec)} elements per vector load; pointers and strides must keep them aligned"
            + (f" (V: {vllm_v_copy(spec) // dtype(kv.dtype).itemsize} tokens per load along its block_size axis)"
               if kv.layout == "vllm" else "") + ".",
            "A hand-written kernel implements the single-pass launch below (part_o and part_ml null, max_partitions "
            "1); kgen's split-KV configs add partitions on grid z and a merge kernel.",
        ]

    # ---- the call ---------------------------------------------------------------------
    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan: Plan | None = None,
             target_blocks: int | None = None):
        """Check the call's arguments against the ABI and return (launches, result); without a
        plan the call plans itself from its lengths (host arrays) or its block table's width."""
        return _Binder(spec, call).bind(self, config, checked, plan, target_blocks or DEFAULT_TARGET_BLOCKS)

    # ---- verification and benchmarks (kgen/families/attention/decode_cases.py) --------------------
    def cases(self, spec, config: Config, rng: np.random.Generator):
        return decode_cases.matrix_cases(spec, config, rng)

    def run_case(self, kernel, case, rng: np.random.Generator):
        return decode_cases.run_case(kernel, case, rng)

    def bucket_of(self, spec, call):
        """batch = q's rows, context = the block table's capacity in tokens."""
        q, bt = call.get("q"), call.get("block_tables")
        if q is None or bt is None or len(q.shape) < 1 or len(bt.shape) != 2:
            return None
        return int(q.shape[0]), int(bt.shape[1]) * spec.kv_cache.block_size

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        return decode_cases.bench(spec, bucket, rng)


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

    def _planned(self, family: PagedDecodeFamily, config: Config, plan: Plan, num_seqs: int):
        """The plan's sizes and kernels, after checking it was made for this kernel and batch."""
        if plan.kernel != self.spec.name:
            raise ArgumentError(f"plan: made for kernel '{plan.kernel}', not '{self.spec.name}'")
        if num_seqs > plan.num_seqs:
            raise ArgumentError(f"plan: made for at most {plan.num_seqs} sequences, the call has {num_seqs} "
                                "(make the plan for the largest batch)")
        kernels = family.kernels(self.spec, config)
        return plan.sizes, kernels if plan.sizes["max_partitions"] > 1 else kernels[:1]

    def _scratch(self, plan: Plan | None, like: ArrayArg, given: ArrayArg | None, name: str,
                 shape: tuple) -> ArrayArg:
        """Split-KV scratch: the one given (checked), else the plan's (made at its first call), else new."""
        if given is not None or plan is None:
            return self._buffer(like, given, name, shape)
        key = (name, like.device if like.device == "cpu" else str(getattr(like.obj, "device", like.device)))
        if key not in plan.workspace:
            plan.workspace[key] = self._buffer(like, None, name, shape)
        return plan.workspace[key]

    def _buffer(self, like: ArrayArg, given: ArrayArg | None, name: str, shape: tuple) -> ArrayArg:
        """A packed fp32 output or scratch array: the one given (checked), else a new one."""
        if given is None:
            return as_array_arg(name, empty_like_library(like, shape, "fp32"))
        self.check(given, shape, "fp32", contiguous=True)
        return given

    def bind(self, family: PagedDecodeFamily, config: Config, checked: bool, plan: Plan | None,
             target_blocks: int):
        spec, a, kv = self.spec, self.spec.attention, self.spec.kv_cache
        D, B, Hq = a.head_dim, kv.block_size, a.num_q_heads
        q = self.take("q", True)
        self.device = q.device
        if len(q.shape) != 3:
            raise ArgumentError(f"q: expected shape [num_seqs, {Hq}, {D}], got {list(q.shape)}")
        S = q.shape[0]
        self.check(q, (S, Hq, D), spec.dtype.q)

        # caches
        self.refuse_other_layouts()
        caches = [self.take(n, True) for n in cache_names(spec)]
        N = caches[0].shape[0] if caches[0].shape else 0
        for c, shape in zip(caches, cache_shapes(spec, N).values(), strict=True):
            self.check(c, shape, kv.dtype)
        vec = vector_width(spec)
        st = cache_strides(spec, caches)
        if kv.layout == "vllm":  # K steps by block, head, run (x) and token; V by block, head and head_dim row
            self._aligned(caches[0], min(vec, vllm_x(spec)), st.k)
            self._aligned(caches[1], vllm_v_copy(spec) // caches[1].itemsize, (st.v[0], st.v[1], st.v[3]))
        else:
            for c in caches:
                self._aligned(c, vec, (*st.k[:3], *st.v[:3], 0, st.v_offset))

        bt = self.take("block_tables", True)
        if len(bt.shape) != 2:
            raise ArgumentError(f"block_tables: expected shape [{S}, max_blocks_per_seq], got {list(bt.shape)}")
        M = bt.shape[1]
        self.check(bt, (S, M), "int32", contiguous=True)
        sl = self.take("seq_lens", True)
        self.check(sl, (S,), "int32", contiguous=True)
        (ks, vs), scale_strides = bind_scales(self, spec, N)

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
        # lse, part_o and part_ml may be given (the verifier passes poisoned, guarded buffers);
        # a given lse implies return_lse
        lse = self.take("lse", False)
        return_lse = bool(self.call.pop("return_lse", False)) or lse is not None
        lse = self._buffer(q, lse, "lse", (S, Hq)) if return_lse else None
        if plan is None:  # lengths known on the host are planned for; a device array's by its table's width
            lens = host_values(sl) if sl.device == "cpu" else np.full(S, M * B)
            sizes, kernels = family.schedule(spec, config, lens, target_blocks)
        else:
            sizes, kernels = self._planned(family, config, plan, S)
        max_parts, rows = sizes["max_partitions"], sizes["num_seqs"]
        part_o, part_ml = self.take("part_o", False), self.take("part_ml", False)
        if not config["partition_size"] and (part_o is not None or part_ml is not None):
            raise ArgumentError("part_o/part_ml: split-KV scratch given, but this config is single-pass "
                                "(partition_size 0)")
        if max_parts > 1:  # scratch for the plan's sequences (given: the verifier's guarded buffers)
            part_o = self._scratch(plan, q, part_o, "part_o", (rows, Hq, max_parts, D))
            part_ml = self._scratch(plan, q, part_ml, "part_ml", (rows, Hq, max_parts, 2))
        self.refuse_unknown()
        written = [out, lse, part_o, part_ml]
        self.refuse_aliasing(written, [q, *caches, bt, sl, ks, vs, alibi, *written])

        if checked:
            self._check_values(bt, sl, N, M)

        ptr = self.pointer
        values = {
            "out": ptr(out), "q": ptr(q), "k_cache": self.raw(st.k_base), "v_cache": self.raw(st.v_base),
            "block_tables": ptr(bt), "seq_lens": ptr(sl), "k_scale": ptr(ks), "v_scale": ptr(vs),
            "alibi_slopes": ptr(alibi), "part_o": ptr(part_o), "part_ml": ptr(part_ml), "lse": ptr(lse),
            "max_blocks_per_seq": M, "max_partitions": max_parts,
            "partition_tokens": sizes["partition_tokens"], "q_s_seq": q.strides[0], "q_s_head": q.strides[1],
            "o_s_seq": out.strides[0], "o_s_head": out.strides[1], **stride_values(st, scale_strides),
        }
        launches = [k.launch({**sizes, "num_seqs": S}, values, reached=[c.native for c in caches]) for k in kernels]  # fused: K/V by address
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


PAGED_DECODE = PagedDecodeFamily()
