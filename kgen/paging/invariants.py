"""Consistency checks of a KVCacheManager's bookkeeping, O(pool + table entries).
Used by the tests after every operation; cheap enough for debugging in an engine.
It reads the manager's fields but never imports kgen.paging.manager (the manager calls it)."""

from __future__ import annotations

import numpy as np

from kgen.paging.prefix_cache import chain_hashes
from kgen.paging.tables import PAD


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check(m, deep: bool = True) -> None:
    """Raise AssertionError if the bookkeeping of `m` (a KVCacheManager) is inconsistent;
    deep also recomputes every sequence's content hashes from its tokens."""
    B, st, cache = m.block_size, m._store, m._cache
    held: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for sid, s in m._seqs.items():
        if m._by_slot.get(s.slot) is not s:
            _fail(f"slot map broken for sequence {sid}")
        n = int(st.lens[s.slot])
        nb = -(-n // B)
        blocks = st.table[s.slot, :nb]
        if len(set(blocks.tolist())) != nb:
            _fail(f"sequence {sid} holds a block twice: {blocks.tolist()}")
        if st.table[s.slot, nb:].any():
            _fail(f"sequence {sid} has non-pad entries past its {nb} blocks")
        held[s.on_cpu].append(blocks)
        if cache is None:
            continue
        done = s.computed_tokens(n) // B  # full blocks with K/V
        if s.computed > n:
            _fail(f"sequence {sid} has more tokens marked computed than it holds: {s.computed} > {n}")
        if len(s.hashes) > done or (s.on_cpu and len(s.hashes) != done):
            _fail(f"sequence {sid} has {len(s.hashes)} block hashes for {done} full computed blocks")
        hashes = chain_hashes(s.root, st.tokens[s.slot, :n], B) if deep else s.hashes
        if deep and s.hashes != hashes[: len(s.hashes)]:
            _fail(f"sequence {sid} has stale block hashes")
        if not s.on_cpu:
            for j, h in enumerate(hashes):
                hb = cache.hash_of.get(int(blocks[j]))
                if hb is not None and hb != h:
                    _fail(f"sequence {sid} block {j} is cached under another content hash")

    for on_cpu, pool in ((False, m._gpu), (True, m._cpu)):
        tier = "cpu" if on_cpu else "gpu"
        blocks = np.concatenate(held[on_cpu]) if held[on_cpu] else np.zeros(0, np.int64)
        holders = np.bincount(blocks, minlength=pool.num_blocks)
        if not np.array_equal(pool.refcount, holders):
            bad = np.flatnonzero(pool.refcount != holders)[:5].tolist()
            _fail(f"{tier} refcounts differ from the number of tables holding blocks {bad}")
        # every block is in exactly one state: free, cached (parked) or owned
        states = np.bincount(pool.free_blocks(), minlength=pool.num_blocks) + (pool.refcount > 0)
        if cache is not None and not on_cpu:
            states += np.bincount(list(cache.lru), minlength=pool.num_blocks).astype(states.dtype)
        if len(states) != pool.num_blocks or np.any(states != 1):
            _fail(f"{tier} blocks are not partitioned into free / cached / owned: {states.tolist()}")

    if cache is not None:
        if len(cache.by_hash) != len(cache.hash_of) or any(
            cache.hash_of.get(b) != h for h, b in cache.by_hash.items()
        ):
            _fail("prefix cache maps are not inverse")
        if not set(cache.lru) <= set(cache.hash_of):
            _fail("an evictable block has no content hash")
    if any(m._gpu.refcount[d] == 0 and not (cache and d in cache.lru) for d in m._pending):
        _fail("a pending copy targets a free block")

    b = m._batch
    if b is not None:
        if not np.array_equal(b.slots, [m._seqs[i].slot for i in np.frombuffer(b.key, np.int64).tolist()]):
            _fail("cached batch rows belong to other sequences")
        if not np.array_equal(b.lens, st.lens[b.slots]):
            _fail("cached batch seq_lens are stale")
        w = min(b.table.shape[1], st.table.shape[1])
        if not np.array_equal(b.table[:, :w], st.table[b.slots, :w]) or np.any(b.table[:, w:] != PAD):
            _fail("cached batch block table is stale")
        nb = -(-b.lens // B)
        if b.n and not np.array_equal(b.tail, b.table[b.rows, np.maximum(nb - 1, 0)]):
            _fail("cached batch tails are stale")
