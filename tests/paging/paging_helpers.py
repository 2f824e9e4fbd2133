"""Helpers shared by the paging tests (imported by name: tests/paging is on sys.path)."""

from __future__ import annotations

from kgen.paging import KVCacheManager


def fingerprint(m: KVCacheManager) -> tuple:
    """Everything observable about a manager (and its internal free lists), to assert
    that a refused call left it exactly as it was."""
    st = m._store
    seqs = tuple(
        (sid, s.on_cpu, st.tokens[s.slot, : st.lens[s.slot]].tobytes(), st.blocks(s.slot, m.block_size).tobytes(),
         tuple(s.hashes), s.arrival)
        for sid, s in sorted(m._seqs.items())
    )  # fmt: skip
    cache = () if m._cache is None else (tuple(m._cache.lru), tuple(sorted(m._cache.hash_of.items())))
    return (
        tuple(m._n.items()),
        seqs,
        tuple(m._gpu.free_blocks()),
        tuple(m._cpu.free_blocks()),
        m._gpu.refcount.tobytes(),
        m._cpu.refcount.tobytes(),
        cache,
        tuple(m._pending.items()),
    )
