"""The split-KV planner's choices (kgen/plan/split.py, kgen.plan.target_blocks),
without building a kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.errors import ArgumentError
from kgen.plan import BLOCKS_PER_SM, target_blocks
from kgen.plan.split import (
    STEP_TOKENS,
    check_forced_partition,
    choose_prefill_split,
    choose_split,
    working_partitions,
)


def blocks(split, lens, kv_heads, window=0):
    """Thread blocks of the main launch that have keys to read."""
    if not split.merged:
        return kv_heads * len(lens)
    return kv_heads * working_partitions(np.asarray(lens), split.partition_tokens, window)


def test_target_is_a_quarter_of_the_resident_blocks_at_least_two_per_sm():
    assert target_blocks(132, 9 * 132) == 297  # the Llama decode kernel on sm_90 holds 9 blocks per SM
    assert target_blocks(132, 4 * 132) == BLOCKS_PER_SM * 132  # a quarter would be under 2 per SM
    assert target_blocks(132, 132) == 132  # never more than one wave


def test_batch_one_long_context_reaches_the_target_with_the_largest_partitions():
    s = choose_split([32768], num_kv_heads=8, target=297, granule=64)
    assert s.merged and s.partition_tokens % STEP_TOKENS == 0 and s.partition_tokens >= 64
    assert s.max_partitions == -(-32768 // s.partition_tokens)
    assert blocks(s, [32768], 8) >= 297 >= BLOCKS_PER_SM * 132
    # the largest such size: one step more gives too few blocks
    assert 8 * working_partitions(np.array([32768]), s.partition_tokens + STEP_TOKENS, 0) < 297


def test_a_full_batch_is_not_split():
    s = choose_split([4096] * 64, num_kv_heads=8, target=297, granule=64)
    assert not s.merged and s.max_partitions == 1


@pytest.mark.parametrize("target", [32, 264, 2000])
def test_mixed_lengths_balance_the_blocks(target):
    """One partition size for all: no block reads more than partition_tokens keys, the long
    sequence gets many blocks and the short ones one each."""
    lens = [100, 30000, 17, 2048]
    s = choose_split(lens, num_kv_heads=4, target=target, granule=128)
    assert s.merged and s.max_partitions == -(-30000 // s.partition_tokens)
    per_seq = [-(-n // s.partition_tokens) for n in lens]
    assert per_seq[1] > per_seq[0] == per_seq[2] == 1
    if target == 2000:  # more than the batch can give: the smallest partitions the config allows
        assert s.partition_tokens == 128


def test_forced_partition_size_and_no_split_configs():
    s = choose_split([1000], num_kv_heads=8, target=264, granule=64, partition_tokens=256)
    assert (s.partition_tokens, s.max_partitions) == (256, 4)
    assert not choose_split([1000], 8, 264, granule=64, partition_tokens=1024).merged  # one partition covers it
    assert not choose_split([32768], 8, 264, granule=0).merged  # partition_size 0: never split
    assert not choose_split([0, 0], 8, 264, granule=64).merged
    check_forced_partition(None, 0)
    check_forced_partition(80, 64)
    for bad, words in [(48, "at least the config's partition_size 64"), (72, "multiple of 16")]:
        with pytest.raises(ArgumentError, match=words):
            check_forced_partition(bad, 64)
    with pytest.raises(ArgumentError, match="never splits"):
        check_forced_partition(64, 0)


def test_sliding_window_counts_only_partitions_with_keys():
    """Blocks before the window have nothing to read: they do not count toward the target."""
    assert working_partitions(np.array([4096]), 256, window=512) == 2
    assert working_partitions(np.array([4096]), 256, window=0) == 16
    s = choose_split([32768], num_kv_heads=8, target=264, granule=64, window=8192)
    assert s.merged and blocks(s, [32768], 8, window=8192) >= 264


def test_prefill_split_counts_sequences_with_query_rows_only_and_ends_in_whole_waves():
    """choose_prefill_split (dense and mla prefill): a sequence without query rows adds no block, so
    its length neither stretches the partitions nor counts toward the target; the automatic size is
    whole_waves' (at most two waves' worth of partitions, each a multiple of STEP_TOKENS)."""
    lens, q_lens, weights = np.asarray([4096, 100_000]), np.asarray([2, 0]), np.asarray([1, 0])
    split = choose_prefill_split(lens, q_lens, 1, weights, 64, 32)
    assert split.merged and split.max_partitions == -(-4096 // split.partition_tokens)  # the live sequence's
    assert split.partition_tokens % STEP_TOKENS == 0 and split.partition_tokens >= 32
    assert working_partitions(np.asarray([4096]), split.partition_tokens, 0) <= 2 * 64
    forced = choose_prefill_split(lens, q_lens, 1, weights, 64, 32, partition_tokens=512)
    assert (forced.partition_tokens, forced.max_partitions) == (512, 8)
    assert not choose_prefill_split(lens, q_lens, 1, np.asarray([64, 0]), 64, 32).merged  # 64 row tiles fill it
    with pytest.raises(ArgumentError, match="this config never splits"):
        choose_prefill_split(lens, q_lens, 1, weights, 64, 0, partition_tokens=64)
