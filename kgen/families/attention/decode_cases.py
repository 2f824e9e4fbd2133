"""The paged-decode family's verification matrix and benchmark inputs (docs/verification.md).

Random inputs follow the spec's ABI with the traps of the matrix: physical blocks shuffled
over a pool several times larger than needed, optional prefix blocks shared between two
sequences, and poison (NaN, or extreme values for int8) in every tail slot, every
unreferenced block and every unused table entry. The adversarial cases
(kgen/families/attention/adversarial_cases.py) add large logits, contexts of >= 4,096 and
>= 32,768 tokens, strided q and out, and a pool past 2^32 elements; batch sizes, lengths and
tables come from the run's seed.

Around every call: each input is sealed (kgen/verify/judge/guards.py), out, the LSE and the split-KV
scratch are pre-filled with NaN inside guard bytes, and afterwards every (sequence, head) of
the output (and of the LSE where the case asks for it) is judged against the float64
reference (kgen/families/attention/reference.py) with its own derived bound (kgen/verify/judge/bounds.py).
"""

from __future__ import annotations

import math

import numpy as np

from kgen.arrays import to_backend, to_numpy
from kgen.families.attention import case_pools
from kgen.families.attention.adversarial_cases import (
    ADVERSARIAL,
    adversarial_cases,
    build_pool_case,
    huge_pool_bytes,
    poison,
)
from kgen.families.attention.reference import Reference, attention_reference, value_hull
from kgen.families.attention.serving import (
    Serving,
    draw_q,
    draw_serving,
    pad_table,
    prefill_output,
    serving_decode_cases,
    share_map,
)
from kgen.families.attention.strata import decode_joint_cases
from kgen.families.base import Bench, Case, Config
from kgen.formats.cache import CacheFormat, block_scale_copy, scale_to_layout, to_layout
from kgen.formats.dtypes import dtype, ml_dtypes
from kgen.verify.judge.bounds import check_lse, check_output, head_dims
from kgen.verify.judge.guards import Guarded, guarded, seal, tripwires
from kgen.verify.judge.report import CaseResult
from kgen.verify.judge.sample import check_every_row, draw_units, per_query_head
from kgen.verify.judge.sparse import byte_ranges, sparse_to_backend

POOL_FACTOR = 3  # pool blocks per block in use


def fill_unread(store: np.ndarray, vstore: np.ndarray, unread: list[tuple[int, int]], used: list[int], B: int,
                spread: float, fill: str | list[str], rng: np.random.Generator) -> list[tuple[int, int]]:
    """Fill the unread regions (block, first unread slot) of the canonical K and V stores: NaN poison
    stays; 'stale' copies slots of blocks in use (what a freed sequence leaves), 'plausible' draws
    fresh values; 'mixed' picks one of the three per region (`fill`: one for every region, or one
    per region). Returns the regions given values."""
    filled = []
    for r, (blk, first) in enumerate(unread):
        how = fill if isinstance(fill, str) else fill[r]
        how = str(rng.choice(("nan", "stale", "plausible"))) if how == "mixed" else how
        if how == "nan" or first >= B:
            continue
        n = B - first
        src = [b for b in used if b != blk]  # other blocks' slots (a lone block: plausible values instead)
        if how == "stale" and src:
            blocks, slots = rng.choice(src, size=n), rng.integers(0, B, size=n)
            store[blk, first:], vstore[blk, first:] = store[blocks, slots], vstore[blocks, slots]
            # a stale slot of a block in use may be one of its own unread ones: draw those afresh
            # (K's and V's own masks: their head dims may differ; both stores poison the same slots)
            for x in (store, vstore):
                bad = ~np.isfinite(x[blk, first:])
                x[blk, first:][bad] = rng.standard_normal(int(bad.sum())) * spread
        else:
            store[blk, first:] = rng.standard_normal(store[blk, first:].shape) * spread
            vstore[blk, first:] = rng.standard_normal(vstore[blk, first:].shape) * spread
        filled.append((blk, first))
    return filled


def cast_values(values: np.ndarray, name: str) -> np.ndarray:
    d = dtype(name).numpy
    if name == "int8":
        return np.clip(np.rint(values), -127, 127).astype(np.int8)
    if name.startswith("fp8"):
        limit = float(ml_dtypes().finfo(d).max)
        return np.clip(values, -limit, limit).astype(d)
    return values.astype(d)


