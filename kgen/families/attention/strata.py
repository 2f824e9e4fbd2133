"""The joint shapes of serving batches, as a fixed design (docs/verification.md, section 3.2).

A serving draw that couples batch size and context length (big batches of short sequences, long
sequences in small batches) never shows a kernel a busy server's batch: dozens of long
conversations at once. Here the joint space of (batch size, length mix) is cut into strata and
every stratum is a case of every run; only what lies inside a stratum is drawn from the seed:

- `serving_large_long`: a large batch (10 .. 12 sequences) in which every sequence is long
  (past ALL_LONG tokens), four past LONG;
- `serving_long_small`: a small batch (2 .. 3) in which every sequence is long, one past LONG;
- `serving_one_long`: one very long sequence (past VERY_LONG) among many (16 .. 32) short ones;
- `serving_one_short`: the reverse, one short sequence among long ones (3 .. 5 in all).

The serving features are assigned per sequence inside a stratum, each value on a sequence of
its own (`_per_seq`): the query distribution, the filler of the sequence's tail slots and the
padding of its table row; the table has spare columns (`serving_large_long`: 8 or more, a padded
table) and prefixes are shared three ways and more. So every feature meets a long context
(`serving_large_long`'s four sequences past LONG) and a large batch in every run, whatever the
seed; `coverage` lists the (feature, stratum) cells a case list holds, and the tests hold every
seed to it.
"""

from __future__ import annotations

import numpy as np

from kgen.families.attention.serving import (
    FILLS,
    PADDINGS,
    Q_DISTS,
    Serving,
    context_lengths,
    prefix_groups,
    round_lengths,
)

ALL_LONG = 700  # every sequence of an all-long batch is past this many tokens
LONG = 1024  # a long context: the features must meet sequences past this
VERY_LONG = 4096  # the longest sequence of the large-and-long and one-long batches is past this
LARGE = 10  # a large batch
TAIL_FILLS = tuple(f for f in FILLS if f != "mixed")  # a tail holds one of these ("mixed" is per block)
LENGTH_BANDS = (("1-255", 1, 255), ("256-1023", 256, 1023), ("1024-4095", 1024, 4095), ("4096+", 4096, 1 << 62))
BATCH_BANDS = (("1", 1, 1), ("2-9", 2, 9), ("10-63", 10, 63), ("64+", 64, 1 << 62))


def _per_seq(rng: np.random.Generator, values, positions: list[int], count: int) -> list[str]:
    """One value per sequence: every value on one of `positions` (which must be at least as many),
    the other sequences a random value."""
    out = [str(rng.choice(values)) for _ in range(count)]
    for value, i in zip(rng.permutation(values), rng.permutation(positions), strict=False):
        out[int(i)] = str(value)
    return out


def _with_tail(n: int, B: int) -> int:
    """A length that ends inside a block, so the sequence's tail filler is there to be read."""
    return n + 1 if B > 1 and n % B == 0 else n


def _look(rng: np.random.Generator, S: int, positions: list[int], spare_cols: int, groups) -> Serving:
    """A stratum's look: per-sequence queries, tail fillers and row padding, each value on one of
    `positions`; the unused blocks mixed."""
    # free blocks: up to half as many as in use (a pool is generated and fingerprinted whole: its size is
    # what a long batch's inputs cost)
    return Serving(fill="mixed", padding="unused", spare_cols=spare_cols, pool_spare=float(rng.uniform(0.1, 0.5)),
                   q_dist="normal", groups=groups, q_dists=_per_seq(rng, Q_DISTS, positions, S),
                   fills=_per_seq(rng, TAIL_FILLS, positions, S), paddings=_per_seq(rng, PADDINGS, positions, S))


def joint_strata(B: int, rng: np.random.Generator) -> list[tuple[str, list[int], list[int], Serving]]:
    """(name, seq_lens, feature positions, look) of every stratum (the module docstring); lengths
    before the spec's rounding (tail_masking: false), the looks' prefix groups drawn."""
    strata = []
    # a large batch, every sequence long: four past LONG (where the features meet long contexts), the
    # rest just past ALL_LONG (the least that makes it all-long; the very long sequence of a large
    # batch is serving_one_long's: on the CPU backend a prefill launch over 4,096 keys takes seconds)
    S = int(rng.integers(LARGE, LARGE + 3))
    lens = [LONG + int(rng.integers(1, 129)) for _ in range(4)]
    lens += [ALL_LONG + int(rng.integers(1, 129)) for _ in range(S - 4)]
    strata.append(("serving_large_long", lens, [0, 1, 2, 3], int(rng.choice([8, 16, 64]))))
    # a small batch, every sequence long, one past LONG
    S = int(rng.integers(2, 4))
    lens = [LONG + int(rng.integers(1, 129))] + [ALL_LONG + int(rng.integers(1, 401)) for _ in range(S - 1)]
    strata.append(("serving_long_small", lens, list(range(S)), int(rng.choice([2, 3, 5]))))
    # one very long sequence among many short ones (a large batch)
    S = int(rng.integers(16, 33))
    short = context_lengths(rng, S - 1, budget=40 * S, median=20.0, cap=64)
    strata.append(("serving_one_long", [VERY_LONG + int(rng.integers(1, 2 * B + 1))] + short,
                   list(range(1, S)), 0))
    # the reverse: one short sequence among long ones
    S = int(rng.integers(3, 6))
    lens = [int(rng.integers(1, max(2, B) + 1))] + [ALL_LONG + int(rng.integers(1, 201)) for _ in range(S - 1)]
    strata.append(("serving_one_short", lens, list(range(S)), int(rng.choice([1, 8, 16]))))
    out = []
    for name, lens, positions, spare in strata:
        lens = [_with_tail(n, B) for n in lens]
        order = [int(i) for i in rng.permutation(len(lens))]  # the long one anywhere in the batch
        where = {old: new for new, old in enumerate(order)}
        lens = [lens[i] for i in order]
        positions = sorted(where[p] for p in positions)
        groups = prefix_groups(rng, lens, B, 3)
        out.append((name, lens, positions, _look(rng, len(lens), positions, spare, groups)))
    return out


