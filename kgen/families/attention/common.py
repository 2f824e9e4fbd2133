"""What decode and prefill share on the host (docs/abi.md): the argument rows of the kernel ABI, the
split-KV merge kernel's declaration, the template constants, and the call binding's steps
(query, pool, scales, ALiBi, out, LSE and scratch, lengths, block table, plan).

A kind differs only in its query rows (`Rows`): decode has one per sequence, prefill packs a
chunk per sequence with q_indptr. Everything else is one code path, so a fix or a new feature
(a cache format, a scale mode) lands in both kinds at once."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, as_array_arg, empty_like_library
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array, scalar, stride
from kgen.families.attention.decode_geometry import vector_width, vllm_v_copy
from kgen.families.base import Config, FamilyBase
from kgen.families.binding import CallBinder, host_values
from kgen.families.pool import BoundPool, pool_of
from kgen.formats.cache import (
    CacheFormat,
    cache_rows,
    describe,
    head_dims_text,
    layout_problems,
    vllm_x,
)
from kgen.formats.dtypes import dtype
from kgen.plan import DEFAULT_TARGET_BLOCKS, Plan
from kgen.plan.split import check_forced_partition, choose_prefill_split, choose_split
from kgen.runtime.placement import device_index

MERGE_THREADS = 128
PARTITION_TOKENS = scalar("partition_tokens", "int32", "keys per partition, chosen by the call's plan (split only)")


@dataclass(frozen=True)
class Rows:
    """How a kind lays out its query rows in q, out, lse and the split scratch."""

    count: str  # the symbolic row count: "num_seqs" (decode) or "num_q_tokens" (prefill)
    axis: str  # the stride suffix of the row axis: "seq" or "tok"
    packed: bool  # rows packed by sequence with q_indptr (several per sequence)
    q_text: str
    out_text: str
    seq_lens_text: str


DECODE_ROWS = Rows("num_seqs", "seq", False, "query of each sequence's last token",
                   "attention output of each query head",
                   "tokens in the KV cache of each sequence, 1 .. max_blocks_per_seq * block_size")
PREFILL_ROWS = Rows("num_q_tokens", "tok", True, "queries, packed by sequence (q_indptr)",
                    "attention output of each query row",
                    "KV tokens of each sequence including its chunk; q_len <= seq_len <= max_blocks_per_seq * "
                    "block_size")


# ---- the argument table (the kernel ABI) ------------------------------------------------------
def attention_arguments(spec, config: Config, rows: Rows) -> list[Arg]:
    """Every parameter of the main kernel, in ABI order."""
    a, d = spec.attention, spec.dtype
    Hq, D, DV, R = a.num_q_heads, a.head_dim, spec.v_head_dim_value, rows.count  # q/K and V/out widths
    single_pass, pool = not config["partition_size"], pool_of(spec)
    return [
        array("out", d.resolved_out, "output", (R, Hq, DV), rows.out_text),
        array("q", d.q, "input", (R, Hq, D), rows.q_text),
        *pool.cache_args("input", const=True),
        *([q_indptr_arg()] if rows.packed else []),
        *table_args(rows),
        *pool.scale_args(),
        array("alibi_slopes", "fp32", "input", (Hq,),
              "ALiBi slope of each query head" if a.alibi else "null: the spec has no ALiBi", optional=not a.alibi),
        *([array("sinks", "fp32", "input", (Hq,), "sink logit of each query head, used as given: a virtual key "
                 "of value zero in every softmax row")] if a.sinks else []),  # without sinks: the table unchanged
        *split_scratch_args(spec, rows, single_pass),
        array("lse", "fp32", "output", (R, Hq),
              ("natural-log log-sum-exp of the final logits and the sink, sinks[h] for no key" if a.sinks else
               "natural-log log-sum-exp of the final logits, -inf for no key") + " (null unless requested)",
              optional=True),
        *([scalar("num_seqs", "int32", "sequences in the batch")] if rows.packed else []),
        scalar("max_blocks_per_seq", "int32", "columns of block_tables"),
        scalar("max_partitions", "int32", "partitions per sequence (grid z" + (" / output slices"
                                                                             if rows.packed else "")
               + "); 1 without split"),
        *row_stride_args(rows),
        *pool.stride_args(),
        *([] if single_pass else [PARTITION_TOKENS]),
    ]


def q_indptr_arg(note: str = "") -> Arg:
    """A packed kind's q_indptr (`note` ends its description)."""
    return array("q_indptr", "int32", "input", ("num_seqs + 1",),
                 "sequence s owns query rows q_indptr[s] .. q_indptr[s+1]-1; q_indptr[0] = 0, non-decreasing" + note)


