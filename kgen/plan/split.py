"""Call-time split-KV planning for both attention kinds (docs/decode-family.md, "Planning").

A decode call has one thread block per (KV head, sequence, partition). Without a split a
batch of few sequences leaves most of the GPU idle (batch 1 with 8 KV heads: 8 blocks on
132 SMs), so the plan cuts each sequence's keys into partitions of `partition_tokens`:
the largest multiple of 16 tokens, at least the config's `partition_size` (the granule),
whose thread blocks with work reach the plan's target (kgen.plan.target_blocks: a quarter
of the blocks the GPU holds at once, at least 2 per SM).
A latency-bound kernel streams at the rate of the bytes it has in flight, so too few blocks
leave bandwidth unused; each further partition costs its partial results and the merge.
One size for every sequence also balances a batch of very different lengths: no block gets
more than `partition_tokens` keys, a long sequence gets many blocks and a short one a single
block.

Prefill (choose_prefill_split: dense prefill, kgen/families/attention/prefill.py, and mla
prefill, mla.py) plans with the same rule: each (sequence, KV head, partition) there is one block
per tile of query rows (`weights`), and a chunk's first row sees from `seq_len - q_len - window + 1`
(a per-sequence `window`); the size is then evened into whole waves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kgen.errors import ArgumentError

STEP_TOKENS = 16  # partition sizes are multiples of this (whole tiles of kgen's decode kernel)


@dataclass(frozen=True)
class Split:
    partition_tokens: int  # keys per partition (0: no split, every sequence in one block)
    max_partitions: int  # partitions of the longest sequence: grid z

    @property
    def merged(self) -> bool:
        """True when partials are written and a merge kernel combines them."""
        return self.max_partitions > 1


def working_partitions(seq_lens: np.ndarray, partition_tokens: int, window, weights=None) -> int:
    """Partitions over all sequences that hold at least one key the query sees (`window`: one for
    all or one per sequence), each counted `weights[s]` times (default once)."""
    lens = seq_lens.astype(np.int64)
    last = -(-lens // partition_tokens)
    first = np.maximum(lens - window, 0) // partition_tokens if np.any(window) else np.zeros_like(lens)
    return int(np.sum((last - first) * (1 if weights is None else np.asarray(weights, dtype=np.int64))))


def check_forced_partition(partition_tokens: int | None, granule: int) -> None:
    """A partition size given to kern.plan: a multiple of STEP_TOKENS of at least the granule."""
    if partition_tokens is None:
        return
    if not granule:
        raise ArgumentError(f"partition_tokens {partition_tokens}: this config never splits (partition_size 0)")
    if partition_tokens < granule or partition_tokens % STEP_TOKENS:
        raise ArgumentError(f"partition_tokens {partition_tokens}: must be a multiple of {STEP_TOKENS} of at least "
                            f"the config's partition_size {granule}")


def choose_split(seq_lens: np.ndarray, num_kv_heads: int, target: int, granule: int, window=0,
                 partition_tokens: int | None = None, weights=None) -> Split:
    """The partition size for these lengths: partitions of at least `granule` tokens (0: the config
    never splits) giving `target` blocks with work (kgen.plan.target_blocks).
    `partition_tokens` forces a size (a positive multiple of the granule); `window` and `weights`
    as in working_partitions."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    longest = int(lens.max()) if lens.size else 0
    if not granule or longest <= 0:
        return Split(0, 1)
    if partition_tokens is None:
        partition_tokens = _fill_size(lens, longest, num_kv_heads, target, granule, window, weights)
    if partition_tokens >= longest:
        return Split(0, 1)
    return Split(partition_tokens, -(-longest // partition_tokens))


def _fill_size(lens: np.ndarray, longest: int, num_kv_heads: int, target_blocks: int, granule: int, window,
               weights) -> int:
    """The largest partition, a multiple of STEP_TOKENS of at least `granule`, whose blocks with work
    reach `target_blocks` (the granule when even it does not; the whole length when the (KV head,
    sequence) blocks alone do)."""
    if num_kv_heads * (lens.size if weights is None else int(np.sum(weights))) >= target_blocks:
        return longest  # enough blocks without a split

    def blocks(k: int) -> int:
        return num_kv_heads * working_partitions(lens, k * STEP_TOKENS, window, weights)

    lo, hi = -(-granule // STEP_TOKENS), max(-(-granule // STEP_TOKENS), -(-longest // STEP_TOKENS))
    if blocks(lo) < target_blocks:
        return granule
    while lo < hi:  # blocks fall as the partition grows: the largest k that still reaches the target
        mid = (lo + hi + 1) // 2
        if blocks(mid) >= target_blocks:
            lo = mid
        else:
            hi = mid - 1
    return max(granule, lo * STEP_TOKENS)


def whole_waves(split: Split, lens: np.ndarray, num_kv_heads: int, target: int, granule: int, window,
                weights) -> Split:
    """Prefill's split in whole waves of `target` blocks: a block's time is about its keys, so a
    launch takes about (waves of blocks) x (keys per partition). choose_split reaches the target
    with the largest partition, which can leave a few blocks for a second wave (a 256-token chunk
    over 32K keys: 8 row tiles x 8 KV heads x 5 partitions = 320 blocks on 264 slots); of 1 to 2 x
    its partitions, the count with the least waves x partition (then the fewest) is taken."""
    longest = int(lens.max())
    best = None
    for parts in range(1, 2 * split.max_partitions + 1):
        size = max(granule, -(-longest // (parts * STEP_TOKENS)) * STEP_TOKENS)
        blocks = num_kv_heads * working_partitions(lens, size, window, weights)
        cost = -(-blocks // max(1, target)) * min(size, longest)
        if best is None or cost < best[0]:
            best = (cost, size)
    size = best[1]
    return Split(0, 1) if size >= longest else Split(size, -(-longest // size))


def choose_prefill_split(seq_lens: np.ndarray, q_lens: np.ndarray, heads: int, weights, target: int, granule: int,
                         window: int = 0, partition_tokens: int | None = None) -> Split:
    """A prefill call's split (dense and mla): sequences without query rows launch no work;
    `heads` blocks per (sequence, partition) for each of its `weights[s]` tiles of query rows; a
    chunk's first row sees from `seq_len - q_len - window + 1` (`window` 0: from key 0); an
    automatic size is then evened into whole waves (whole_waves)."""
    check_forced_partition(partition_tokens, granule)
    live = np.where(q_lens > 0, seq_lens, 0)
    wins = q_lens + window - 1 if window else 0
    split = choose_split(live, heads, target, granule, wins, partition_tokens, weights)
    if partition_tokens is None and split.merged:
        split = whole_waves(split, live, heads, target, granule, wins, weights)
    return split
