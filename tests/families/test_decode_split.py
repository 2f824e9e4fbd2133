"""The split-KV planner's choices (kgen/families/decode_split.py), without building a kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.families.decode_split import BLOCKS_PER_SM, choose_split, working_partitions


def blocks(split, lens, kv_heads, window=0):
    """Thread blocks of the main launch that have keys to read."""
    if not split.merged:
        return kv_heads * len(lens)
    return kv_heads * working_partitions(np.asarray(lens), split.partition_tokens, window)


def test_batch_one_long_context_fills_two_blocks_per_sm():
    s = choose_split([32768], num_kv_heads=8, num_sms=132, granule=256)
    assert s.merged and s.partition_tokens % 256 == 0
    assert s.max_partitions == -(-32768 // s.partition_tokens)
    assert blocks(s, [32768], 8) >= BLOCKS_PER_SM * 132  # 264
    # the largest such size: one granule more gives too few blocks
    fewer = 8 * working_partitions(np.array([32768]), s.partition_tokens + 256, 0)
    assert fewer < BLOCKS_PER_SM * 132


def test_a_full_batch_is_not_split():
    s = choose_split([4096] * 64, num_kv_heads=8, num_sms=132, granule=256)
    assert not s.merged and s.max_partitions == 1


@pytest.mark.parametrize("sms", [16, 132, 1000])
def test_mixed_lengths_balance_the_blocks(sms):
    """One partition size for all: no block reads more than partition_tokens keys, the long
    sequence gets many blocks and the short ones one each."""
    lens = [100, 30000, 17, 2048]
    s = choose_split(lens, num_kv_heads=4, num_sms=sms, granule=128)
    assert s.merged and s.max_partitions == -(-30000 // s.partition_tokens)
    per_seq = [-(-n // s.partition_tokens) for n in lens]
    assert per_seq[1] > per_seq[0] == per_seq[2] == 1
    if sms == 1000:  # the GPU is too big for this batch: the smallest partitions the config allows
        assert s.partition_tokens == 128


def test_forced_partition_size_and_no_split_configs():
    s = choose_split([1000], num_kv_heads=8, num_sms=132, granule=256, partition_tokens=256)
    assert (s.partition_tokens, s.max_partitions) == (256, 4)
    assert not choose_split([1000], 8, 132, granule=256, partition_tokens=1024).merged  # one partition covers it
    assert not choose_split([32768], 8, 132, granule=0).merged  # partition_size 0: never split
    assert not choose_split([0, 0], 8, 132, granule=256).merged


def test_sliding_window_counts_only_partitions_with_keys():
    """Blocks before the window have nothing to read: they do not count toward filling the GPU."""
    assert working_partitions(np.array([4096]), 256, window=512) == 2
    assert working_partitions(np.array([4096]), 256, window=0) == 16
    s = choose_split([32768], num_kv_heads=8, num_sms=132, granule=128, window=8192)
    assert s.merged and blocks(s, [32768], 8, window=8192) >= 264
