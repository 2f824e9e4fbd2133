"""The verification matrix of mla decode (docs/verification.md, docs/mla.md): the decode matrix's
lengths around block (and partition) boundaries, a mixed batch, a shared prefix and a padded pool,
each with a serving look drawn from the run's seed (kgen/families/attention/serving.py). The pools
come from decode's generator (make_decode_case: shuffled blocks, poison or stale values in every
unread slot and block), whose one K store is the latent pool; out, LSE and the split scratch are
pre-filled inside guard bytes and every (sequence, head) is judged against the float64 reference
with its own derived bound (kgen/verify/judge/bounds.py)."""

from __future__ import annotations

import numpy as np

from kgen.arrays import to_backend
from kgen.families.attention.decode_cases import (
    attention_references,
    checked_bench,
    judge_outputs,
    make_decode_case,
    padded_rows_lengths,
    padded_strided,
)
from kgen.families.attention.prefill_cases import (
    check,
    launch_case,
    make_prefill_case,
    references,
    served_matrix,
)
from kgen.families.attention.serving import draw_serving, prefill_output
from kgen.families.base import Bench, Case, Config
from kgen.formats import ds_mla
from kgen.formats.cache import CacheFormat
from kgen.formats.dtypes import dtype
from kgen.verify.judge.guards import Guarded, guarded, seal
from kgen.verify.judge.report import CaseResult