def table_args(rows: Rows) -> list[Arg]:
    """block_tables and seq_lens."""
    return [array("block_tables", "int32", "input", ("num_seqs", "max_blocks_per_seq"),
                  "physical block ids; entries past ceil(seq_len / block_size) are never read"),
            array("seq_lens", "int32", "input", ("num_seqs",), rows.seq_lens_text)]


def row_stride_args(rows: Rows) -> list[Arg]:
    """q's and out's row and head strides."""
    word = "query rows" if rows.packed else "sequences"
    return [stride(f"q_s_{rows.axis}", f"q stride between {word}"), stride("q_s_head", "q stride between heads"),
            stride(f"o_s_{rows.axis}", f"out stride between {word}"), stride("o_s_head", "out stride between heads")]


def split_scratch_args(spec, rows: Rows, optional: bool) -> list[Arg]:
    """part_o and part_ml, the split-KV scratch of every attention kind (`optional`: null in a
    single-pass launch)."""
    Hq, DV, R = spec.attention.num_q_heads, spec.v_head_dim_value, rows.count
    return [array("part_o", "fp32", "scratch", (R, Hq, "max_partitions", DV),
                  "split-KV: each partition's normalised output (null without split)", optional=optional),
            array("part_ml", "fp32", "scratch", (R, Hq, "max_partitions", 2),
                  "split-KV: each partition's (max, sum) of exp (null without split)", optional=optional)]


def merge_kernel(spec, table: list[Arg], rows: Rows) -> KernelDecl:
    """The split-KV merge: one block per (query head, row) combines the partitions by log-sum-exp."""
    by_name = {arg.name: arg for arg in table}
    reads = [replace(by_name[n], ctype="const " + by_name[n].ctype, role="input") for n in ("part_o", "part_ml")]
    reads += [by_name["sinks"]] if "sinks" in by_name else []  # the merge adds each head's sink once
    names = ["lse", *(["q_indptr"] if rows.packed else []), "seq_lens", *(["num_seqs"] if rows.packed else []),
             "max_partitions", "partition_tokens", f"o_s_{rows.axis}", "o_s_head"]
    return KernelDecl(f"{spec.name}_merge", (by_name["out"], *reads, *(by_name[n] for n in names)),
                      (spec.attention.num_q_heads, rows.count, 1), MERGE_THREADS)