def padded_strided(arr: np.ndarray, extra: tuple[int, ...], fill: float) -> np.ndarray:
    """`arr` copied into a poisoned, larger array and returned as a view of it: a pool whose
    strides are not the packed ones (padding between blocks, heads, tokens or K and V)."""
    big = np.empty(tuple(n + e for n, e in zip(arr.shape, extra, strict=True)), dtype=arr.dtype)
    big[...] = np.asarray(fill).astype(arr.dtype)
    view = big[tuple(slice(0, n) for n in arr.shape)]
    view[...] = arr
    return view


def _pool_padding(spec) -> dict[str, tuple[int, ...]]:
    """Extra elements per axis for each cache array of a padded pool. K and V get different
    padding (a kernel that steps V with K's strides fails); the head_dim axis grows by whole
    16-byte vectors, so the strides stay as aligned as the vector loads need."""
    kv = spec.kv_cache
    v16 = 16 // dtype(kv.dtype).storage_bytes
    if CacheFormat.of(spec).block_scaled:  # block-scale rows keep their copies' alignment too
        fc = block_scale_copy(spec.attention.head_dim)
        return {"k_cache": (0, 1, 1, v16), "v_cache": (0, 2, 0, 2 * v16), "k_scale": (0, 1, 1, fc),
                "v_scale": (0, 2, 0, 2 * fc)}
    if CacheFormat.of(spec).vllm:  # K [N, H, D/x, B, x]; V [N, H, D, B], loaded along B: rows grow by whole vectors
        return {"k_cache": (0, 1, 1, 1, 0), "v_cache": (0, 1, 0, v16)}
    if CacheFormat.of(spec).fused:  # [N, 2, ...]: a gap between the K and V halves too
        return {"kv_cache": (0, 1, 1, 1, v16)}
    return {"k_cache": (0, 1, 1, v16), "v_cache": (0, 2, 0, 2 * v16) if not CacheFormat.of(spec).token_major
            else (0, 0, 2, 2 * v16)}


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's geometric slopes 2^(-8 i / n)."""
    return np.asarray([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], dtype=np.float32)


SINK_RANGE = (-5.0, 30.0)  # sink logits of the cases: from barely counting to outweighing every key
SINK_CONTEST = (-1.0, 8.0)  # where a sink's weight is comparable to the keys' (a wrong sink term shows)


def sink_logits(num_heads: int, rng: np.random.Generator) -> np.ndarray:
    """Per-head sink logits spread over SINK_RANGE: both ends (with 3+ heads), then alternately one
    in SINK_CONTEST and one anywhere in the range; in a random head order."""
    ends = list(SINK_RANGE) if num_heads >= 3 else []
    rest = [rng.uniform(*(SINK_CONTEST if i % 2 == 0 else SINK_RANGE)) for i in range(num_heads - len(ends))]
    return rng.permutation(np.asarray(ends + rest, dtype=np.float32))