# ---- what a case list covers ------------------------------------------------------------------
def band(n: int, bands) -> str:
    return next(name for name, lo, hi in bands if lo <= n <= hi)


def sequence_features(lens: list[int], look: Serving, B: int) -> list[set[str]]:
    """The serving features each sequence of a case shows: its query distribution, its tail's
    filler (when it has a tail), its row's padding (when the row has entries past its blocks), a
    shared prefix, a padded table (8 or more spare columns)."""
    nblocks = [-(-n // B) for n in lens]
    M = max(nblocks, default=0) + look.spare_cols
    shared = {m for members, _ in look.groups for m in members if len(members) >= 2}
    feats = []
    for i, n in enumerate(lens):
        f = {f"q:{look.q_dists[i] if look.q_dists else look.q_dist}"}
        fill = look.fills[i] if look.fills else look.fill
        if n % B and fill != "mixed":
            f.add(f"fill:{fill}")
        if M > nblocks[i]:
            f.add(f"padding:{look.paddings[i] if look.paddings else look.padding}")
        if i in shared:
            f.add("prefix:shared")
        if look.spare_cols >= 8:
            f.add("table:padded")
        feats.append(f)
    return feats


def coverage(cases: list[tuple[str, list[int], Serving]], B: int) -> dict[str, set[str]]:
    """For each (feature, stratum) cell, the cases that hold it: a feature on a sequence past LONG
    tokens ("long"), in a batch of LARGE or more ("large"); and each length band in a large batch
    ("band:<b>", "large"). Keys are "<feature>@<stratum>"."""
    cells: dict[str, set[str]] = {}
    for name, lens, look in cases:
        large = len(lens) >= LARGE
        for n, feats in zip(lens, sequence_features(lens, look, B), strict=True):
            strata = (["long"] if n >= LONG else []) + (["large"] if large else [])
            for f in feats | {f"band:{band(n, LENGTH_BANDS)}"}:
                for s in strata:
                    cells.setdefault(f"{f}@{s}", set()).add(name)
    return cells


def required_cells(tail_masking: bool = True) -> set[str]:
    """The cells every run must hold (fillers show only where tails exist: tail_masking)."""
    feats = [f"q:{q}" for q in Q_DISTS] + [f"padding:{p}" for p in PADDINGS] + ["prefix:shared", "table:padded"]
    feats += [f"fill:{f}" for f in TAIL_FILLS] if tail_masking else []
    cells = {f"{f}@{s}" for f in feats for s in ("long", "large")}
    return cells | {f"band:{name}@large" for name, _, _ in LENGTH_BANDS}


def shape_table(cases: list[tuple[str, list[int]]]) -> dict[tuple[str, str], set[str]]:
    """(batch band, length band) -> the cases with a sequence there: the joint distribution drawn."""
    table: dict[tuple[str, str], set[str]] = {}
    for name, lens in cases:
        b = band(len(lens), BATCH_BANDS)
        for n in lens:
            if n >= 1:
                table.setdefault((b, band(n, LENGTH_BANDS)), set()).add(name)
    return table


# ---- the cases ---------------------------------------------------------------------------------
def decode_joint_cases(spec, rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(name, params) of decode's strata: judged on a sample (kgen/verify/judge/sample.py), LSE too."""
    return [(name, {"seq_lens": round_lengths(spec, lens), "serving": look, "lse": True, "sample": True})
            for name, lens, _, look in joint_strata(spec.kv_cache.block_size, rng)]


def prefill_joint_cases(spec, rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(name, params) of prefill's strata: the same batches, each sequence's last tokens its query
    rows as a chunked-prefill step has them: decode rows (one token), a chunk of 8 .. 32 rows at the
    end of the longest context, a few chunks of 2 .. 8 rows, and a short prompt (up to 16 tokens)
    whole. Short chunks: the CPU backend's prefill runs every 16 query rows of a sequence as a tile."""
    cases = []
    for name, lens, _, look in joint_strata(spec.kv_cache.block_size, rng):
        lens = round_lengths(spec, lens)
        q_lens = [int(rng.integers(2, min(n, 8) + 1)) if n >= 2 and rng.random() < 0.2 else 1 for n in lens]
        q_lens[int(np.argmax(lens))] = int(rng.integers(8, 33))
        if name == "serving_one_short":  # the short one a whole prompt from an empty cache, where it fits
            short = int(np.argmin(lens))
            q_lens[short] = min(lens[short], 16)
        cases.append((name, {"seq_lens": lens, "q_lens": q_lens, "serving": look, "lse": True, "sample": True}))
    return cases