def case_lengths(spec, config: Config, rng: np.random.Generator) -> list[tuple[str, list[int], bool]]:
    """(name, seq_lens, share_prefix) of every case."""
    B = spec.kv_cache.block_size
    long_len = max(4 * B + 3, 200)
    lens = {"len_1": 1, "len_B-1": B - 1, "len_B": B, "len_B+1": B + 1, "len_2B+1": 2 * B + 1, "long": long_len}
    P = config.get("partition_size", 0)
    if P:
        lens |= {"len_P-1": P - 1, "len_P+1": P + 1, "len_3P+5": 3 * P + 5}
    if not spec.tail_masking:  # the contract: every length a multiple of B
        lens = {f"{k}(rounded)": max(B, -(-v // B) * B) for k, v in lens.items()}
    cases = [(name, [n], False) for name, n in lens.items() if n >= 1]
    mixed = sorted({int(x) for x in rng.integers(1, long_len + 1, size=4)} | {1, B + 1})
    if not spec.tail_masking:
        mixed = sorted({max(B, -(-n // B) * B) for n in mixed})
    rng.shuffle(mixed)
    cases.append(("mixed_batch", [int(x) for x in mixed], False))
    shared = [3 * B + max(1, B // 2), 2 * B + 1] if spec.tail_masking else [3 * B, 2 * B]
    cases.append(("shared_prefix", shared, True))
    cases.append(("padded_pool", [2 * B + 1, max(1, B // 2)] if spec.tail_masking else [2 * B, B], False))
    cases.append(("padded_rows", padded_rows_lengths(spec), False))  # seq_len 0 rows: zeros, reading nothing
    return cases


def matrix_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    return [Case(name, {"seq_lens": lens, "share_prefix": share, "serving": draw_serving(rng),
                        "lse": name in ("mixed_batch", "len_B+1"), **({"kgen_only": True} if name == "padded_rows" else {})},
                 list(lens))
            for name, lens, share in case_lengths(spec, config, rng)]


def make_mla_case(spec, seq_lens: list[int], rng: np.random.Generator, share_prefix: bool = False,
                  padded: bool = False, serving=None) -> dict:
    """Host arguments of one decode call (without out): decode's generator with the latent pool as
    its K store; `padded` passes the pool as a view with gaps between tokens and blocks."""
    args = make_decode_case(spec, seq_lens, rng, share_prefix=share_prefix, serving=serving)
    args.pop("out")
    return _latent_pool(spec, args, padded)


def _latent_pool(spec, args: dict, padded: bool) -> dict:
    """The generator's K scales become kv_scale (V's are the same rows'); `padded`: the pool (and a
    per-token scale pool) as views with gaps between blocks and tokens."""
    if "k_scale" in args:
        args["kv_scale"] = args.pop("k_scale")
        args.pop("v_scale")
    if padded:
        f = CacheFormat.of(spec)  # fp8_ds_mla's gaps: e4m3 NaN bytes (0x7F), 16 of them keep rows 16-byte aligned
        args["kv_cache"] = padded_strided(args["kv_cache"], (0, 1, 16), ds_mla.POISON_BYTES["latent"] if f.ds_mla else np.nan)
        if CacheFormat.of(spec).per_token:
            args["kv_scale"] = padded_strided(np.ascontiguousarray(args["kv_scale"]), (0, 1), np.nan)
    return args


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    spec, p = kernel.spec, case.params
    args = make_mla_case(spec, p["seq_lens"], rng, share_prefix=p["share_prefix"], padded=case.name == "padded_pool",
                         serving=p["serving"])
    return _launch(kernel, case, args, rng)


def _launch(kernel, case: Case, args: dict, rng: np.random.Generator) -> list[CaseResult]:
    lens = [int(n) for n in args["seq_lens"]]
    P = kernel.config.get("partition_size", 0)
    plan = kernel.plan(lens, partition_tokens=P) if P else None
    return launch_judged(kernel, case.name, args, lens, len(lens), plan, bool(case.params.get("lse")), rng)


def launch_judged(kernel, name: str, args: dict, lens: list[int], rows: int, plan, lse: bool,
                  rng: np.random.Generator) -> list[CaseResult]:
    """One call of `kernel` on the host arguments `args` (without out) into guarded outputs of `rows`
    query rows: out, lse when `lse`, and the split-KV partials when `plan` has more than one partition;
    judged row by row against the reference (`lens`: the keys each row attends), with the tripwires of
    the guarded buffers and the sealed inputs."""
    spec = kernel.spec
    Hq, Dv = spec.attention.num_q_heads, spec.v_head_dim_value
    ref, lowp = attention_references(spec, args)

    def buffer(bname, shape, np_dtype, stale_mean=0.0) -> Guarded:
        return guarded(bname, shape, np_dtype, rng, content=prefill_output(shape, np_dtype, rng, stale_mean))

    buffers = [buffer("out", (rows, Hq, Dv), dtype(spec.dtype.resolved_out).numpy)]
    if lse:
        buffers.append(buffer("lse", (rows, Hq), np.float32, stale_mean=4.0))
    parts = plan.sizes["max_partitions"] if plan is not None else 1
    if parts > 1:
        buffers += [buffer("part_o", (rows, Hq, parts, Dv), np.float32),
                    buffer("part_ml", (rows, Hq, parts, 2), np.float32, stale_mean=2.0)]
    seals = [seal(n, x) for n, x in args.items() if isinstance(x, np.ndarray)]
    given = {n: to_backend(x, kernel.backend) for n, x in args.items()}
    outputs = {g.name: to_backend(g.view, kernel.backend) for g in buffers}
    kernel(**given, **outputs, plan=plan)
    return judge_outputs(spec, name, lens, outputs, ref, lowp, buffers, seals, given)


def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of `context` tokens each; the timed launches' output is checked like a case."""
    lens = [bucket[1]] * bucket[0]
    return checked_bench(spec, lens, make_mla_case(spec, lens, rng))


# ---- prefill ----------------------------------------------------------------------------------
def prefill_matrix_cases(spec, config: Config, rng: np.random.Generator) -> list[Case]:
    """Prefill's matrix (kgen/families/attention/prefill_cases.py: chunks at and inside block edges,
    a whole prompt, a long prefix, sharp rows, a mixed batch with empty chunks, a shared prefix, a
    padded pool, decode rows), each with a serving look."""
    return served_matrix(spec, config, rng)


def make_mla_prefill_case(spec, seq_lens: list[int], q_lens: list[int], rng: np.random.Generator,
                          share_prefix: bool = False, padded: bool = False, q_gain: float = 1.0,
                          serving=None) -> dict:
    """Prefill's generator on the latent pool, with out at v_head_dim (pre-filled like prefill's)."""
    args = _latent_pool(spec, make_prefill_case(spec, seq_lens, q_lens, rng, share_prefix=share_prefix, q_gain=q_gain,
                                                serving=serving), padded)
    shape = (args["q"].shape[0], spec.attention.num_q_heads, spec.v_head_dim_value)
    out_np = dtype(spec.dtype.resolved_out).numpy
    args["out"] = np.full(shape, np.nan, dtype=out_np) if serving is None else prefill_output(shape, out_np, rng)
    return args


def run_prefill_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    """One prefill case on the latent pool, launched and judged as dense prefill's (guards, seals,
    the LSE, and a split config's plan and scratch: prefill_cases.launch_case)."""
    spec, p = kernel.spec, case.params
    args = make_mla_prefill_case(spec, p["seq_lens"], p["q_lens"], rng, share_prefix=p.get("share_prefix", False),
                                 padded=p.get("padded", False), q_gain=p.get("q_gain", 1.0), serving=p.get("serving"))
    return launch_case(kernel, case, args, rng)


def prefill_bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """`batch` sequences of `context` tokens, the last min(context, 512) of them the chunk."""
    batch, context = bucket
    q_lens = [min(context, 512)] * batch
    args = make_mla_prefill_case(spec, [context] * batch, q_lens, rng)

    def check_bench(got: dict) -> CaseResult:
        ref, lowp = references(spec, args)
        return check("tuning", spec, args, got["out"], ref, lowp)[0]

    return Bench(args, ["out"], check_bench)