# ---- what both families answer alike ----------------------------------------------------------
class AttentionFamily(FamilyBase):
    """The part of the Family protocol decode and prefill answer alike; each sets `rows` and
    `cases_module` (its matrix, case runner and benchmark inputs)."""

    rows: Rows
    cases_module: Any
    auditable = True  # kern.audit: the call's out (and lse) against the reference (kgen/audit.py)

    def unsupported(self, spec) -> list[str]:
        return layout_problems(spec)

    def abi_config(self, spec) -> Config:
        return {"partition_size": 0}  # a hand-written kernel implements the single-pass launch

    def arguments(self, spec, config: Config) -> list[Arg]:
        return attention_arguments(spec, config, self.rows)

    @staticmethod
    def partition_problems(config: Config) -> list[str]:
        p = config["partition_size"]
        return [f"partition_size must be 0 or a positive multiple of 16 tokens (got {p})"] if p < 0 or p % 16 else []

    def call_lines(self, spec, names: list[str] | None = None, rules: list[str] | None = None) -> list[str]:
        """`kgen abi`: the call (`names`: its arguments, call_names' unless given), the cache arrays and
        the rules (the reading rule unless given)."""
        pool = pool_of(spec)
        return [
            "",
            f"Call: kern({', '.join(names or call_names(spec, self.rows))}, out=None, return_lse=False) -> out, or "
            f"(out, lse); the cache {pool.cache_word}:",
            *cache_rows(spec),
            "",
            *(rules or [reading_rule(spec)]),
        ]

    def bucket_of(self, spec, call):
        """batch = the block table's rows (decode: q's), context = its capacity in tokens."""
        rows, bt = call.get("q" if not self.rows.packed else "block_tables"), call.get("block_tables")
        if rows is None or bt is None or len(rows.shape) < 1 or len(bt.shape) != 2:
            return None
        return int(rows.shape[0]), int(bt.shape[1]) * spec.kv_cache.block_size

    def split_schedule(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                       partition_tokens: int | None, blocks_per_seq: int, window: int = 0, keys: int = 0):
        """A kind with one query row per sequence: launch sizes for these lengths (kgen/plan/split.py:
        `blocks_per_seq` blocks a sequence, its KV heads or row blocks; `keys`: every row's key count
        when not its sequence's, a sparse kind's top-k) and the kernels launched."""
        extra = sorted(set(lengths) - {"seq_lens"})
        if extra:
            raise ArgumentError(f"{extra[0]}: {spec.kind} has one query row per sequence; plan it with "
                                "kern.plan(seq_lens) alone")
        seq_lens = np.full(np.size(lengths["seq_lens"]), keys) if keys else lengths["seq_lens"]
        granule = config["partition_size"]
        check_forced_partition(partition_tokens, granule)
        split = choose_split(seq_lens, blocks_per_seq, target_blocks, granule, window, partition_tokens)
        sizes = {"num_seqs": int(np.size(seq_lens)), "max_partitions": split.max_partitions,
                 "partition_tokens": split.partition_tokens}
        kernels = self.kernels(spec, config)
        return sizes, kernels if split.merged else kernels[:1]

    def packed_split(self, spec, config: Config, lengths: dict[str, np.ndarray], target_blocks: int,
                     partition_tokens: int | None, kv_heads: int, rows_per_token: int, rows_per_block: int,
                     window: int = 0):
        """A packed kind: (launch sizes, each sequence's row blocks, q_indptr, kernels launched) for these
        lengths and chunks (decode's planner, kgen/plan/split.py: one block per (tile of
        `rows_per_block` packed rows, KV head, partition)); the kind adds its grid's sizes."""
        lens, ind = prefill_lengths(spec, lengths)
        q_lens = np.diff(ind)
        row_tiles = -(-q_lens * rows_per_token // rows_per_block)
        split = choose_prefill_split(lens, q_lens, kv_heads, row_tiles, target_blocks, config["partition_size"],
                                     window, partition_tokens)
        sizes = {"num_seqs": int(lens.size), "num_q_tokens": int(ind[-1]), "max_partitions": split.max_partitions,
                 "partition_tokens": split.partition_tokens}
        kernels = self.kernels(spec, config)
        return sizes, row_tiles, ind, kernels if split.merged else kernels[:1]

    def cases(self, spec, config: Config, rng: np.random.Generator):
        return self.cases_module.matrix_cases(spec, config, rng)

    def run_case(self, kernel, case, rng: np.random.Generator):
        return self.cases_module.run_case(kernel, case, rng)

    def case_device_bytes(self, spec, case) -> int:
        measure = getattr(self.cases_module, "case_device_bytes", None)
        return measure(spec, case) if measure is not None else 0

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        return self.cases_module.bench(spec, bucket, rng)


# ---- the template constants -------------------------------------------------------------------
def c_float(x: float) -> str:
    if not math.isfinite(x):
        raise ValueError(f"non-finite constant {x}")
    return f"{float(x)!r}f"


def template_context(spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
    """The Cfg constants both attention templates take (types, scale mode, logit options, runs)."""
    a = spec.attention
    return {
        "q_ctype": dtype(spec.dtype.q).ctype,
        "out_ctype": dtype(spec.dtype.resolved_out).ctype,
        **pool_of(spec).template_constants(list(kernels[0].params)),
        "softmax_scale": c_float(spec.softmax_scale_value),
        "sliding_window": int(a.sliding_window or 0),
        "soft_cap": c_float(a.logits_soft_cap or 0.0),
        "vec": vector_width(spec),
        "partition_size": config["partition_size"],
        "main": kernels[0],
        "merge": kernels[1] if len(kernels) > 1 else None,
        "main_params": kernels[0].params_struct("Params", BODY_DEFAULTS),
        "merge_params": kernels[1].params_struct("MergeParams", BODY_DEFAULTS) if len(kernels) > 1 else None,
    }


# What an attention body reads that some of its kernels do not take: the single-pass main kernels'
# partition_tokens, and sinks of a spec without them (kernel bodies take `const Params&`: Params is
# generated from the argument table, these as constants; templates/abi1/ keeps ABI 1's positional calls).
BODY_DEFAULTS = {"partition_tokens": ("int", "0"), "sinks": ("const float*", "nullptr")}


def heads_line(spec) -> str:
    """`kgen abi`'s first line of a paged attention kind: heads, head dims, block size, cache and scales."""
    a = spec.attention
    return (f"num_q_heads {a.num_q_heads}, num_kv_heads {a.num_kv_heads} (query head h reads KV head h / "
            f"{spec.group_size}), {head_dims_text(spec)}, block_size {spec.kv_cache.block_size}, cache "
            f"{describe(spec)}, {pool_of(spec).scale_text}")


def sinks_note(spec) -> str:
    """`kgen abi`'s line on attention sinks (empty without)."""
    if not spec.attention.sinks:
        return ""
    return ("; attention sinks: row softmax over the keys plus sinks[h] (a virtual key of value zero, logit used as "
            "given): m = max(sinks[h], max_j s_j), out = sum_j e^(s_j-m) v_j / (e^(sinks[h]-m) + sum_j e^(s_j-m)); "
            "lse includes it (a row with no key: lse = sinks[h], out = 0)")


def call_names(spec, rows: Rows, keys: tuple[str, ...] = ("block_tables", "seq_lens")) -> list[str]:
    """The arguments a call passes, for `kgen abi`'s call line (`keys`: what names the keys; a sparse
    kind's indices)."""
    pool = pool_of(spec)
    names = ["q", *pool.cache_names, *(["q_indptr"] if rows.packed else []), *keys, *pool.scale_names]
    return names + (["alibi_slopes"] if spec.attention.alibi else []) + (["sinks"] if spec.attention.sinks else [])


def reading_rule(spec) -> str:
    """`kgen abi`'s rule on the slots a kernel must not read."""
    return ("Rules: slots past a sequence's length in its last block hold garbage and must not be read"
            + ("" if spec.tail_masking else
               " (tail_masking: false: every seq_len is promised to be a multiple of block_size)") + ".")


# ---- the call binding -------------------------------------------------------------------------
class AttentionBinder(CallBinder):
    """One attention call's arguments, step by step; each kind's bind() runs the steps in order."""

    def __init__(self, spec, call: dict[str, Any]):
        super().__init__(spec, call)
        self.pool_format = pool_of(spec)

    def query(self, rows: Rows) -> tuple[ArrayArg, int]:
        """q [rows, Hq, D] (its device is the call's), and the number of rows."""
        a = self.spec.attention
        q = self.take("q", True)
        self.device = q.device
        if len(q.shape) != 3:
            raise ArgumentError(f"q: expected shape [{rows.count}, {a.num_q_heads}, {a.head_dim}], "
                                f"got {list(q.shape)}")
        self.check(q, (q.shape[0], a.num_q_heads, a.head_dim), self.spec.dtype.q)
        return q, q.shape[0]

    def pool(self, v_by_token: bool) -> BoundPool:
        """The paged pool's cache arrays: names, shapes, dtype, and the alignment the vector loads need.
        `v_by_token`: the kernel reads a vLLM V cache along its token axis (decode's copies)."""
        spec = self.spec
        pool = self.pool_format.take_caches(self)
        caches, st = pool.caches, pool.strides
        vec = vector_width(spec)
        if CacheFormat.of(spec).dtype.packed:  # the arrays hold bytes: a load's 16 bytes are as many elements
            vec = CacheFormat.of(spec).dtype.bytes_for(vec)
        if CacheFormat.of(spec).vllm:  # K steps by block, head, run (x) and token
            self.aligned(caches[0], min(vec, vllm_x(spec)), st.k)
            if v_by_token:  # V by block, head and head_dim row
                self.aligned(caches[1], vllm_v_copy(spec) // caches[1].itemsize, (st.v[0], st.v[1], st.v[3]))
        else:
            for c in caches:
                self.aligned(c, vec, (*st.k[:3], *st.v[:3], 0, st.v_offset))
        return pool

    def latent_pool(self, q: ArrayArg) -> BoundPool:
        """The latent pool's kv_cache (shape, dtype, 16-byte copies: 8 elements, fp8_ds_mla's 16 bytes),
        after q's alignment."""
        self.aligned(q, 8, q.strides[:2])
        pool = self.pool_format.take_caches(self)
        cache = pool.caches[0]
        self.aligned(cache, 16 if CacheFormat.of(self.spec).ds_mla else 8, cache.strides[:2])
        return pool

    def aligned(self, arg: ArrayArg, vec: int, strides: tuple[int, ...]):
        """Vector loads need the pointer and every stride they step by to stay 16-byte aligned."""
        align = vec * arg.itemsize
        if arg.ptr % align:
            raise ArgumentError(f"{arg.name}: data pointer must be {align}-byte aligned for vector loads")
        if any(s % vec for s in strides):
            raise ArgumentError(
                f"{arg.name}: strides {list(arg.strides)} must be multiples of {vec} elements "
                f"({align} bytes) for the vectorized loads of this kernel"
            )

    def table(self, num_seqs: int | None) -> tuple[ArrayArg, ArrayArg]:
        """block_tables [S, M] and seq_lens [S] (S from q's rows when they are the sequences)."""
        bt = self.take("block_tables", True)
        S = "num_seqs" if num_seqs is None else num_seqs
        if len(bt.shape) != 2:
            raise ArgumentError(f"block_tables: expected shape [{S}, max_blocks_per_seq], got {list(bt.shape)}")
        S, M = bt.shape if num_seqs is None else (num_seqs, bt.shape[1])
        self.check(bt, (S, M), "int32", contiguous=True)
        sl = self.take("seq_lens", True)
        self.check(sl, (S,), "int32", contiguous=True)
        return bt, sl

    def scales(self, pool: BoundPool, detail: str = "") -> list[ArrayArg | None]:
        """The pool's scales (k_scale and v_scale, or kv_scale; None for a float cache), bound into
        `pool` with their launch values."""
        self.pool_format.bind_scales(self, pool, detail)
        return pool.scales

    def alibi(self) -> ArrayArg | None:
        a = self.spec.attention
        alibi = self.take("alibi_slopes", False)
        if a.alibi:
            if alibi is None:
                raise ArgumentError(f"alibi_slopes: required (spec has alibi: true), fp32 shape [{a.num_q_heads}]")
            self.check(alibi, (a.num_q_heads,), "fp32", contiguous=True)
        elif alibi is not None:
            raise ArgumentError("alibi_slopes: given, but the spec has alibi: false")
        return alibi

    def sinks(self) -> ArrayArg | None:
        """sinks [num_q_heads] fp32: required with attention.sinks, refused without (docs/abi.md)."""
        a = self.spec.attention
        sinks = self.take("sinks", False)
        if a.sinks:
            if sinks is None:
                raise ArgumentError(f"sinks: required (spec has sinks: true): one sink logit per query head, "
                                    f"fp32 shape [{a.num_q_heads}]")
            self.check(sinks, (a.num_q_heads,), "fp32", contiguous=True)
        elif sinks is not None:
            raise ArgumentError("sinks: given, but the spec has no attention sinks (attention.sinks: false); "
                                "a sink the kernel would ignore is refused")
        return sinks

    def out(self, q: ArrayArg, num_rows: int) -> ArrayArg:
        """out: the one given (checked), else a new one like q."""
        a = self.spec.attention
        shape, out_dtype = (num_rows, a.num_q_heads, self.spec.v_head_dim_value), self.spec.dtype.resolved_out
        out = self.take("out", False)
        if out is None:
            out = as_array_arg("out", empty_like_library(q, shape, out_dtype))
        self.check(out, shape, out_dtype)
        return out

    def lse(self, q: ArrayArg, num_rows: int) -> ArrayArg | None:
        """lse when asked for (return_lse, or an lse buffer given: the verifier's guarded one)."""
        lse = self.take("lse", False)
        return_lse = bool(self.call.pop("return_lse", False)) or lse is not None
        return self.buffer(q, lse, "lse", (num_rows, self.spec.attention.num_q_heads)) if return_lse else None

    def split_scratch(self, config: Config, plan: Plan | None, q: ArrayArg, max_parts: int, num_rows: int):
        """part_o and part_ml for a split launch: the ones given (the verifier's), else the plan's
        (made at its first call), else new ones; none for a single-pass launch."""
        a = self.spec.attention
        part_o, part_ml = self.take("part_o", False), self.take("part_ml", False)
        if not config["partition_size"] and (part_o is not None or part_ml is not None):
            raise ArgumentError("part_o/part_ml: split-KV scratch given, but this config is single-pass "
                                "(partition_size 0)")
        if max_parts <= 1 or not num_rows:
            return None, None
        return (self.scratch(plan, q, part_o, "part_o", (num_rows, a.num_q_heads, max_parts, self.spec.v_head_dim_value)),
                self.scratch(plan, q, part_ml, "part_ml", (num_rows, a.num_q_heads, max_parts, 2)))

    def scratch(self, plan: Plan | None, like: ArrayArg, given: ArrayArg | None, name: str,
                shape: tuple) -> ArrayArg:
        if given is not None or plan is None:
            return self.buffer(like, given, name, shape)
        # One flat array per name and device, grown to the largest call: plans that share a workspace
        # (kern.plan(..., workspace=)) reuse it, so a steady state allocates nothing.
        key = (name, like.device, device_index(like.obj))
        size = math.prod(shape)
        held = plan.workspace.get(key)
        if held is None or held.shape[0] < size:
            held = plan.workspace[key] = empty_like_library(like, (size,), "fp32")
        return as_array_arg(name, held[:size].reshape(shape))

    def buffer(self, like: ArrayArg, given: ArrayArg | None, name: str, shape: tuple) -> ArrayArg:
        """A packed fp32 output or scratch array: the one given (checked), else a new one."""
        if given is None:
            return as_array_arg(name, empty_like_library(like, shape, "fp32"))
        self.check(given, shape, "fp32", contiguous=True)
        return given

    def planned(self, family, config: Config, plan: Plan, num_seqs: int):
        """The plan's sizes and kernels, after checking it was made for this kernel and batch."""
        if plan.kernel != self.spec.name:
            raise ArgumentError(f"plan: made for kernel '{plan.kernel}', not '{self.spec.name}'")
        if num_seqs > plan.num_seqs:
            raise ArgumentError(f"plan: made for at most {plan.num_seqs} sequences, the call has {num_seqs} "
                                "(make the plan for the largest batch)")
        kernels = family.kernels(self.spec, config)
        return plan.sizes, kernels if plan.sizes["max_partitions"] > 1 else kernels[:1]

    def check_lengths(self, sl: ArrayArg, bt: ArrayArg, num_blocks: int, q_lens: np.ndarray | None = None,
                      min_len: int = 1) -> None:
        """Host-side checks of the values the kernel trusts: every seq_len in min_len..capacity, each
        q_len <= its seq_len, the tail-masking promise, and the block-table entries the kernel
        reads (from the window of the first query row to ceil(seq_len / B); none for a sequence
        without query rows). q_lens None: one query row per sequence (none for a
        padded row, seq_len 0, which min_len 0 allows)."""
        spec, B = self.spec, self.spec.kv_cache.block_size
        lens = host_values(sl).astype(np.int64)
        table = host_values(bt)
        max_blocks = table.shape[1]
        cap = max_blocks * B
        bad = np.nonzero((lens < min_len) | (lens > cap))[0]
        if bad.size:
            i = int(bad[0])
            raise ArgumentError(f"seq_lens[{i}] = {int(lens[i])}: must be in {min_len}..{cap} "
                                f"(max_blocks_per_seq {max_blocks} × block_size {B})")
        q_lens = np.minimum(lens, 1) if q_lens is None else q_lens
        bad = np.nonzero(q_lens > lens)[0]
        if bad.size:
            s = int(bad[0])
            raise ArgumentError(f"sequence {s}: q_len = q_indptr[{s + 1}] - q_indptr[{s}] = {int(q_lens[s])} is "
                                f"larger than seq_lens[{s}] = {int(lens[s])} (seq_lens counts the KV tokens "
                                "including the chunk)")
        if not spec.tail_masking:
            bad = np.nonzero(lens % B)[0]
            if bad.size:
                i = int(bad[0])
                raise ArgumentError(
                    f"seq_lens[{i}] = {int(lens[i])} is not a multiple of block_size {B}: the spec has "
                    f"tail_masking: false, a promise that every length is")
        window = spec.attention.sliding_window or 0
        first = np.maximum(0, lens - q_lens - window + 1) // B if window else np.zeros_like(lens)
        last = np.where(q_lens > 0, -(-lens // B), 0)
        cols = np.arange(table.shape[1])
        used = (cols >= first[:, None]) & (cols < last[:, None])
        wrong = np.argwhere(used & ((table < 0) | (table >= num_blocks)))
        if wrong.size:
            i, j = (int(x) for x in wrong[0])
            raise ArgumentError(
                f"block_tables[{i}, {j}] = {int(table[i, j])}: not a block of the pool "
                f"(0..{num_blocks - 1}); sequence {i} has {int(lens[i])} tokens"
            )

    def planned_sizes(self, family, config: Config, plan: Plan | None, num_seqs: int, lens,
                      target_blocks: int | None):
        """(launch sizes, kernels) of a call: the plan's, else a schedule for `lens` (its lengths by the
        names schedule() takes)."""
        if plan is not None:
            return self.planned(family, config, plan, num_seqs)
        return family.schedule(self.spec, config, lens, target_blocks or DEFAULT_TARGET_BLOCKS)

    def values(self, rows: Rows, q, out, pool: BoundPool, bt, sl, part_o, part_ml, lse, sizes: dict[str, int],
               max_blocks: int, **extra) -> dict[str, Any]:
        """The launch values of the argument table, by name (`extra`: the kind's own, as pointers or values)."""
        ptr = self.pointer
        return {
            "out": ptr(out), "q": ptr(q), "block_tables": ptr(bt), "seq_lens": ptr(sl), "part_o": ptr(part_o),
            "part_ml": ptr(part_ml), "lse": ptr(lse), "max_blocks_per_seq": max_blocks,
            "max_partitions": sizes["max_partitions"], "partition_tokens": sizes["partition_tokens"],
            f"q_s_{rows.axis}": q.strides[0], "q_s_head": q.strides[1], f"o_s_{rows.axis}": out.strides[0],
            "o_s_head": out.strides[1], **pool.values,
            **{k: ptr(v) if isinstance(v, ArrayArg) or v is None else v for k, v in extra.items()},
        }


def prefill_lengths(spec, lengths: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """seq_lens and q_indptr given to plan a prefill call (kern.plan(seq_lens, q_indptr=...)), checked:
    q_indptr one longer than seq_lens, from 0, non-decreasing, and no chunk longer than its sequence."""
    seq_lens, q_indptr = lengths["seq_lens"], lengths.get("q_indptr")
    extra = sorted(set(lengths) - {"seq_lens", "q_indptr"})
    if extra:
        raise ArgumentError(f"{extra[0]}: not a length of a {spec.kind} call (plan it with seq_lens and q_indptr)")
    if q_indptr is None:
        raise ArgumentError(f"q_indptr: required to plan a {spec.kind} call: kern.plan(seq_lens, q_indptr=...)")
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    ind = np.asarray(q_indptr, dtype=np.int64).reshape(-1)
    if ind.size != lens.size + 1 or ind[0] != 0 or np.any(np.diff(ind) < 0):
        raise ArgumentError(f"q_indptr: expected {lens.size + 1} non-decreasing offsets from 0 (one more than "
                            f"seq_lens), got {ind.tolist()!r:.80}")
    q_lens = np.diff(ind)
    bad = np.nonzero(q_lens > lens)[0]
    if bad.size:
        s = int(bad[0])
        raise ArgumentError(f"sequence {s}: q_len = {int(q_lens[s])} is larger than seq_lens[{s}] = {int(lens[s])}")
    return lens, ind


def call_lengths(sl: ArrayArg, ind: ArrayArg, num_rows: int, capacity: int) -> dict[str, np.ndarray]:
    """The lengths a prefill call without a plan is planned for: its own (host arrays), else, for
    device ones, full tables (`capacity` tokens) with the rows spread evenly over the sequences."""
    if sl.device == "cpu" and ind.device == "cpu":
        return {"seq_lens": host_values(sl), "q_indptr": host_values(ind)}
    S = sl.shape[0]
    per_seq = -(-num_rows // max(S, 1))
    return {"seq_lens": np.full(S, max(capacity, per_seq)),
            "q_indptr": np.minimum(np.arange(S + 1) * per_seq, num_rows)}


def planned_rows(plan: Plan | None, num_rows: int) -> int:
    """The query rows a prefill call's split scratch holds: the plan's (it was made for at most
    that many), else the call's."""
    if plan is None:
        return num_rows
    planned = plan.sizes["num_q_tokens"]
    if num_rows > planned:
        raise ArgumentError(f"plan: made for at most {planned} query rows, the call has {num_rows} "
                            "(make the plan for the largest batch)")
    return planned


def checked_q_lens(indptr: np.ndarray, num_rows: int) -> np.ndarray:
    """Each sequence's q_len, after checking q_indptr: starts at 0, non-decreasing, ends at the
    number of query rows."""
    indptr = indptr.astype(np.int64)
    if indptr[0] != 0:
        raise ArgumentError(f"q_indptr[0] = {int(indptr[0])}: must be 0 (sequence 0 starts at query row 0)")
    q_lens = np.diff(indptr)
    bad = np.nonzero(q_lens < 0)[0]
    if bad.size:
        s = int(bad[0])
        raise ArgumentError(f"q_indptr[{s + 1}] = {int(indptr[s + 1])} < q_indptr[{s}] = {int(indptr[s])}: "
                            f"q_indptr must be non-decreasing (sequence {s} would have a negative q_len)")
    if indptr[-1] != num_rows:
        raise ArgumentError(f"q_indptr[{len(indptr) - 1}] = {int(indptr[-1])}: must equal the number of query "
                            f"rows, q.shape[0] = {num_rows}")
    return q_lens