def make_decode_case(spec, seq_lens: list[int], rng: np.random.Generator, share_prefix: bool = False,
                     extra_table_cols: int = 1, padded: bool = False, serving: Serving | None = None) -> dict:
    """Keyword arguments for a decode call (numpy arrays) plus out pre-filled with NaN.
    With `padded` the cache pools (and per-token scales) are strided views into larger arrays.
    Without `serving`: NaN in every unread slot, one spare table column, unused blocks as padding and
    sequences 0 and 1 sharing their common full blocks when `share_prefix`; with it, the case's
    serving look (kgen/families/attention/serving.py: fillers, table shape and padding, prefix
    groups, query distribution)."""
    a, kv = spec.attention, spec.kv_cache
    B, H, D, Hq = kv.block_size, a.num_kv_heads, a.head_dim, a.num_q_heads
    DV = spec.v_head_dim_value  # V's and out's width
    S = len(seq_lens)
    if serving is None:
        serving = Serving(spare_cols=extra_table_cols, groups=[([0, 1], 1 << 30)] if share_prefix and S >= 2 else [])
    elif share_prefix and S >= 2 and not serving.groups:
        serving.groups = [([0, 1], 1 << 30)]
    nblocks = [math.ceil(n / B) for n in seq_lens]
    M = max(nblocks) + serving.spare_cols
    shared = share_map(seq_lens, B, serving.groups)
    needed = sum(nblocks) - len(shared)
    N = POOL_FACTOR * needed + 2 if serving.pool_spare is None else needed + max(2, int(needed * serving.pool_spare))
    perm = rng.permutation(N)
    tables = np.zeros((S, max(M, 1)), dtype=np.int32)
    nxt = 0
    for i, nb in enumerate(nblocks):
        for j in range(nb):
            if (i, j) not in shared:
                tables[i, j] = perm[nxt]
                nxt += 1
    for (i, j), (src, col) in shared.items():  # then the shared ones: the group's first sequence's blocks
        tables[i, j] = tables[src, col]
    used, unused = [int(b) for b in perm[:nxt]], [int(b) for b in perm[nxt:]]
    pad_table(tables, nblocks, used, unused, N, serving.paddings or serving.padding, rng)  # never-read entries

    # canonical storage [N, B, H, D] (V: [N, B, H, DV]) of stored values, poison everywhere first
    store = np.full((N, B, H, D), poison(kv.dtype), dtype=np.float64)
    vstore = np.full((N, B, H, DV), poison(kv.dtype), dtype=np.float64)
    quant = CacheFormat.of(spec).quantized
    spread = 100.0 if kv.dtype == "int8" else (3.0 if quant else 1.0)
    for i, n in enumerate(seq_lens):
        for j in range(nblocks[i]):
            if (i, j) in shared:
                continue  # written by the group's first sequence: shared prefix tokens are identical
            blk, count = int(tables[i, j]), min(B, n - j * B)
            # drawn head-major, as [H, count, D]: the same random stream for every layout
            store[blk, :count] = (rng.standard_normal((H, count, D)) * spread).transpose(1, 0, 2)
            vstore[blk, :count] = (rng.standard_normal((H, count, DV)) * spread).transpose(1, 0, 2)
    # unread slots: the tails of last blocks and the blocks no sequence uses, filled as the case says
    tails = [i for i, nb in enumerate(nblocks) if nb and seq_lens[i] % B]
    unread = [(int(tables[i, nblocks[i] - 1]), seq_lens[i] - (nblocks[i] - 1) * B) for i in tails]
    unread += [(b, 0) for b in unused]
    fills = serving.fill if serving.fills is None else \
        [serving.fills[i] for i in tails] + [serving.fill] * len(unused)  # a stratum's: per sequence's tail
    filled = fill_unread(store, vstore, unread, used, B, spread, fills, rng)
    fp4 = CacheFormat.of(spec).block_scaled
    if CacheFormat.of(spec).ds_mla:  # quantized rows with tile scales of their own; NaN rows read as NaN
        args = {"kv_cache": case_pools.latent_pool(store, rng)}
    elif fp4:  # stored through the reference quantizer; NaN rows become garbage bytes and NaN scales
        tensor = case_pools.tensor_scales((4.5 * spread, 4.5 * spread), rng)
        args = {**case_pools.layout_pools(spec, store, vstore, tensor, rng), **tensor}
    else:
        args = to_layout(spec, cast_values(store, kv.dtype), cast_values(vstore, kv.dtype))

    if padded:
        for name, extra in _pool_padding(spec).items():
            fill = (case_pools.NAN_SCALES[0] if name.endswith("scale") else case_pools.PAD_BYTE) if fp4 \
                else poison(kv.dtype)
            args[name] = padded_strided(args[name], extra, fill)

    if quant and not fp4:
        for name in ("k_scale", "v_scale"):
            base = (0.01 if kv.dtype == "int8" else 0.5) * (1.0 if name == "k_scale" else 1.7)
            if kv.scale == "per_tensor":
                args[name] = np.asarray(base * rng.uniform(0.5, 1.5), dtype=np.float32).reshape(())
            elif kv.scale == "per_head":
                args[name] = (base * rng.uniform(0.5, 1.5, H)).astype(np.float32)
            else:
                pool = np.full((N, B, H), np.nan, dtype=np.float32)
                for blk, first in filled:  # unread slots holding values have scales too
                    pool[blk, first:] = base * rng.uniform(0.5, 1.5, (B - first, H))
                for i, n in enumerate(seq_lens):
                    for j in range(nblocks[i]):
                        count = min(B, n - j * B)
                        pool[int(tables[i, j]), :count] = (base * rng.uniform(0.5, 1.5, (H, count))).T
                args[name] = np.ascontiguousarray(scale_to_layout(spec, pool))
                if padded:
                    args[name] = padded_strided(args[name], (0, 1, 1), np.nan)
    if a.alibi:
        args["alibi_slopes"] = alibi_slopes(Hq)
    args["q"] = cast_values(draw_q(rng, (S, Hq, D), serving.q_dist, serving.q_dists), spec.dtype.q)
    if a.sinks:  # drawn after q: the random stream of a spec without sinks is unchanged
        args["sinks"] = sink_logits(Hq, rng)
    args["block_tables"] = tables
    args["seq_lens"] = np.asarray(seq_lens, dtype=np.int32)
    args["out"] = np.full((S, Hq, DV), np.nan, dtype=dtype(spec.dtype.resolved_out).numpy)
    return args


