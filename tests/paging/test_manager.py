"""Unit tests of KVCacheManager: one feature or one bad input per test."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fingerprint

from kgen.errors import KgenUserError
from kgen.paging import (
    PAD,
    AlreadyResident,
    CopiesPending,
    DuplicateSequence,
    InvalidTokens,
    KVCacheManager,
    NotResident,
    PagingError,
    PoolExhausted,
    SwapSpaceExhausted,
    UnknownSequence,
    preempt,
)


def ids(*xs: int) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def step(m: KVCacheManager, seqs: list[int], toks: list[int]) -> None:
    m.append_tokens(ids(*seqs), np.asarray(toks, dtype=np.int32))
    m.check_invariants()


# ---- allocation on demand ------------------------------------------------------------


def test_blocks_are_taken_only_when_a_write_passes_the_tail():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence(1, range(6))
    assert len(m.block_table(1)) == 2 and m.stats()["free_blocks"] == 6
    step(m, [1], [6])
    step(m, [1], [7])  # fills block 1
    assert m.stats()["free_blocks"] == 6
    step(m, [1], [8])  # passes it
    assert len(m.block_table(1)) == 3 and m.stats()["free_blocks"] == 5
    assert m.tokens(1).tolist() == list(range(9))


def test_free_returns_every_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence(1, range(9))
    m.add_sequence(2, range(3))
    m.free(1)
    m.free(2)
    m.check_invariants()
    assert m.stats()["free_blocks"] == 8 and m.stats()["used_blocks"] == 0


def test_empty_prompt_gets_its_first_block_on_the_first_append():
    m = KVCacheManager(num_blocks=4, block_size=4)
    assert m.add_sequence(1, []) == 0
    assert m.block_table(1) == []
    step(m, [1], [5])
    assert len(m.block_table(1)) == 1


def test_block_tables_are_padded_int32_and_updated_in_place():
    m = KVCacheManager(num_blocks=64, block_size=4)
    m.add_sequence(1, range(3))
    m.add_sequence(2, range(9))
    b = ids(1, 2)
    t0 = m.block_tables(b)
    assert t0.dtype == np.int32 and t0.flags.c_contiguous and not t0.flags.writeable
    assert t0.shape[1] >= 3 and (t0[0, 1:] == PAD).all()
    assert m.seq_lens(b).tolist() == [3, 9] and m.seq_lens(b).dtype == np.int32
    step(m, [1, 2], [0, 0])  # seq 1 fills its block, seq 2 writes into block 2
    step(m, [1, 2], [0, 0])  # seq 1 crosses into a new block
    t1 = m.block_tables(b)
    assert np.shares_memory(t0, t1)  # the same buffer, not a rebuild
    assert t1[0, :2].tolist() == m.block_table(1) and t1[1, :3].tolist() == m.block_table(2)
    assert m.seq_lens(b).tolist() == [5, 11]


def test_table_width_grows_by_doubling():
    m = KVCacheManager(num_blocks=64, block_size=1)
    m.add_sequence(1, [1])
    b = ids(1)
    for t in range(40):
        step(m, [1], [t])
    w = m.block_tables(b).shape[1]
    assert w >= 41 and w & (w - 1) == 0
    assert m.block_tables(b)[0, :41].tolist() == m.block_table(1)


def test_batch_views_follow_membership_changes():
    m = KVCacheManager(num_blocks=64, block_size=2)
    for s in range(4):
        m.add_sequence(s, range(s + 1))
    for _ in range(5):
        step(m, [0, 1, 2, 3], [1, 2, 3, 4])
    m.free(1)
    for _ in range(3):
        step(m, [3, 0, 2], [1, 1, 1])
    t = m.block_tables(ids(3, 0, 2))
    for row, s in zip(t, [3, 0, 2], strict=True):
        assert row[: len(m.block_table(s))].tolist() == m.block_table(s)


# ---- fork and copy on write -------------------------------------------------------------


def test_fork_shares_and_the_first_append_copies_a_partly_filled_tail():
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence(1, range(6))
    m.fork(1, 2)
    assert m.block_table(1) == m.block_table(2)
    assert m.stats()["used_blocks"] == 2
    step(m, [2], [100])
    t1, t2 = m.block_table(1), m.block_table(2)
    assert t1[0] == t2[0] and t1[1] != t2[1]
    assert m.pending_copies() == [(t1[1], t2[1])]
    assert m.pending_copies() == []  # drained
    step(m, [1], [200])  # the parent's tail is private again: written in place
    assert m.block_table(1) == t1 and m.pending_copies() == []
    assert m.tokens(1).tolist()[-1] == 200 and m.tokens(2).tolist()[-1] == 100


def test_shared_full_tail_is_never_written_again():
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence(1, range(8))
    m.fork(1, 2)
    step(m, [1, 2], [5, 6])
    assert m.pending_copies() == []  # both got a fresh block, no copy
    assert m.block_table(1)[:2] == m.block_table(2)[:2]
    assert m.block_table(1)[2] != m.block_table(2)[2]


def test_all_holders_appending_in_one_step_copy_all_but_one():
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence(1, range(5))
    m.fork(1, 2)
    m.fork(1, 3)
    step(m, [1, 2, 3], [7, 8, 9])
    assert len(m.pending_copies()) == 2
    tails = {m.block_table(s)[1] for s in (1, 2, 3)}
    assert len(tails) == 3


# ---- prefix caching ---------------------------------------------------------------------


def test_prefix_cache_reuses_full_blocks_of_a_common_prompt():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    assert m.add_sequence(1, range(10)) == 0
    assert m.add_sequence(2, list(range(8)) + [50, 51, 52]) == 8
    assert m.block_table(1)[:2] == m.block_table(2)[:2]
    assert m.block_table(1)[2] != m.block_table(2)[2]
    m.check_invariants()


def test_prefix_cache_always_leaves_one_token_to_compute():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(8))
    assert m.add_sequence(2, range(8)) == 4  # not 8: the last token's logits are needed
    assert m.block_table(1)[1] != m.block_table(2)[1]


def test_salt_separates_cache_namespaces():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(9), salt="lora-a")
    assert m.add_sequence(2, range(9), salt="lora-b") == 0
    assert m.add_sequence(3, range(9), salt="lora-a") == 8


def test_caching_off_never_shares():
    m = KVCacheManager(num_blocks=32, block_size=4)
    m.add_sequence(1, range(9))
    assert m.add_sequence(2, range(9)) == 0
    assert not set(m.block_table(1)) & set(m.block_table(2))


def test_freed_blocks_stay_cached_and_decoded_blocks_serve_the_next_turn():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(6))
    for t in range(6):
        step(m, [1], [100 + t])  # 12 tokens: 3 full blocks
    history = m.tokens(1).tolist()
    old = m.block_table(1)
    m.free(1)
    s = m.stats()
    assert s["cached_blocks"] == 3 and s["used_blocks"] == 0
    assert m.add_sequence(2, history + [7, 8]) == 12  # the next chat turn
    assert m.block_table(2)[:3] == old


def test_chunked_prompt_blocks_are_found_only_once_marked_computed():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    assert m.add_sequence(1, range(10), computed=0) == 0
    assert m.add_sequence(2, range(10), computed=0) == 0  # 1's blocks hold no K/V yet
    m.free(2)  # preempted before any chunk ran: its blocks go back unnamed
    m.mark_computed(1, 6)  # the first chunk: one full block
    assert m.add_sequence(3, range(10)) == 4
    m.mark_computed(1, 5)  # counts only grow
    m.mark_computed(1, 10)
    assert m.add_sequence(4, range(10)) == 8
    # block 0 is 1's; block 1's content was named first by 3 (a whole-prompt prefill)
    assert m.block_table(4)[:2] == [m.block_table(1)[0], m.block_table(3)[1]]
    m.check_invariants()


def test_a_prompt_freed_before_its_k_v_was_written_leaves_nothing_in_the_cache():
    """A request preempted in the middle of its prompt: its unwritten blocks go back to the free
    list, so no later request reads their stale contents as a prefix hit."""
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(12), computed=0)
    m.mark_computed(1, 4)
    m.free(1)
    s = m.stats()
    assert s["cached_blocks"] == 1 and s["free_blocks"] == 7
    assert m.add_sequence(2, range(12)) == 4  # the one written block, not the two after it
    m.check_invariants()


def test_tokens_appended_after_a_computed_prompt_count_as_computed():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(6), computed=0)
    m.mark_computed(1, 6)
    for t in range(6):
        step(m, [1], [100 + t])
    history = m.tokens(1).tolist()
    m.free(1)
    assert m.add_sequence(2, history + [7]) == 12


def test_swapping_a_half_computed_prompt_names_only_its_computed_blocks():
    m = KVCacheManager(num_blocks=16, block_size=4, num_cpu_blocks=8, enable_prefix_caching=True)
    m.add_sequence(1, range(10), computed=0)
    m.mark_computed(1, 4)
    assert len(m.swap_out(1)) == 3
    m.check_invariants()
    assert len(m.swap_in(1)) == 2  # block 0 is still cached; the others come back from the CPU tier
    assert m.add_sequence(2, range(10)) == 4
    m.mark_computed(1, 10)
    assert m.add_sequence(3, range(10)) == 8
    m.check_invariants()


def test_mark_computed_needs_a_resident_sequence():
    m = KVCacheManager(num_blocks=16, block_size=4, num_cpu_blocks=8, enable_prefix_caching=True)
    m.add_sequence(1, range(10), computed=0)
    m.swap_out(1)
    with pytest.raises(NotResident, match="swap_in before marking its tokens computed"):
        m.mark_computed(1, 4)


def test_eviction_is_lru_and_tail_first_within_a_chain():
    m = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    m.add_sequence(1, [1, 1, 2, 2, 3])  # blocks a1 a2 (cached) + tail
    m.add_sequence(2, [5, 5, 6, 6, 7])  # b1 b2 (cached) + tail
    a, b = m.block_table(1), m.block_table(2)
    m.free(1)  # older: a2 then a1 parked
    m.free(2)
    assert m.stats()["cached_blocks"] == 4 and m.stats()["free_blocks"] == 2
    m.add_sequence(3, range(20, 26))  # 3 blocks: 2 free + 1 evicted
    assert m.stats()["evictions"] == 1
    assert a[1] in m.block_table(3)  # a2, the tail of the oldest chain, went first
    assert m.add_sequence(4, [1, 1, 9]) == 2  # a1, the head, is still there
    assert b[1] in m.block_table(4)  # next LRU: b2, again the tail before its head
    m.free(3)
    assert m.add_sequence(5, [5, 5, 9]) == 2 and m.block_table(5)[0] == b[0]
    m.check_invariants()


def test_swap_in_reuses_blocks_still_in_the_prefix_cache():
    m = KVCacheManager(num_blocks=16, block_size=4, num_cpu_blocks=8, enable_prefix_caching=True)
    m.add_sequence(1, range(10))
    m.add_sequence(2, range(10))  # shares the two full blocks
    out = m.swap_out(1)
    assert len(out) == 3
    back = m.swap_in(1)
    assert len(back) == 1  # only the partly filled tail needed copying
    assert m.block_table(1)[:2] == m.block_table(2)[:2]
    m.check_invariants()


# ---- exhaustion and preemption ------------------------------------------------------------


def test_pool_exhaustion_reports_numbers_and_changes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(8))
    m.free(1)  # 2 cached
    m.add_sequence(2, range(100, 104))
    before = fingerprint(m)
    with pytest.raises(PoolExhausted) as e:
        m.add_sequence(3, range(200, 217))
    assert (e.value.needed, e.value.free, e.value.evictable) == (5, 1, 2)
    assert "needed 5 blocks" in str(e.value)
    assert fingerprint(m) == before


def test_batched_append_is_all_or_nothing():
    m = KVCacheManager(num_blocks=3, block_size=2)
    m.add_sequence(1, [1, 2])
    m.add_sequence(2, [1, 2])
    m.add_sequence(3, [1])
    b = ids(1, 2, 3)
    table = m.block_tables(b).copy()
    before = fingerprint(m)
    with pytest.raises(PoolExhausted) as e:
        m.append_tokens(b, np.array([5, 6, 7], dtype=np.int32))  # 1 and 2 both need a block
    assert (e.value.needed, e.value.free) == (2, 0)
    assert fingerprint(m) == before
    assert np.array_equal(m.block_tables(b), table)
    step(m, [3], [9])  # the batch that fits still works


def test_preempt_newest_first_swapping_when_there_is_room():
    m = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=2)
    for s in range(3):
        m.add_sequence(s, range(8))  # 2 blocks each: pool full
    r = preempt(m, 4, protect=[])
    assert r.swapped == [2] and r.freed == [1] and r.satisfied
    assert len(r.copies) == 2 and not m.is_resident(2) and 1 not in m
    m.check_invariants()
    r = preempt(m, 100, mode="recompute", protect=[0])
    assert r.freed == [] and not r.satisfied
    with pytest.raises(PagingError):
        preempt(m, 1, mode="bogus")  # type: ignore[arg-type]


# ---- swap tier ------------------------------------------------------------------------------


def test_swap_round_trip_and_residency_check():
    m = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    m.add_sequence(1, range(7))
    gpu = m.block_table(1)
    out = m.swap_out(1)
    assert [s for s, _ in out] == gpu and m.stats()["free_blocks"] == 8
    with pytest.raises(NotResident):
        m.block_tables(ids(1))
    with pytest.raises(NotResident):
        m.append_tokens(ids(1), np.array([1], np.int32))
    with pytest.raises(NotResident):
        m.fork(1, 2)
    back = m.swap_in(1)
    assert [s for s, _ in back] == [d for _, d in out]
    assert [d for _, d in back] == m.block_table(1)
    assert m.stats()["cpu_free_blocks"] == 4 and m.tokens(1).tolist() == list(range(7))
    m.check_invariants()


def test_swap_needs_room_and_drained_copies():
    m = KVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=1)
    m.add_sequence(1, range(6))
    before = fingerprint(m)
    with pytest.raises(SwapSpaceExhausted, match="needed 2 blocks, 1 free"):
        m.swap_out(1)
    assert fingerprint(m) == before
    m.fork(1, 2)
    step(m, [2], [1])
    with pytest.raises(CopiesPending):
        m.swap_out(1)
    m.pending_copies()
    m.free(2)
    m2 = KVCacheManager(num_blocks=2, block_size=4, num_cpu_blocks=2)
    m2.add_sequence(1, range(8))
    m2.swap_out(1)
    m2.add_sequence(2, range(5))
    before = fingerprint(m2)
    with pytest.raises(PoolExhausted, match="swap_in"):
        m2.swap_in(1)
    assert fingerprint(m2) == before
    with pytest.raises(AlreadyResident):
        m2.swap_in(2)


# ---- bad input ------------------------------------------------------------------------------


def test_errors_are_user_errors():
    for e in (
        PoolExhausted,
        UnknownSequence,
        DuplicateSequence,
        NotResident,
        SwapSpaceExhausted,
        InvalidTokens,
    ):
        assert issubclass(e, PagingError) and issubclass(e, KgenUserError)
    assert str(UnknownSequence("unknown sequence id 3")) == "unknown sequence id 3"


def _bad_calls():
    i32 = np.int32
    return [
        ("unknown free", lambda m: m.free(99), UnknownSequence),
        ("unknown table", lambda m: m.block_table(99), UnknownSequence),
        ("unknown in batch", lambda m: m.append_tokens(ids(1, 99), np.array([1, 2], i32)), UnknownSequence),
        ("unknown tables", lambda m: m.block_tables([1, 99]), UnknownSequence),
        ("unknown fork parent", lambda m: m.fork(99, 5), UnknownSequence),
        ("unknown swap", lambda m: m.swap_out(99), UnknownSequence),
        ("duplicate add", lambda m: m.add_sequence(1, [1]), DuplicateSequence),
        ("fork onto existing", lambda m: m.fork(1, 2), DuplicateSequence),
        ("duplicate in batch", lambda m: m.append_tokens([1, 1], [3, 4]), DuplicateSequence),
        ("float tokens", lambda m: m.append_tokens([1], [1.5]), InvalidTokens),
        ("str tokens", lambda m: m.add_sequence(7, "hello"), InvalidTokens),
        ("bool tokens", lambda m: m.append_tokens([1], [True]), InvalidTokens),
        ("negative token", lambda m: m.append_tokens(ids(1), np.array([-1], i32)), InvalidTokens),
        ("huge token", lambda m: m.add_sequence(7, [2**40]), InvalidTokens),
        ("2-D prompt", lambda m: m.add_sequence(7, [[1, 2]]), InvalidTokens),
        ("token count", lambda m: m.append_tokens([1, 2], [1]), InvalidTokens),
        ("str id", lambda m: m.add_sequence("a", [1]), InvalidTokens),
        ("float ids", lambda m: m.append_tokens([1.0], [1]), InvalidTokens),
        ("swap in resident", lambda m: m.swap_in(1), AlreadyResident),
        ("computed past the prompt", lambda m: m.add_sequence(7, range(5), computed=6), InvalidTokens),
        ("negative computed", lambda m: m.add_sequence(7, range(5), computed=-1), InvalidTokens),
        ("float computed", lambda m: m.add_sequence(7, range(5), computed=2.0), InvalidTokens),
        ("mark past the end", lambda m: m.mark_computed(1, 8), InvalidTokens),
        ("mark with a bool", lambda m: m.mark_computed(1, True), InvalidTokens),
        ("mark unknown", lambda m: m.mark_computed(99, 1), UnknownSequence),
        ("no cpu tier", lambda m: m.swap_out(1), SwapSpaceExhausted),
    ]


@pytest.mark.parametrize("name,call,exc", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_is_refused_and_changes_nothing(name, call, exc):
    m = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    m.add_sequence(1, range(6))
    m.add_sequence(2, range(3))
    m.append_tokens(ids(1, 2), np.array([1, 2], np.int32))
    before = fingerprint(m)
    with pytest.raises(exc) as e:
        call(m)
    assert str(e.value)
    assert fingerprint(m) == before
    m.check_invariants()


def test_constructor_checks_its_arguments():
    with pytest.raises(InvalidTokens, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(InvalidTokens, match="num_blocks"):
        KVCacheManager(num_blocks=2.5, block_size=4)  # type: ignore[arg-type]


def test_stats_report_memory_holding_tokens():
    m = KVCacheManager(num_blocks=16, block_size=4, bytes_per_token=10)
    m.add_sequence(1, range(5))
    m.fork(1, 2)
    s = m.stats()
    assert s["reserved_bytes"] == 2 * 4 * 10 and s["token_bytes"] == 5 * 10
    assert s["token_share"] == 5 / 8 and s["forks"] == 1
