"""Call-time split-KV planning for decode (docs/decode-family.md, "Planning").

A decode call has one thread block per (KV head, sequence, partition). Without a split a
batch of few sequences leaves most of the GPU idle (batch 1 with 8 KV heads: 8 blocks on
132 SMs), so the plan cuts each sequence's keys into partitions of `partition_tokens`:
the largest multiple of the config's `partition_size` (the granule) that still gives at
least `BLOCKS_PER_SM` thread blocks with work per SM. One size for every sequence also
balances a batch of very different lengths: no block gets more than `partition_tokens`
keys, a long sequence gets many blocks and a short one a single block.

Prefill (kgen/families/paged_prefill.py) plans with the same rule: each (sequence, KV head,
partition) there is one block per tile of query rows (`weights`), and a chunk's first row sees
from `seq_len - q_len - window + 1` (a per-sequence `window`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCKS_PER_SM = 2  # blocks with work per SM the plan aims for: one computes while another loads


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


def choose_split(seq_lens: np.ndarray, num_kv_heads: int, num_sms: int, granule: int, window=0,
                 partition_tokens: int | None = None, weights=None) -> Split:
    """The partition size for these lengths (granule 0: the config never splits).
    `partition_tokens` forces a size (a positive multiple of the granule); `window` and `weights`
    as in working_partitions."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    longest = int(lens.max()) if lens.size else 0
    if not granule or longest <= 0:
        return Split(0, 1)
    if partition_tokens is None:
        partition_tokens = _fill_size(lens, longest, num_kv_heads, num_sms, granule, window, weights)
    if partition_tokens >= longest:
        return Split(0, 1)
    return Split(partition_tokens, -(-longest // partition_tokens))


def _fill_size(lens: np.ndarray, longest: int, num_kv_heads: int, num_sms: int, granule: int, window,
               weights) -> int:
    """The largest multiple of `granule` whose blocks with work reach BLOCKS_PER_SM per SM (the
    granule itself when even that does not; the whole length when one block per sequence does)."""
    target = BLOCKS_PER_SM * num_sms
    if num_kv_heads * (lens.size if weights is None else int(np.sum(weights))) >= target:
        return longest  # enough (KV head, sequence) blocks without a split
    lo, hi = 1, max(1, -(-longest // granule))  # multiples k of the granule; blocks fall as k grows
    if num_kv_heads * working_partitions(lens, lo * granule, window, weights) < target:
        return granule
    while lo < hi:  # the largest k that still reaches the target
        mid = (lo + hi + 1) // 2
        if num_kv_heads * working_partitions(lens, mid * granule, window, weights) >= target:
            lo = mid
        else:
            hi = mid - 1
    return lo * granule
