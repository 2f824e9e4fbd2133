"""Inputs a kernel cannot tell from serving (docs/verification.md, section 3.1).

A kernel that behaves only while it is watched passes any fixed test, so every attention case
draws from its run's seed what a serving engine's calls vary in:

- what unread cache slots hold (`Fill`): NaN poison, stale K/V of other sequences (a freed
  block keeps its old contents), plausible fresh values, or a mix chosen per block;
- the block table: spare columns past the longest sequence (none, one, a few or many, as an
  engine that sizes its table for the longest context allows), what unused entries hold (0 as
  vLLM pads, random blocks, the last used block repeated), pools with more or fewer free blocks;
- prefixes shared as a block manager shares them: full blocks of one prompt shared by two,
  three or many sequences (parallel sampling, a common system prompt);
- queries drawn like real activations: normal, heavy-tailed, with outlier channels, or wide
  (|q| well above 8);
- `out`, the LSE and the split-KV scratch pre-filled per (row, head) with NaN, zeros or stale
  values, so neither an unwritten element nor a kernel that reads its output before writing
  it can tell a test from a call;
- serving-shaped batches: up to the largest batch the tuner plans for, length mixes drawn from
  a long-tailed distribution, prefill chunks of 256+ rows in one launch with decode rows, and a
  run of many consecutive launches (decode and chunked-prefill steps) in one process. The joint
  shapes of (batch size, length mix) are a fixed design of their own (kgen/families/attention/strata.py).

Nothing here is fixed from run to run except through the seed, which the report prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

FILLS = ("nan", "stale", "plausible", "mixed")
PADDINGS = ("zero", "unused", "any", "repeat")
Q_DISTS = ("normal", "heavy", "outliers", "wide")
MAX_BATCH = 256  # the largest batch the tuner plans for (kgen/tune/search.py GPU_BUCKETS)


@dataclass
class Serving:
    """How one case's inputs look: see the module docstring."""

    fill: str = "nan"  # unread slots and unused blocks: one of FILLS
    padding: str = "unused"  # unused block-table entries: one of PADDINGS
    spare_cols: int = 1  # block-table columns past the longest sequence
    pool_spare: float | None = None  # free blocks in the pool per block in use (None: 2 per block, plus 2)
    q_dist: str = "normal"  # one of Q_DISTS
    groups: list[tuple[list[int], int]] = field(default_factory=list)  # (sequences, shared full blocks)
    # per sequence, where a stratum assigns them (kgen/families/attention/strata.py); None: the case's own
    q_dists: list[str] | None = None  # each sequence's query distribution (its rows in prefill)
    fills: list[str] | None = None  # the filler of each sequence's tail slots (unused blocks: `fill`)
    paddings: list[str] | None = None  # the padding of each table row


def draw_serving(rng: np.random.Generator, groups: list[tuple[list[int], int]] | None = None,
                 fill: str | None = None) -> Serving:
    """A case's serving look, drawn from `rng`."""
    spare = int(rng.choice([0, 1, 2, 3, 5, 8, 16, 64], p=[0.3, 0.15, 0.15, 0.1, 0.1, 0.08, 0.07, 0.05]))
    return Serving(fill=fill or str(rng.choice(FILLS, p=[0.15, 0.2, 0.15, 0.5])),
                   padding=str(rng.choice(PADDINGS, p=[0.4, 0.2, 0.2, 0.2])), spare_cols=spare,
                   pool_spare=float(rng.uniform(0.1, 2.0)), q_dist=str(rng.choice(Q_DISTS)),
                   groups=groups or [])