def padded_rows_lengths(spec) -> list[int]:
    """A decode batch padded as CUDA graphs pad it: real sequences with rows of seq_len 0 between
    and after them (docs/abi.md: a padded row reads nothing and writes zeros)."""
    B = spec.kv_cache.block_size
    a, b = (B + 1, 2 * B + max(1, B // 2)) if spec.tail_masking else (B, 2 * B)
    return [a, 0, b, 0]


# ---- the verification matrix ----------------------------------------------------------------
def decode_case_matrix(spec, config: Config, rng: np.random.Generator) -> list[tuple[str, list[int], bool]]:
    """(name, seq_lens, share_prefix) for every case of the matrix: the classic cases, then the
    adversarial ones (kgen/families/attention/adversarial_cases.py); the case named 'padded_pool'
    passes the caches as strided views (see make_decode_case)."""
    B = spec.kv_cache.block_size
    long_len = max(5 * B + 3, 300)
    lens = {"len_1": 1, "len_B-1": B - 1, "len_B": B, "len_B+1": B + 1, "len_2B+1": 2 * B + 1, "long": long_len}
    P = config.get("partition_size", 0)
    if P:
        lens |= {"len_P-1": P - 1, "len_P": P, "len_P+1": P + 1, "len_2P+1": 2 * P + 1}
    W = spec.attention.sliding_window
    if W:
        lens |= {"len_W-1": W - 1, "len_W": W, "len_W+1": W + 1, "len_W+2B+1": W + 2 * B + 1}
    if not spec.tail_masking:  # the contract: every length a multiple of B
        lens = {f"{k}(rounded)": max(B, -(-v // B) * B) for k, v in lens.items()}
    cases = [(name, [n], False) for name, n in lens.items() if n >= 1]
    mixed = sorted({n for _, (n,), _ in cases} | {int(x) for x in rng.integers(1, long_len + 1, size=3)})
    if not spec.tail_masking:
        mixed = sorted({max(B, -(-n // B) * B) for n in mixed})
    rng.shuffle(mixed)
    cases.append(("mixed_batch", [int(x) for x in mixed], False))
    a, b = 3 * B + max(1, B // 2), 2 * B + 1
    if not spec.tail_masking:
        a, b = 3 * B, 2 * B
    cases.append(("shared_prefix", [a, b], True))
    pad = [2 * B + 1, max(1, B // 2)] if spec.tail_masking else [2 * B, B]
    cases.append(("padded_pool", pad, False))  # strided pools: padding between blocks, heads, K and V
    cases.append(("padded_rows", padded_rows_lengths(spec), False))  # seq_len 0 rows: zeros, reading nothing
    cases += [(name, lens, False) for name, lens in adversarial_cases(spec, rng)]
    return cases


def matrix_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    """The matrix of decode_case_matrix, each classic case with its serving look drawn from `rng`
    (kgen/families/attention/serving.py), then the serving cases."""
    cases = []
    for name, lens, share in decode_case_matrix(spec, config, rng):
        params = {"seq_lens": lens, "share_prefix": share, **ADVERSARIAL.get(name, {}),
                  **({"kgen_only": True} if name == "padded_rows" else {})}
        if "profile" not in params:
            params["serving"] = draw_serving(rng)
        cases.append(Case(name, params, list(lens)))
    serving = serving_decode_cases(spec, rng) + decode_joint_cases(spec, rng)
    return cases + [Case(name, params, list(params["seq_lens"])) for name, params in serving]


def attention_references(spec, args: dict, units: np.ndarray | None = None) -> tuple[Reference, Reference]:
    """The float64 reference of one call and the same attention in the kernel's input precision
    (of the sampled (row, KV head) `units` only, when given)."""
    round_to = None if spec.dtype.q == "fp32" else dtype(spec.dtype.q).numpy
    return attention_reference(spec, args["q"], args, units=units), attention_reference(
        spec, args["q"], args, dtype=np.float32, round_to=round_to, magnitudes=False, units=units)


def _case_inputs(spec, case: Case, rng: np.random.Generator) -> tuple[dict, dict]:
    """(host arguments without out, written element ranges of sparse arrays) of one case."""
    p, lens = case.params, case.params["seq_lens"]
    if "profile" in p:
        built = build_pool_case(spec, lens, rng, p["profile"], huge=p.get("huge", False))
        args, sparse = built.args, built.sparse
    else:
        args = make_decode_case(spec, lens, rng, share_prefix=p.get("share_prefix", False),
                                padded=case.name == "padded_pool", serving=p.get("serving"))
        args.pop("out")
        sparse = {}
    if p.get("strided"):  # q as a view with gaps between heads and sequences (poison in them)
        v16 = max(1, 16 // args["q"].itemsize)
        args["q"] = padded_strided(args["q"], (1, 1, v16), np.nan)
    if spec.attention.alibi:
        args.setdefault("alibi_slopes", alibi_slopes(spec.attention.num_q_heads))
    if spec.attention.sinks:  # the adversarial pools (build_pool_case) have none yet
        args.setdefault("sinks", sink_logits(spec.attention.num_q_heads, rng))
    return args, sparse


def _outputs(spec, case: Case, args: dict, plan, rng: np.random.Generator) -> list[Guarded]:
    """out (strided for a strided case), the LSE when the case checks it, and the plan's split-KV
    scratch: each pre-filled per (row, head) with NaN, zeros or stale values inside guard bytes."""
    S, Hq, D = len(args["seq_lens"]), args["q"].shape[1], spec.v_head_dim_value  # out's width: V's
    out_np = dtype(spec.dtype.resolved_out).numpy
    pad = (1, 2, max(1, 16 // out_np.itemsize)) if case.params.get("strided") else None

    def buffer(name, shape, np_dtype, stale_mean=0.0, pad=None):
        return guarded(name, shape, np_dtype, rng, pad=pad, content=prefill_output(shape, np_dtype, rng, stale_mean))

    buffers = [buffer("out", (S, Hq, D), out_np, pad=pad)]
    if case.params.get("lse") or case.name in ("mixed_batch", "serving_batch", "serving_steps"):
        buffers.append(buffer("lse", (S, Hq), np.float32, stale_mean=4.0))
    parts = plan.sizes["max_partitions"] if plan is not None else 1
    if parts > 1:
        buffers += [buffer("part_o", (S, Hq, parts, D), np.float32),
                    buffer("part_ml", (S, Hq, parts, 2), np.float32, stale_mean=2.0)]
    return buffers


def case_device_bytes(spec, case: Case) -> int:
    """huge_pool's pools are allocated whole on the device (docs/verification.md); the other
    cases take megabytes."""
    return huge_pool_bytes(spec) if case.params.get("huge") else 0


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    """One decode case: inputs sealed, outputs and scratch poisoned inside guards, every
    (sequence, head) of the output (and of the LSE when requested) within its own bound. A case
    with `steps` is that many consecutive launches (decode steps: every sequence one token longer
    each time, new queries, new outputs), each checked; the first failing one is the verdict."""
    spec, name, lens = kernel.spec, case.name, case.params["seq_lens"]
    steps = case.params.get("steps", 0)
    if not steps:
        args, sparse = _case_inputs(spec, case, rng)
        return _launch(kernel, case, args, sparse, rng)
    inc = 1 if spec.tail_masking else spec.kv_cache.block_size  # tokens a step adds (the contract's multiples)
    final = Case(name, {**case.params, "seq_lens": [n + (steps - 1) * inc for n in lens]}, case.sizes)
    args, sparse = _case_inputs(spec, final, rng)  # the pool of the last step; earlier steps read less of it
    S, Hq, D = args["q"].shape
    results: list[CaseResult] = []
    for k in range(steps):
        step = dict(args, seq_lens=np.asarray([n + k * inc for n in lens], dtype=np.int32))
        look = case.params["serving"]
        step["q"] = cast_values(draw_q(rng, (S, Hq, D), look.q_dist, look.q_dists), spec.dtype.q)
        results = _launch(kernel, Case(name, case.params, list(step["seq_lens"].tolist())), step, sparse, rng)
        for r in results:
            r.note = f"step {k + 1} of {steps}" + (f"; {r.note}" if r.note else "")
        if not all(r.passed for r in results):
            break
    return results


def _launch(kernel, case: Case, args: dict, sparse: dict, rng: np.random.Generator) -> list[CaseResult]:
    spec, name = kernel.spec, case.name
    lens = [int(n) for n in args["seq_lens"]]
    sampled = case.params.get("sample", False)  # the reference of a sample, drawn after the call
    if not sampled:
        ref, lowp = attention_references(spec, args)
    # Split configs run with partitions of exactly partition_size, so the len_P cases sit on
    # partition boundaries (a call without a plan may choose a larger multiple).
    P = kernel.config.get("partition_size", 0)
    plan = kernel.plan(lens, partition_tokens=P) if P else None
    buffers = _outputs(spec, case, args, plan, rng)
    seals = [seal(n, x, byte_ranges(x, sparse[n]) if n in sparse else None)
             for n, x in args.items() if isinstance(x, np.ndarray)]
    given = {n: sparse_to_backend(x, sparse[n], kernel.backend) if n in sparse else to_backend(x, kernel.backend)
             for n, x in args.items()}
    outputs = {g.name: to_backend(g.view, kernel.backend) for g in buffers}
    # a sampled case's every-row check needs the pre-fill (on the CPU backend the kernel writes g.view)
    before = {g.name: g.view.copy() for g in buffers} if sampled else {}
    kernel(**given, **outputs, plan=plan)
    if not sampled:
        return judge_outputs(spec, name, lens, outputs, ref, lowp, buffers, seals, given)
    units = draw_units(rng, np.arange(len(lens)), lens, spec.attention.num_kv_heads, spec.group_size)
    ref, lowp = attention_references(spec, args, units)
    results = judge_outputs(spec, name, lens, outputs, ref, lowp, buffers, seals, given,
                            per_query_head(units, spec.group_size))
    every_row(spec, results, outputs, before, args, np.arange(len(lens)))
    return results


def every_row(spec, results: list[CaseResult], outputs: dict, before: dict, args: dict, row_seq: np.ndarray) -> None:
    """A sampled case's checks of every row (kgen/verify/judge/sample.py): finite, written, and out
    within the V values it averages; charged to the out row (the LSE's to the lse row)."""
    lo, hi = value_hull(spec, args)
    types = (spec.dtype.q, spec.dtype.resolved_out)
    check_every_row(results[0], "out", to_numpy(outputs["out"]), before["out"], row_seq, lo, hi, spec.group_size,
                    types)
    if "lse" in outputs and len(results) > 1:
        check_every_row(results[1], "lse", to_numpy(outputs["lse"]), before["lse"], row_seq)


def judge_outputs(spec, name: str, lens: list[int], outputs: dict, ref, lowp, buffers, seals, given,
                  judged: np.ndarray | None = None) -> list[CaseResult]:
    """One row per sequence's out (and lse when the call wrote it) against the reference (the
    `judged` rows only, when given), with the tripwires of the guarded buffers and sealed inputs
    charged to the out row."""
    result = check_output(name, lens, to_numpy(outputs["out"]), ref.out, lowp.out, spec.dtype.resolved_out,
                          ref.magnitude, ref.logit_magnitude, **head_dims(spec), judged=judged)
    results = [result]
    if "lse" in outputs:
        results.append(check_lse(f"{name}_lse", lens, to_numpy(outputs["lse"]), ref.lse, lowp.lse,
                                 ref.logit_magnitude, spec.attention.head_dim, judged=judged))
    tripwires(result, {g.name: g for g in buffers}, seals, {**given, **outputs})
    return results


# ---- the tuner's benchmark inputs -----------------------------------------------------------
def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of `context` tokens each; the timed launches' output is checked like a case."""
    lens = [bucket[1]] * bucket[0]
    return checked_bench(spec, lens, make_decode_case(spec, lens, rng))


def checked_bench(spec, lens: list[int], args: dict) -> Bench:
    """The tuner's benchmark of one-row-per-sequence `args` (`lens`: their lengths): the timed launches'
    out checked against the reference like a case's."""

    def check(got: dict) -> CaseResult:
        ref, lowp = attention_references(spec, args)
        return check_output("tuning", lens, got["out"], ref.out, lowp.out, spec.dtype.resolved_out,
                            ref.magnitude, ref.logit_magnitude, **head_dims(spec))

    return Bench(args, ["out"], check)
