"""The verification matrix of sparse mla decode and prefill (attention.sparse_topk, docs/verification.md):
a paged latent pool from decode's generator (shuffled blocks, shared prefixes, padded views), then an
`indices` row per query row drawn from its sequence's visible slots with the traps of the contract:
-1 padding (scattered, and trailing as a top-k length leaves it), repeated slots, slots of blocks two
sequences share, the first and last slot of blocks and slots of the partly filled last block, rows
with no valid entry; and afterwards NaN poison in every slot of the pool that no row names (and
their per-token scales). out and lse are pre-filled inside guard bytes; every (row, head) is judged
against the float64 reference, which gathers by the indices (reference.sparse_as_dense)."""

from __future__ import annotations

import numpy as np

from kgen.families.attention.adversarial_cases import poison
from kgen.families.attention.decode_cases import (
    attention_references,
    cast_values,
)
from kgen.families.attention.mla_cases import launch_judged, make_mla_case
from kgen.families.base import Bench, Case, Config
from kgen.formats import ds_mla
from kgen.formats.cache import CacheFormat
from kgen.formats.dtypes import dtype
from kgen.verify.judge.bounds import check_output, head_dims
from kgen.verify.judge.report import CaseResult


def draw_row(N: int, visible: int, table_row: np.ndarray, B: int, rng: np.random.Generator,
             traps: tuple[str, ...] = ("edges",)) -> np.ndarray:
    """One indices row [N] int32 of a query row that sees positions 0 .. visible - 1 of its sequence
    (table_row: its block table): physical slots block * B + offset, in a random order. `traps`:
    "edges" names the first and last slot of the first blocks and the last visible one (in the
    partly filled last block); "padding" leaves a random share of entries -1, "tail_padding" the last
    ones (valid entries first, as a top-k length leaves them); "duplicates" repeats slots (one three
    times); "empty" makes every entry -1."""
    row = np.full(N, -1, dtype=np.int64)
    if "empty" in traps or visible < 1:
        return row.astype(np.int32)
    want = min(N, visible)
    if "padding" in traps or "tail_padding" in traps:
        want = int(rng.integers(max(1, want // 3), max(2, 2 * want // 3 + 1)))
    must = [p for p in (0, B - 1, B, 2 * B - 1, visible - 1) if p < visible] if "edges" in traps else []
    must = list(dict.fromkeys(must))[:want]
    rest = np.setdiff1d(np.arange(visible), must)
    pos = np.concatenate([np.asarray(must, dtype=np.int64),
                          rng.choice(rest, size=min(rest.size, want - len(must)), replace=False)]).astype(np.int64)
    if "duplicates" in traps and pos.size:
        extra = min(N - pos.size, max(2, pos.size // 4))
        if extra < 2:  # no room: overwrite distinct entries with copies instead
            k = max(1, pos.size // 4)
            pos[-k:] = pos[0]
        else:
            pos = np.concatenate([pos, [pos[0], pos[0]], rng.choice(pos, size=extra - 2)])
    slots = table_row[pos // B].astype(np.int64) * B + pos % B
    rng.shuffle(slots)
    if "tail_padding" in traps:
        row[: slots.size] = slots
    else:
        row[np.sort(rng.choice(N, size=slots.size, replace=False))] = slots
    return row.astype(np.int32)


def poison_unnamed(spec, args: dict, indices: np.ndarray) -> None:
    """NaN (the cache dtype's poison) in every pool slot no indices row names, and in its scale."""
    kv, B = args["kv_cache"], spec.kv_cache.block_size
    named = np.zeros(kv.shape[0] * B, dtype=bool)
    named[indices[indices >= 0]] = True
    blocks, offsets = np.divmod(np.nonzero(~named)[0], B)
    if CacheFormat.of(spec).ds_mla:  # 656-byte rows: NaN bytes in the latent, scale and rope parts
        kv[blocks, offsets] = ds_mla.poison_rows((blocks.size,))
    else:
        kv[blocks, offsets] = np.asarray(poison(spec.kv_cache.dtype)).astype(kv.dtype)
    if CacheFormat.of(spec).per_token:
        args["kv_scale"][blocks, offsets] = np.nan


def make_sparse_case(spec, seq_lens: list[int], q_lens: list[int], rng: np.random.Generator,
                     traps: list[tuple[str, ...]] | None = None, share_prefix: bool = False,
                     padded: bool = False) -> dict:
    """Host arguments of one sparse call: the pool of `seq_lens` (decode's generator), q_lens[s] query
    rows of sequence s (each at its chunk position, seeing keys 0 .. its position), an indices row per
    query row (`traps[row]`, see draw_row), every unnamed slot poisoned. Decode (all q_lens 1, no
    q_indptr given back) or prefill (q_indptr)."""
    N, B, a = spec.attention.sparse_topk, spec.kv_cache.block_size, spec.attention
    args = make_mla_case(spec, seq_lens, rng, share_prefix=share_prefix, padded=padded)
    tables = args.pop("block_tables")
    rows = [(s, n - q + j + 1) for s, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)) for j in range(q)]
    traps = traps or [("edges",)] * len(rows)
    indices = np.stack([draw_row(N, vis, tables[s], B, rng, traps[r]) for r, (s, vis) in enumerate(rows)]) \
        if rows else np.zeros((0, N), dtype=np.int32)
    poison_unnamed(spec, args, indices)
    args["indices"] = indices
    if spec.kind == "paged_prefill":
        args["q"] = cast_values(rng.standard_normal((len(rows), a.num_q_heads, a.head_dim)), spec.dtype.q)
        args["q_indptr"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return args


def _case(name: str, lens: list[int], q_lens: list[int], traps: list[tuple[str, ...]], **extra) -> Case:
    return Case(name, {"seq_lens": lens, "q_lens": q_lens, "traps": traps, **extra}, list(lens))


def decode_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    """Each trap on its own, then together in a mixed batch (a row with no valid entry among them)."""
    N, B = spec.attention.sparse_topk, spec.kv_cache.block_size
    short = 2 * B + max(1, B // 2)  # a partly filled last block
    long_len = N + B + max(1, B // 2)  # enough keys for N distinct ones
    one = [1]
    cases = [_case("edges", [short], one, [("edges",)]),
             _case("full_topk", [long_len], one, [("edges",)]),
             _case("padding", [long_len], one, [("edges", "padding")]),
             _case("tail_padding", [long_len], one, [("tail_padding",)]),
             _case("duplicates", [short], one, [("edges", "duplicates")]),
             _case("shared_prefix", [3 * B + max(1, B // 2), 2 * B + 1], one * 2, [("edges",)] * 2, share_prefix=True),
             _case("padded_pool", [short, max(1, B // 2)], one * 2, [("edges",), ("duplicates",)], padded=True)]
    mixed = [int(x) for x in rng.integers(1, long_len + 1, size=4)]
    kinds = [("edges",), ("empty",), ("padding", "duplicates"), ("tail_padding",)]
    cases.append(_case("mixed_batch", mixed, one * 4, kinds, lse=True))
    cases.append(_case("empty_rows", [short, short], one * 2, [("empty",)] * 2, lse=True))
    return cases


def prefill_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    """Chunks of several query rows (each its own indices row), an empty chunk, and the traps."""
    N, B = spec.attention.sparse_topk, spec.kv_cache.block_size
    short, long_len = 2 * B + max(1, B // 2), N + B + max(1, B // 2)
    all_traps = [("edges",), ("padding",), ("duplicates", "edges"), ("tail_padding",), ("empty",)]
    return [_case("chunk", [long_len], [5], [all_traps[i] for i in range(5)], lse=True),
            _case("shared_prefix", [3 * B + max(1, B // 2), 2 * B + 1], [2, 1], [("edges",)] * 3, share_prefix=True),
            _case("mixed_batch", [short, 3, long_len], [3, 0, 2], [("edges",), ("duplicates",), ("padding",),
                                                                    ("tail_padding",), ("edges",)]),
            _case("padded_pool", [short], [2], [("edges",), ("empty",)], padded=True, lse=True)]


def _run(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    spec, p = kernel.spec, case.params
    args = make_sparse_case(spec, p["seq_lens"], p["q_lens"], rng, p["traps"], p.get("share_prefix", False),
                            p.get("padded", False))
    args.pop("out", None)
    rows = args["q"].shape[0]
    lens = [int(n) for n in (args["indices"] >= 0).sum(axis=1)]  # the keys each row attends
    P = kernel.config.get("partition_size", 0)
    plan = kernel.plan([spec.attention.sparse_topk] * rows, partition_tokens=P) if P and rows else None
    return launch_judged(kernel, case.name, args, lens, rows, plan, bool(p.get("lse")), rng)


def run_decode_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    return _run(kernel, case, rng)


def run_prefill_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    return _run(kernel, case, rng)


def _bench(spec, lens: list[int], q_lens: list[int], rng: np.random.Generator) -> Bench:
    args = make_sparse_case(spec, lens, q_lens, rng)
    args.pop("out", None)
    rows = args["q"].shape[0]
    args["out"] = np.zeros((rows, spec.attention.num_q_heads, spec.v_head_dim_value),
                           dtype=dtype(spec.dtype.resolved_out).numpy)
    counts = [int(n) for n in (args["indices"] >= 0).sum(axis=1)]

    def check(got: dict) -> CaseResult:
        ref, lowp = attention_references(spec, args)
        return check_output("tuning", counts, got["out"], ref.out, lowp.out, spec.dtype.resolved_out,
                            ref.magnitude, ref.logit_magnitude, **head_dims(spec))

    return Bench(args, ["out"], check)


def decode_bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of max(context, top-k) tokens, each row naming top-k of them."""
    N = spec.attention.sparse_topk
    return _bench(spec, [max(bucket[1], N)] * bucket[0], [1] * bucket[0], rng)


def prefill_bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of max(context, top-k) tokens, the last min(context, 64) of them the chunk."""
    N = spec.attention.sparse_topk
    n = max(bucket[1], N)
    return _bench(spec, [n] * bucket[0], [min(bucket[1], 64)] * bucket[0], rng)

