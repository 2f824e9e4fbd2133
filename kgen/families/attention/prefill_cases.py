"""The paged-prefill family's verification matrix and benchmark inputs (docs/verification.md).

The caches are made exactly as for decode (kgen/families/attention/decode_cases.py: shuffled physical
blocks in a pool several times larger than needed, optional shared prefix blocks, strided pools,
poison in every slot past seq_len, every unreferenced block and every unused table entry); each
sequence gets a chunk of q_len query rows at the end of its seq_len tokens. The matrix: chunk
lengths 1, 15, 16, 17, 64 and longer; sharp rows (queries 4x the unit normal); a whole prompt from an empty cache; chunks that start and
end inside blocks; a mixed batch of prefill chunks, single tokens and q_len = 0 sequences (with
the LSE); shared prefixes; padded pools; decode equivalence at q_len = 1; window and partition
edges when the spec or config has them. The output is pre-filled with NaN; each (token, head)
row is judged against attention's one reference and its own derived bound (the rule decode's
rows have, kgen/verify/judge/bounds.py), so a few wrong rows cannot hide behind a large error elsewhere.
"""

from __future__ import annotations

import numpy as np

from kgen.arrays import args_to_backend, to_backend, to_numpy
from kgen.families.attention.decode_cases import every_row, make_decode_case
from kgen.families.attention.reference import Reference, attention_reference, query_rows
from kgen.families.attention.serving import (
    Serving,
    draw_q,
    draw_serving,
    prefill_output,
    serving_prefill_cases,
)
from kgen.families.attention.strata import prefill_joint_cases
from kgen.families.base import Bench, Case, Config
from kgen.formats.dtypes import dtype
from kgen.verify.judge.bounds import check_lse, check_output, head_dims
from kgen.verify.judge.guards import guarded, seal, tripwires
from kgen.verify.judge.report import CaseResult
from kgen.verify.judge.sample import draw_units, per_query_head