# ---- queries ----------------------------------------------------------------------------------
def draw_q(rng: np.random.Generator, shape: tuple[int, ...], dist: str, per_seq: list[str] | None = None,
           indptr=None) -> np.ndarray:
    """Queries [rows, Hq, D] like real activations: all rows from `dist`, or with `per_seq` the rows
    of sequence i (row i, or rows indptr[i] .. indptr[i+1] - 1) from per_seq[i]."""
    if per_seq is not None:
        bounds = indptr if indptr is not None else np.arange(len(per_seq) + 1)
        parts = [draw_q(rng, (int(bounds[i + 1] - bounds[i]), *shape[1:]), d) for i, d in enumerate(per_seq)]
        return np.concatenate(parts) if parts else np.zeros(shape)
    if dist == "heavy":  # Student t with 3 degrees of freedom, scaled to unit spread
        return np.clip(rng.standard_t(3, size=shape) / math.sqrt(3.0), -40.0, 40.0)
    if dist == "outliers":  # a few channels, the same in every row and head, of magnitude 8..20
        q = rng.standard_normal(shape)
        D = shape[-1]
        channels = rng.choice(D, size=max(1, D // 64), replace=False)
        q[..., channels] += rng.choice([-1.0, 1.0], size=len(channels)) * rng.uniform(8.0, 20.0, size=len(channels))
        return q
    if dist == "wide":  # N(0, s), s in 2.5..4: |q| past 8 in most rows
        return rng.standard_normal(shape) * rng.uniform(2.5, 4.0)
    return rng.standard_normal(shape)


# ---- outputs and scratch ------------------------------------------------------------------------
def prefill_output(shape: tuple[int, ...], np_dtype, rng: np.random.Generator, stale_mean: float = 0.0) -> np.ndarray:
    """An output or scratch buffer's contents before the call: per (row, head) NaN, zeros or stale values."""
    out = np.empty(shape, dtype=np_dtype)
    if not out.size:
        return out
    lead = shape[:2] if len(shape) >= 2 else shape
    choice = rng.integers(0, 3, size=lead)
    out[choice == 0] = np.nan
    out[choice == 1] = 0
    stale = choice == 2  # values drawn only where they are kept (split scratch of a long batch is large)
    out[stale] = (stale_mean + rng.standard_normal((int(stale.sum()), *shape[len(lead):]), dtype=np.float32)
                  ).astype(np_dtype)
    return out


# ---- block tables -------------------------------------------------------------------------------
def share_map(seq_lens: list[int], B: int, groups: list[tuple[list[int], int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(sequence, table column) -> the (sequence, column) whose physical block it shares: full blocks
    of a group's first sequence, as far as both sequences cover them."""
    shared = {}
    for members, blocks in groups:
        first = members[0]
        for m in members[1:]:
            for j in range(min(blocks, seq_lens[first] // B, seq_lens[m] // B)):
                shared[(m, j)] = (first, j)
    return shared


def pad_table(tables: np.ndarray, nblocks: list[int], used: list[int], unused: list[int], N: int,
              padding: str | list[str], rng: np.random.Generator) -> None:
    """Fill the entries past each sequence's blocks (never read) as `padding` says (one for the
    table, or one per row)."""
    M = tables.shape[1]
    rows = [padding] * len(nblocks) if isinstance(padding, str) else padding
    for i, nb in enumerate(nblocks):
        if nb >= M:
            continue
        how = rows[i]
        if how == "zero":
            tables[i, nb:] = 0
        elif how == "repeat":
            tables[i, nb:] = tables[i, nb - 1] if nb else 0
        elif how == "any":
            tables[i, nb:] = rng.integers(0, N, size=M - nb)
        else:
            tables[i, nb:] = rng.choice(unused or used or [0], size=M - nb)


# ---- serving-shaped batches ---------------------------------------------------------------------
def context_lengths(rng: np.random.Generator, count: int, budget: int, median: float = 60.0, cap: int = 3000) -> list[int]:
    """`count` lengths from a long-tailed (log-normal) mix, scaled down to at most `budget` tokens in all."""
    lens = np.clip(np.rint(rng.lognormal(math.log(median), 1.1, size=count)), 1, cap)
    if lens.sum() > budget:
        lens = np.maximum(1, np.floor(lens * budget / lens.sum()))
    return [int(n) for n in lens]


def prefix_groups(rng: np.random.Generator, seq_lens: list[int], B: int, min_ways: int = 3) -> list[tuple[list[int], int]]:
    """Prefix sharing as a block manager makes it: one group of `min_ways` or more sequences sharing
    a system prompt's full blocks, and a few pairs or triples (parallel sampling) sharing theirs;
    lengths of the members are raised so they cover the shared blocks."""
    S = len(seq_lens)
    order = [int(i) for i in rng.permutation(S)]
    groups = []
    if S >= min_ways:
        size = int(rng.integers(min_ways, max(min_ways, min(S, 12)) + 1))
        members, order = order[:size], order[size:]
        blocks = int(rng.integers(1, 5))
        for m in members:
            seq_lens[m] = max(seq_lens[m], blocks * B + int(rng.integers(0, 2 * B)))
        groups.append((members, blocks))
    while len(order) >= 2 and rng.random() < 0.8:
        size = min(len(order), int(rng.integers(2, 4)))
        members, order = order[:size], order[size:]
        blocks = int(rng.integers(1, 4))
        for m in members:
            seq_lens[m] = max(seq_lens[m], blocks * B + int(rng.integers(0, B)))
        groups.append((members, blocks))
    return groups


def round_lengths(spec, lens: list[int]) -> list[int]:
    """Lengths as the spec's contract allows them (tail_masking: false: multiples of block_size)."""
    B = spec.kv_cache.block_size
    return lens if spec.tail_masking else [max(B, -(-n // B) * B) if n else 0 for n in lens]


def _looks(rng: np.random.Generator, count: int) -> list[dict]:
    """`count` case looks in which every filler, padding and query distribution appears at least
    once (when count allows): each drawn as a random permutation, the rest at random."""
    def spread(values):
        order = [str(v) for v in rng.permutation(values)]
        return [order[i] if i < len(order) else str(rng.choice(values)) for i in range(count)]
    fills, pads, qs = spread(FILLS), spread(PADDINGS), spread(Q_DISTS)
    return [{"fill": f, "padding": p, "q_dist": q} for f, p, q in zip(fills, pads, qs, strict=True)]


def _serving(rng: np.random.Generator, look: dict, groups) -> Serving:
    s = draw_serving(rng, groups, fill=look["fill"])
    s.padding, s.q_dist = look["padding"], look["q_dist"]
    if s.padding == "zero":
        s.spare_cols = max(1, s.spare_cols)  # zero padding shows in every row
    return s


def serving_decode_cases(spec, rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(name, params) of decode's serving cases: a large batch (10 .. MAX_BATCH sequences, the
    largest sometimes), a small one, a prefix tree (sequences sharing a prompt three ways and more),
    and a run of consecutive decode steps in one process (each launch checked)."""
    B = spec.kv_cache.block_size
    looks = _looks(rng, 4)  # for serving_batch, serving_small, serving_prefix_tree, serving_steps
    for i in (1, 3):  # zero padding (vLLM's) where many rows show it: the batch of 10+ sequences
        if looks[i]["padding"] == "zero":
            looks[0]["padding"], looks[i]["padding"] = looks[i]["padding"], looks[0]["padding"]
    S = MAX_BATCH if rng.random() < 0.25 else int(np.exp(rng.uniform(math.log(10), math.log(MAX_BATCH))))
    big = context_lengths(rng, S, budget=6000)
    small = context_lengths(rng, int(rng.integers(2, 10)), budget=3000, median=150)
    tree = context_lengths(rng, int(rng.integers(4, 25)), budget=4000, median=80)
    steps_lens = context_lengths(rng, int(rng.integers(1, 4)), budget=240, median=30, cap=120)
    cases = []
    for name, lens, look, ways in (("serving_batch", big, looks[0], 3), ("serving_small", small, looks[1], 3),
                                   ("serving_prefix_tree", tree, looks[2], 4)):
        groups = prefix_groups(rng, lens, B, ways)
        cases.append((name, {"seq_lens": round_lengths(spec, lens), "serving": _serving(rng, look, groups),
                             **({"sample": True} if name == "serving_batch" else {})}))
    steps = int(rng.integers(24, 41))
    groups = prefix_groups(rng, steps_lens, B, 3)
    cases.append(("serving_steps", {"seq_lens": round_lengths(spec, steps_lens), "steps": steps,
                                    "serving": _serving(rng, looks[3], groups)}))
    return cases


PREFILL_BATCH = (128, 160)  # sequences of prefill's serving_batch: a chunked-prefill step's batch


def serving_prefill_cases(spec, rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(name, params) of prefill's serving cases: a large batch of decode rows and small chunks
    (PREFILL_BATCH sequences, judged on a sample), one launch where a chunk of 256+ rows meets
    decode rows, and a run of consecutive launches (chunked-prefill steps)."""
    B = spec.kv_cache.block_size
    looks = _looks(rng, 3)
    cases = []
    S = int(rng.integers(PREFILL_BATCH[0], PREFILL_BATCH[1] + 1))
    ctx = context_lengths(rng, S, budget=24 * S, median=16, cap=64)
    q_lens = [1 if rng.random() < 0.8 else int(rng.integers(0, 17)) for _ in range(S)]
    lens = [max(c, q) for c, q in zip(ctx, q_lens, strict=True)]
    groups = prefix_groups(rng, lens, B, 3)
    cases.append(("serving_batch", {"seq_lens": lens, "q_lens": q_lens, "sample": True}, looks[0], groups))
    # Many decode rows with short contexts beside one chunk of 256+ rows (the CPU backend runs such a
    # chunk of the single-pass ABI launch for tens of seconds; the decode rows cost little)
    S = int(rng.integers(8, 25))
    ctx = context_lengths(rng, S, budget=400, median=20, cap=48)
    q_lens = [1] * S
    q_lens[0] = int(rng.integers(256, 265))  # the long chunk, from an empty cache or after a short prefix
    q_lens[1] = int(rng.integers(2, 17))
    lens = [c + (q if q > 1 else 0) for c, q in zip(ctx, q_lens, strict=True)]
    lens[0] = q_lens[0] + (0 if rng.random() < 0.5 else int(rng.integers(1, 2 * B + 1)))
    groups = prefix_groups(rng, lens, B, 3)
    order = [int(i) for i in rng.permutation(S)]
    where = {old: new for new, old in enumerate(order)}
    groups = [([where[m] for m in members], blocks) for members, blocks in groups]
    lens, q_lens = [lens[i] for i in order], [q_lens[i] for i in order]
    cases.append(("serving_long_chunk", {"seq_lens": lens, "q_lens": q_lens}, looks[1], groups))
    # consecutive launches in one process: a prompt prefilled chunk by chunk beside decode rows, every
    # sequence longer each step (kgen/families/attention/prefill_cases.py run_case)
    S = int(rng.integers(1, 3))  # small: the CPU backend runs a prefill launch for a tenth of a second or more
    ctx = context_lengths(rng, S, budget=80, median=20, cap=40)
    q_lens = [int(rng.integers(2, 7))] + [1] * (S - 1)
    lens = [int(rng.integers(0, B + 1)) + q_lens[0]] + ctx[1:]
    groups = prefix_groups(rng, lens, B, 3)
    cases.append(("serving_steps", {"seq_lens": lens, "q_lens": q_lens, "steps": int(rng.integers(24, 41))},
                  looks[2], groups))
    out = []
    for name, params, look, groups in cases:
        lens = params["seq_lens"]
        if not spec.tail_masking:
            lens = round_lengths(spec, lens)
        out.append((name, {**params, "seq_lens": lens, "lse": True, "serving": _serving(rng, look, groups)}))
    return out
