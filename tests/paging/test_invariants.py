"""The invariant checker fires: each kind of corruption it claims to catch is planted in a
healthy manager's state, and check_invariants must name it. Without this, a checker that
never raised would pass every stateful test."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import kgen.paging.invariants
from kgen.paging import KVCacheManager


def healthy() -> KVCacheManager:
    """A manager in every state the checker inspects: parked cached blocks, a swapped-out
    sequence, shared blocks, a pending copy-on-write copy and a cached batch view."""
    m = KVCacheManager(num_blocks=16, block_size=4, num_cpu_blocks=8, enable_prefix_caching=True)
    m.add_sequence(4, list(range(200, 208)))  # two full blocks, parked in the LRU once freed
    m.free(4)
    m.add_sequence(3, list(range(100, 106)))
    m.swap_out(3)  # its table holds CPU ids now
    m.add_sequence(1, list(range(10)))
    m.fork(1, 2)  # shares every block, the partly filled tail too
    m.append_tokens(np.asarray([1, 2], np.int64), np.asarray([50, 51], np.int32))  # one copy on write
    m.check_invariants()
    assert m._cache.lru and m._pending and m._batch is not None and m._seqs[3].on_cpu
    return m


def _slot(m, sid):
    return m._seqs[sid].slot


def _free_gpu_block(m):
    return m._gpu.free_blocks()[0]


def _parked(m):
    return next(iter(m._cache.lru))


def _drop_hash_of_parked(m):
    b = _parked(m)
    del m._cache.by_hash[m._cache.hash_of.pop(b)]


# (what is corrupted, how, the checker's message)
CORRUPTIONS = [
    ("slot map", lambda m: m._by_slot.__setitem__(_slot(m, 1), m._seqs[2]), "slot map broken for sequence 1"),
    ("block held twice", lambda m: m._store.table.__setitem__((_slot(m, 1), 1), m._store.table[_slot(m, 1), 0]),
     "holds a block twice:"),
    ("entry past the table", lambda m: m._store.table.__setitem__((_slot(m, 1), 3), 7), "has non-pad entries past its"),
    ("extra block hash", lambda m: m._seqs[1].hashes.append(b"\0" * 16), "block hashes for 2 full computed blocks"),
    ("computed past the end", lambda m: setattr(m._seqs[1], "computed", 99),
     "has more tokens marked computed than it holds"),
    ("token changed under its hash", lambda m: m._store.tokens.__setitem__((_slot(m, 1), 0), 99),
     "has stale block hashes"),
    ("block renamed in the cache", lambda m: m._cache.hash_of.__setitem__(int(m.block_table(1)[0]), b"\1" * 16),
     "is cached under another content hash"),
    ("gpu refcount", lambda m: m._gpu.refcount.__setitem__(m.block_table(1)[0], 5),
     "gpu refcounts differ from the number of tables holding blocks"),
    ("cpu refcount", lambda m: m._cpu.refcount.__setitem__(int(m._store.table[_slot(m, 3), 0]), 3),
     "cpu refcounts differ from the number of tables holding blocks"),
    ("gpu block leaked", lambda m: setattr(m._gpu, "_top", m._gpu._top - 1),
     "gpu blocks are not partitioned into free / cached / owned"),
    ("cpu block leaked", lambda m: setattr(m._cpu, "_top", m._cpu._top - 1),
     "cpu blocks are not partitioned into free / cached / owned"),
    ("owned block also free", lambda m: m._gpu.put([m.block_table(1)[0]]),
     "gpu blocks are not partitioned into free / cached / owned"),
    ("cache maps", lambda m: m._cache.by_hash.pop(m._cache.hash_of[_parked(m)]), "prefix cache maps are not inverse"),
    ("parked block without a hash", _drop_hash_of_parked, "an evictable block has no content hash"),
    ("copy into a free block", lambda m: m._pending.__setitem__(_free_gpu_block(m), 0),
     "a pending copy targets a free block"),
    ("batch rows", lambda m: setattr(m._batch, "slots", m._batch.slots[::-1].copy()),
     "cached batch rows belong to other sequences"),
    ("batch lens", lambda m: m._batch.lens.__setitem__(0, m._batch.lens[0] + 1), "cached batch seq_lens are stale"),
    ("batch table", lambda m: m._batch.table.__setitem__((0, 0), m._batch.table[0, 0] + 1),
     "cached batch block table is stale"),
    ("batch tail", lambda m: m._batch.tail.__setitem__(0, m._batch.tail[0] + 1), "cached batch tails are stale"),
]


@pytest.mark.parametrize(("what", "corrupt", "message"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_the_checker_catches_the_corruption(what, corrupt, message):
    m = healthy()
    corrupt(m)
    with pytest.raises(AssertionError, match=message):
        m.check_invariants()


def test_stale_hashes_need_the_deep_check():
    m = healthy()
    m._store.tokens[_slot(m, 1), 0] = 99
    m.check_invariants(deep=False)  # documented: only deep recomputes hashes
    with pytest.raises(AssertionError, match="stale block hashes"):
        m.check_invariants(deep=True)


def _messages() -> list[str]:
    """The literal text of every failure the checker can report."""
    tree = ast.parse(Path(kgen.paging.invariants.__file__).read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_fail":
            arg = node.args[0]
            parts = [arg] if isinstance(arg, ast.Constant) else [v for v in arg.values if isinstance(v, ast.Constant)]
            out.append(max((p.value for p in parts), key=len).strip(" :"))
    return out


def test_every_check_of_the_checker_is_shown_to_fire():
    messages = _messages()
    assert len(messages) >= 15
    untested = [msg for msg in messages if not any(msg in expected for _, _, expected in CORRUPTIONS)]
    assert not untested, f"checks no corruption above triggers: {untested}"