def make_prefill_case(spec, seq_lens: list[int], q_lens: list[int], rng: np.random.Generator,
                      share_prefix: bool = False, padded: bool = False, q_gain: float = 1.0,
                      serving: Serving | None = None) -> dict:
    """Keyword arguments for a prefill call (numpy arrays): decode's paged caches for `seq_lens`
    (poisoned, or with `serving` the case's serving look: kgen/families/attention/serving.py),
    q [sum(q_lens), Hq, D] packed by sequence (out [.., Dv]) (q_gain times the unit normal, or the serving look's
    distribution), q_indptr, and out pre-filled with NaN (with `serving`: NaN, zeros or stale
    values per (row, head))."""
    a = spec.attention
    args = make_decode_case(spec, seq_lens, rng, share_prefix=share_prefix, padded=padded, serving=serving)
    T = int(sum(q_lens))
    args["q_indptr"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    shape = (T, a.num_q_heads, a.head_dim)
    q = q_gain * (rng.standard_normal(shape) if serving is None
                  else draw_q(rng, shape, serving.q_dist, serving.q_dists, args["q_indptr"]))
    args["q"] = q.astype(dtype(spec.dtype.q).numpy)
    out_np = dtype(spec.dtype.resolved_out).numpy
    out_shape = (T, a.num_q_heads, spec.v_head_dim_value)
    args["out"] = (np.full(out_shape, np.nan, dtype=out_np) if serving is None
                   else prefill_output(out_shape, out_np, rng))
    return args


# ---- the verification matrix ----------------------------------------------------------------
SHARP_Q_GAIN = 4.0  # the sharp_rows case's queries, times the unit normal
WINDOW_ROW_KEYS = 1 << 20  # rows x window of the window cases (their chunks shrink for very long windows)


def _round_up(n: int, b: int) -> int:
    return max(b, -(-n // b) * b)


def prefill_case_matrix(spec, config: Config, rng: np.random.Generator) -> list[dict]:
    """Every case: name, seq_lens, q_lens and flags (share_prefix, padded, lse)."""
    B = spec.kv_cache.block_size
    inside = B // 2 + 1 if B > 1 else 1  # a prefix ending inside a block
    chunks = {  # name: (prefix tokens already cached, chunk length)
        "chunk_1": (2 * B + 3, 1), "chunk_15": (B + 3, 15), "chunk_16": (inside, 16), "chunk_17": (3, 17),
        "chunk_64": (B + inside, 64), "chunk_150": (37, 150), "whole_prompt": (0, 77),
        "inside_blocks": (inside, max(1, B - 1) if B > 2 else 3), "small_chunk_long_prefix": (600, 16),
    }
    W = spec.attention.sliding_window
    if W:  # chunks longer than the window where rows x window stays affordable; a prefix past it in any case
        cap = max(16, WINDOW_ROW_KEYS // W)
        chunks |= {"window_crossing": (W + 3, min(W + 5, cap)), "window_chunk_W": (W + B + 1, min(W, cap)),
                   "window_from_empty": (0, min(W + B + 1, cap))}
    P = config.get("partition_size", 0)
    if P:
        chunks |= {"partition_edges": (P - 5, P + 10), "split_prefix_3P": (3 * P + 5, 16)}
    cases = []
    for name, (prefix, q_len) in chunks.items():
        n = prefix + q_len
        if not spec.tail_masking:  # the promise: every seq_len a multiple of B (the chunk still ends anywhere)
            n = _round_up(n, B)
        cases.append({"name": name, "seq_lens": [n], "q_lens": [q_len]})
    # Sharp rows: queries 4x the unit normal (logits ~N(0, 16)), where an error in the logits (such as
    # that of K rounded to q's type after dequantization) outweighs the rounding of P a kernel may make;
    # with the LSE, which such an error moves by far more than its fp32 bound.
    n = B + inside + 40 if spec.tail_masking else _round_up(B + inside + 40, B)
    cases.append({"name": "sharp_rows", "seq_lens": [n], "q_lens": [40], "q_gain": SHARP_Q_GAIN, "lse": True})

    # one launch: prefill chunks, single tokens (decode rows) and sequences without query rows
    mixed = [(50, 20), (33, 1), (0, 0), (90, 90), (17, 1), (40, 0), (2 * B + 1, B + 1)]
    mixed += [(int(n), int(rng.integers(0, n + 1))) for n in rng.integers(1, 200, size=3)]
    if not spec.tail_masking:
        mixed = [(_round_up(n, B) if n else 0, q) for n, q in mixed]
    order = rng.permutation(len(mixed))
    cases.append({"name": "mixed_batch", "seq_lens": [mixed[i][0] for i in order],
                  "q_lens": [mixed[i][1] for i in order], "lse": True})
    a, b = 3 * B + max(1, B // 2), 2 * B + 1
    if not spec.tail_masking:
        a, b = 3 * B, 2 * B
    cases.append({"name": "shared_prefix", "seq_lens": [a, b], "q_lens": [min(5, a), b], "share_prefix": True})
    pad = [2 * B + 1, max(1, B // 2)] if spec.tail_masking else [2 * B, B]
    cases.append({"name": "padded_pool", "seq_lens": pad, "q_lens": [B + 1, pad[1]], "padded": True})
    lens = [1, B - 1, B, B + 1, 2 * B + 1, max(5 * B + 3, 300)]
    if not spec.tail_masking:
        lens = [_round_up(n, B) for n in lens]
    lens = sorted({n for n in lens if n >= 1})
    cases.append({"name": "decode_equivalence", "seq_lens": lens, "q_lens": [1] * len(lens), "lse": True})
    return cases


def matrix_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    """The matrix of prefill_case_matrix with its serving looks (served_matrix), then the serving cases."""
    cases = served_matrix(spec, config, rng)
    serving = serving_prefill_cases(spec, rng) + prefill_joint_cases(spec, rng)
    return cases + [Case(name, {"name": name, **p}, list(p["seq_lens"])) for name, p in serving]


def served_matrix(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    """The matrix of prefill_case_matrix, each case with its serving look drawn from `rng`
    (kgen/families/attention/serving.py; sharp_rows keeps its unit-normal queries)."""
    cases = []
    for c in prefill_case_matrix(spec, config, rng):
        look = draw_serving(rng)
        if "q_gain" in c:
            look.q_dist = "normal"
        cases.append(Case(c["name"], {**c, "serving": look}, list(c["seq_lens"])))
    return cases


def references(spec, args: dict, units: np.ndarray | None = None) -> tuple[Reference, Reference]:
    """The float64 reference of one call (with its error magnitudes) and the same attention in
    the kernel's input precision: attention's one reference (kgen/families/attention/reference.py),
    of the sampled (row, KV head) `units` only, when given."""
    round_to = None if spec.dtype.q == "fp32" else dtype(spec.dtype.q).numpy
    return attention_reference(spec, args["q"], args, units=units), attention_reference(
        spec, args["q"], args, dtype=np.float32, round_to=round_to, magnitudes=False, units=units)


def check(name: str, spec, args: dict, out, ref: Reference, lowp: Reference, lse=None,
          judged: np.ndarray | None = None) -> list[CaseResult]:
    """The output (and the LSE when given) of one call, each (query row, head) within attention's
    one derived bound (kgen/verify/judge/bounds.py); only the `judged` rows, when given."""
    lens, ind = list(np.asarray(args["seq_lens"]).tolist()), args["q_indptr"]
    results = [check_output(name, lens, to_numpy(out), ref.out, lowp.out, spec.dtype.resolved_out, ref.magnitude,
                            ref.logit_magnitude, q_indptr=ind, **head_dims(spec), judged=judged)]
    if lse is not None:
        results.append(check_lse(name + "_lse", lens, to_numpy(lse), ref.lse, lowp.lse, ref.logit_magnitude,
                                 spec.attention.head_dim, q_indptr=ind, judged=judged))
    return results


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    """One prefill case: inputs sealed, out (and the LSE and split scratch of a serving case)
    pre-filled inside guards, every (query row, head) within its bound (a sampled case's sample,
    and every row's cheap checks: kgen/verify/judge/sample.py). A case with `steps` is that many
    consecutive launches (chunked-prefill steps: every sequence `q_len` tokens longer each time,
    new queries, new outputs), each checked; the first failing one is the verdict."""
    spec, p = kernel.spec, case.params
    steps = p.get("steps", 0)
    if not steps:
        return launch_case(kernel, case, _inputs(spec, p, p["seq_lens"], rng), rng)
    B = spec.kv_cache.block_size
    incs = [q if spec.tail_masking else B for q in p["q_lens"]]  # tokens a step adds (the contract's multiples)
    last = [n + (steps - 1) * d for n, d in zip(p["seq_lens"], incs, strict=True)]
    args = _inputs(spec, p, last, rng)  # the pool of the last step; earlier steps read less of it
    results: list[CaseResult] = []
    for k in range(steps):
        lens = [n + k * d for n, d in zip(p["seq_lens"], incs, strict=True)]
        step = dict(args, seq_lens=np.asarray(lens, dtype=np.int32))
        step["q"] = draw_q(rng, args["q"].shape, p["serving"].q_dist, p["serving"].q_dists,
                           args["q_indptr"]).astype(args["q"].dtype)
        step["out"] = prefill_output(args["out"].shape, args["out"].dtype, rng)
        results = launch_case(kernel, Case(case.name, p, lens), step, rng)
        for r in results:
            r.note = f"step {k + 1} of {steps}" + (f"; {r.note}" if r.note else "")
        if not all(r.passed for r in results):
            break
    return results


def _inputs(spec, p: dict, seq_lens: list[int], rng: np.random.Generator) -> dict:
    return make_prefill_case(spec, seq_lens, p["q_lens"], rng, share_prefix=p.get("share_prefix", False),
                             padded=p.get("padded", False), q_gain=p.get("q_gain", 1.0), serving=p.get("serving"))


def launch_case(kernel, case: Case, args: dict, rng: np.random.Generator) -> list[CaseResult]:
    """One call of a case on its host `args` (out among them; dense and mla prefill), judged:
    out (and LSE, split scratch) inside guards, the inputs sealed, a split config planned with
    partitions of exactly its partition_size."""
    spec, p = kernel.spec, case.params
    serving, want_lse, sampled = p.get("serving"), p.get("lse", False), p.get("sample", False)
    if not sampled:  # a sampled case's reference is drawn after the call
        ref, lowp = references(spec, args)
    # Split configs run with partitions of exactly partition_size, so the partition cases sit on
    # partition boundaries (a call without a plan may choose a larger multiple).
    P = kernel.config.get("partition_size", 0)
    plan = kernel.plan(args["seq_lens"], q_indptr=args["q_indptr"], partition_tokens=P) if P else None
    T, Hq = args["q"].shape[:2]
    out = args.pop("out")
    buffers = [guarded("out", out.shape, out.dtype, rng, content=out)]
    if want_lse:  # a serving case's LSE and split scratch pre-filled like out: NaN, zeros or stale values
        buffers.append(guarded("lse", (T, Hq), np.float32, rng, content=None if serving is None
                               else prefill_output((T, Hq), np.float32, rng, stale_mean=4.0)))
    parts = plan.sizes["max_partitions"] if plan is not None else 1
    if serving is not None and parts > 1 and T:
        for name, width, mean in (("part_o", spec.v_head_dim_value, 0.0), ("part_ml", 2, 2.0)):
            shape = (T, Hq, parts, width)
            buffers.append(guarded(name, shape, np.float32, rng, content=prefill_output(shape, np.float32, rng, mean)))
    seals = [seal(n, x) for n, x in args.items() if isinstance(x, np.ndarray)]
    given = args_to_backend(args, kernel.backend)
    outputs = {g.name: to_backend(g.view, kernel.backend) for g in buffers}
    # a sampled case's every-row check needs the pre-fill (on the CPU backend the kernel writes g.view)
    before = {g.name: g.view.copy() for g in buffers} if sampled else {}
    kernel(**given, **outputs, plan=plan)
    lse = outputs.get("lse")
    if not sampled:
        results = check(case.name, spec, args, outputs["out"], ref, lowp, lse)
    else:
        ind = np.asarray(args["q_indptr"], dtype=np.int64)
        row_seq = np.repeat(np.arange(ind.size - 1), np.diff(ind))
        _, pos = query_rows(args)
        units = draw_units(rng, row_seq, pos + 1, spec.attention.num_kv_heads, spec.group_size)
        ref, lowp = references(spec, args, units)
        results = check(case.name, spec, args, outputs["out"], ref, lowp, lse, per_query_head(units, spec.group_size))
        every_row(spec, results, outputs, before, args, row_seq)
    tripwires(results[0], {g.name: g for g in buffers}, seals, {**given, **outputs})
    return results


# ---- the tuner's benchmark inputs -----------------------------------------------------------
BENCH_CHUNK = 512  # query rows per sequence when the context is longer (a chunked prefill)


def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of `context` tokens each, the last min(context, BENCH_CHUNK) of them the
    chunk being prefilled; the timed launches' output is checked like a case."""
    batch, context = bucket
    if not spec.tail_masking:
        context = _round_up(context, spec.kv_cache.block_size)
    lens, q_lens = [context] * batch, [min(context, BENCH_CHUNK)] * batch
    args = make_prefill_case(spec, lens, q_lens, rng)

    def check_bench(got: dict) -> CaseResult:
        ref, lowp = references(spec, args)
        return check("tuning", spec, args, got["out"], ref, lowp)[0]

    return Bench(args, ["out"], check_bench)
