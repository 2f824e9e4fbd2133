"""KVCacheManager: the host-side owner of the paged KV pool.

It decides which physical block holds which token of which sequence and hands kernels
the int32 block tables and seq_lens of the kernel ABI (docs/abi.md). It never touches KV data: block copies
it needs (copy-on-write, swapping) are returned as (src, dst) pairs for the device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

import kgen.paging.validate as validate
from kgen.paging.errors import (
    AlreadyResident,
    CopiesPending,
    DuplicateSequence,
    InvalidTokens,
    NotResident,
    PoolExhausted,
    SwapSpaceExhausted,
    UnknownSequence,
)
from kgen.paging.invariants import check as check_bookkeeping
from kgen.paging.pool import BlockPool
from kgen.paging.prefix_cache import PrefixCache, chain_hashes, chain_root
from kgen.paging.tables import BatchView, SlotStore

_COUNTERS = (
    "blocks_allocated", "blocks_freed", "cow_copies", "evictions", "prefix_queried_blocks",
    "prefix_hit_blocks", "forks", "swap_outs", "swap_ins", "swapped_blocks",
)  # fmt: skip


@dataclass(slots=True)
class _Seq:
    seq_id: int
    slot: int
    arrival: int
    root: bytes  # parent hash of block 0 (from the salt)
    prompt_len: int = 0
    computed: int = 0  # leading tokens whose K/V the caller declared written (mark_computed)
    hashes: list[bytes] = field(default_factory=list)  # one per full computed block (caching on)
    on_cpu: bool = False

    def computed_tokens(self, length: int) -> int:
        """Tokens with K/V in the cache: once the prompt is computed, every appended token is
        too (a decode step writes its token's K/V before attention reads it)."""
        return length if self.computed >= self.prompt_len else self.computed


class KVCacheManager:
    """Paged KV-cache bookkeeping for one model (all layers share the block ids).

    num_blocks GPU blocks of block_size tokens; num_cpu_blocks host blocks for swapping;
    enable_prefix_caching shares full blocks across sequences with equal prefixes;
    bytes_per_token (KV bytes of one token over all layers) only scales stats().
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        bytes_per_token: int = 1,
    ):
        for name, v, lo in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                            ("num_cpu_blocks", num_cpu_blocks, 0), ("bytes_per_token", bytes_per_token, 1)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
                raise InvalidTokens(f"{name} must be an integer >= {lo}, got {v!r}")
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.bytes_per_token = int(bytes_per_token)
        self._gpu = BlockPool(self.num_blocks)
        self._cpu = BlockPool(self.num_cpu_blocks)
        self._cache = PrefixCache() if enable_prefix_caching else None
        self._store = SlotStore()
        self._seqs: dict[int, _Seq] = {}
        self._by_slot: dict[int, _Seq] = {}
        self._pending: dict[int, int] = {}  # dst -> src, insertion ordered
        self._batch: BatchView | None = None
        self._arrivals = itertools.count()
        self._n = dict.fromkeys(_COUNTERS, 0)

    @property
    def prefix_caching(self) -> bool:
        return self._cache is not None

    # ---- lookups -------------------------------------------------------------------

    def _get(self, seq_id: object) -> _Seq:
        sid = validate.seq_id(seq_id)
        s = self._seqs.get(sid)
        if s is None:
            raise UnknownSequence(f"unknown sequence id {sid}")
        return s

    def _resident(self, seq_id: object, what: str) -> _Seq:
        s = self._get(seq_id)
        if s.on_cpu:
            raise NotResident(f"sequence {s.seq_id} is swapped out to the CPU tier; swap_in before {what}")
        return s

    def _new_id(self, seq_id: object) -> int:
        sid = validate.seq_id(seq_id)
        if sid in self._seqs:
            raise DuplicateSequence(f"sequence id {sid} already exists")
        return sid

    def _batch_for(self, seq_ids: object) -> BatchView:
        """The cached batch view for these ids, built (from numpy rows) when they change."""
        if isinstance(seq_ids, np.ndarray) and seq_ids.dtype == np.int64 and seq_ids.ndim == 1:
            ids = seq_ids
        else:
            ids = validate.seq_ids(seq_ids)
        key = ids.tobytes()
        b = self._batch
        if b is not None and b.key == key:
            return b
        id_list = ids.tolist()
        seqs = [self._seqs.get(i) for i in id_list]
        if None in seqs or any(s.on_cpu for s in seqs):  # type: ignore[union-attr]
            for i in id_list:
                self._resident(i, "handing it to a kernel")  # raises the precise error
        if len(set(id_list)) != len(id_list):
            dup = next(i for i in id_list if id_list.count(i) > 1)
            raise DuplicateSequence(f"sequence id {dup} appears more than once in the batch")
        slots = [s.slot for s in seqs]  # type: ignore[union-attr]
        self._batch = BatchView(
            key, np.asarray(slots, dtype=np.intp), self._store, self.block_size, self._gpu.refcount
        )
        return self._batch

    # ---- allocation ----------------------------------------------------------------

    def _evictable(self) -> int:
        return self._cache.num_evictable if self._cache is not None else 0

    def num_available_blocks(self) -> int:
        """GPU blocks an allocation can get: free ones plus evictable cached ones."""
        return self._gpu.num_free + self._evictable()

    def num_free_cpu_blocks(self) -> int:
        return self._cpu.num_free

    def _take(self, k: int) -> np.ndarray:
        """k GPU blocks (refcount 1), evicting cached blocks LRU-first once none is free."""
        short = k - self._gpu.num_free
        if short <= 0:
            out = self._gpu.take(k)
        else:
            assert self._cache is not None
            ev = np.asarray(self._cache.evict(short), dtype=np.int32)
            self._gpu.refcount[ev] = 1
            self._n["evictions"] += short
            out = np.concatenate([self._gpu.take(self._gpu.num_free), ev])
        self._n["blocks_allocated"] += k
        return out

    def _release_gpu(self, blocks: np.ndarray) -> None:
        """Drop one reference from each block, given tail first so that the tail of a
        cached chain is parked (and so evicted) before its head."""
        if not len(blocks):
            return
        rc = self._gpu.refcount
        rc[blocks] -= 1  # a table never holds a block twice
        freed = []
        for b in blocks[rc[blocks] == 0].tolist():
            if self._cache is not None and self._cache.is_cached(b):
                self._cache.park(b)
            else:
                freed.append(b)
                self._pending.pop(b, None)  # a copy into a dead block is moot
        self._gpu.put(freed)
        self._n["blocks_freed"] += len(freed)

    def _release_cpu(self, blocks: np.ndarray) -> None:
        rc = self._cpu.refcount
        rc[blocks] -= 1
        self._cpu.put(blocks[rc[blocks] == 0].tolist())

    def _prefix_hits(self, hashes: list[bytes], limit: int) -> list[int]:
        """Physical blocks of the longest cached prefix (at most `limit` blocks)."""
        hits: list[int] = []
        if self._cache is None:
            return hits
        for h in hashes[:limit]:
            b = self._cache.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _check_room(self, need: int, hits: list[int], what: str) -> None:
        parked = int(np.count_nonzero(self._gpu.refcount[hits] == 0)) if hits else 0
        evictable = self._evictable() - parked  # a hit we are about to reuse is not evictable
        if need > self._gpu.num_free + evictable:
            raise PoolExhausted(need, self._gpu.num_free, evictable, what)

    def _reuse(self, hits: list[int]) -> None:
        for b in hits:
            if self._gpu.refcount[b] == 0:
                self._cache.unpark(b)  # type: ignore[union-attr]
            self._gpu.refcount[b] += 1

    # ---- public API: lifecycle ----------------------------------------------------

    def add_sequence(self, seq_id: int, prompt_tokens: object, salt: str | bytes | None = None,
                     computed: int | None = None) -> int:
        """Allocate blocks for a prompt. Returns how many leading prompt tokens already
        have KV in reused prefix-cache blocks (a multiple of block_size; always fewer
        than the prompt length, so at least one token is computed for its logits).

        `computed`: how many leading prompt tokens will have K/V before any other request
        reads this one's blocks; their full blocks are named in the prefix cache now. None
        means the whole prompt (one prefill this step, run in admission order). An engine
        with chunked prefill passes 0 and calls mark_computed as chunks are written, so no
        block is found by another request, or parked by free(), before its K/V exists."""
        sid = self._new_id(seq_id)
        toks = validate.tokens(prompt_tokens, "prompt_tokens")
        B, n = self.block_size, len(toks)
        declared = n if computed is None else validate.token_count(computed, "computed", n)
        nb = -(-n // B)
        root = chain_root(salt) if self._cache is not None else b""
        hashes = chain_hashes(root, toks, B) if self._cache is not None else []
        hits = self._prefix_hits(hashes, (n - 1) // B if n else 0)
        self._check_room(nb - len(hits), hits, "add_sequence")
        self._reuse(hits)
        blocks = np.concatenate([np.asarray(hits, dtype=np.int32), self._take(nb - len(hits))])
        done = max(declared, len(hits) * B)
        hashes = hashes[: done // B]
        for j in range(len(hits), len(hashes)):
            self._cache.register(int(blocks[j]), hashes[j])  # type: ignore[union-attr]
        st = self._store
        slot = st.alloc_slot()
        st.ensure(nb, B)
        st.table[slot, :nb] = blocks
        st.tokens[slot, :n] = toks
        st.lens[slot] = n
        s = _Seq(sid, slot, next(self._arrivals), root, n, done, hashes)
        self._seqs[sid] = self._by_slot[slot] = s
        if self._cache is not None:
            self._n["prefix_queried_blocks"] += (n - 1) // B if n else 0
            self._n["prefix_hit_blocks"] += len(hits)
        return len(hits) * B

    def append_tokens(self, seq_ids: object, tokens: object) -> None:
        """One decode step: append tokens[i] to seq_ids[i]. All or nothing: on
        PoolExhausted nothing has changed."""
        batch = self._batch_for(seq_ids)
        if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1:
            toks = tokens  # the common case, checked with one reduction
            if toks.size and toks.min() < 0:
                toks = validate.tokens(tokens)  # raises with the full message
        else:
            toks = validate.tokens(tokens)
        if toks.shape[0] != batch.n:
            raise InvalidTokens(f"got {toks.shape[0]} tokens for {batch.n} sequences")
        if batch.n == 0:
            return
        B, st = self.block_size, self._store
        if batch.any_shared:
            idx, cow_src = self._needs_general(batch)
        else:  # no shared tails: exactly the sequences due to cross need a block
            idx, cow_src = batch.crossing[batch.step % B], None
        k = len(idx)
        nblocks = -(-(batch.maxlen + 1) // B)  # after this step
        if k:
            if k > self.num_available_blocks():
                raise PoolExhausted(k, self._gpu.num_free, self._evictable(), "append_tokens")
            if nblocks > st.table.shape[1] or nblocks * B > st.tokens.shape[1]:
                st.ensure(nblocks, B)
            batch.ensure_cols(nblocks)
            fresh = self._take(k)
            col = batch.lens[idx] // B
            st.table[batch.slots[idx], col] = fresh
            batch.table[idx, col] = fresh
            batch.tail[idx] = fresh
            if cow_src is not None:
                self._copy_on_write(batch, cow_src, fresh)
        st.tokens[batch.slots, batch.lens] = toks
        batch.lens += 1
        st.lens[batch.slots] = batch.lens
        batch.step += 1
        batch.maxlen += 1

    def _needs_general(self, batch: BatchView) -> tuple[np.ndarray, np.ndarray]:
        """Rows that need a block when some tails are shared: those crossing into a new
        block, and those whose partly filled tail is shared (copy on write; src >= 0)."""
        rc = self._gpu.refcount
        new = batch.lens % self.block_size == 0
        shared = (rc[batch.tail] > 1) & ~new
        if shared.any():
            self._last_holders_write_in_place(shared, batch.tail)
        idx = np.flatnonzero(new | shared)
        return idx, np.where(shared[idx], batch.tail[idx], -1)

    def _copy_on_write(self, batch: BatchView, src: np.ndarray, fresh: np.ndarray) -> None:
        cow = src >= 0
        if cow.any():
            src, dst = src[cow], fresh[cow]
            np.subtract.at(self._gpu.refcount, src, 1)  # was shared, stays >= 1
            self._pending.update(zip(dst.tolist(), src.tolist(), strict=True))
            self._n["cow_copies"] += len(dst)
        rc = self._gpu.refcount
        batch.any_shared = bool(np.any((rc[batch.tail] > 1) & (batch.lens > 0)))

    def _last_holders_write_in_place(self, shared: np.ndarray, cur: np.ndarray) -> None:
        """When every holder of a shared tail appends in one step, the last of them keeps
        the original (as if the appends ran one by one): clear its `shared` flag."""
        idx = np.flatnonzero(shared)
        src = cur[idx]
        if len(np.unique(src)) == len(src):
            return
        rc = self._gpu.refcount
        left: dict[int, int] = {}
        for i, b in zip(idx.tolist(), src.tolist(), strict=True):
            r = left.get(b, int(rc[b]))
            if r > 1:
                left[b] = r - 1  # this one copies; one holder fewer remains
            else:
                shared[i] = False

    def fork(self, parent_id: int, child_id: int) -> None:
        """child becomes a copy of parent sharing every block (refcounts +1)."""
        p = self._resident(parent_id, "forking it")
        cid = self._new_id(child_id)
        st = self._store
        blocks = st.blocks(p.slot, self.block_size)
        slot = st.alloc_slot()
        st.table[slot] = st.table[p.slot]
        st.tokens[slot] = st.tokens[p.slot]
        st.lens[slot] = st.lens[p.slot]
        self._gpu.refcount[blocks] += 1
        c = _Seq(cid, slot, next(self._arrivals), p.root, p.prompt_len, p.computed, list(p.hashes))
        self._seqs[cid] = self._by_slot[slot] = c
        self._batch = None  # the parent's tail is shared now
        self._n["forks"] += 1

    def free(self, seq_id: int) -> None:
        """Release a finished (or preempted) sequence; cached full blocks stay reusable."""
        s = self._get(seq_id)
        blocks = self._store.blocks(s.slot, self.block_size)[::-1].copy()
        if s.on_cpu:
            self._release_cpu(blocks)
        else:
            self._name_computed_blocks(s)
            self._release_gpu(blocks)
        self._forget(s)

    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """Declare that the first `num_tokens` tokens of a resident sequence have K/V in the
        cache (their cache_write has run, or is enqueued before any kernel that could read
        them): its full blocks up to there are named in the prefix cache. Counts only grow;
        a smaller count than before changes nothing. Needed only after add_sequence(...,
        computed=k) with k below the prompt length; decode tokens count as computed."""
        s = self._resident(seq_id, "marking its tokens computed")
        n = validate.token_count(num_tokens, "num_tokens", int(self._store.lens[s.slot]))
        if n > s.computed:
            s.computed = n
            self._name_computed_blocks(s)

    def _name_computed_blocks(self, s: _Seq) -> None:
        """Name the full blocks whose K/V is computed and not named yet, so that later
        prompts (the next turn of a chat) and swap_in can find them. Blocks filled during
        decode are named when the sequence leaves the GPU rather than on every decode step,
        which keeps hashing off the hot path. Blocks never computed are never named: freed,
        they go back to the free list instead of the cache."""
        if self._cache is None:
            return
        B, st = self.block_size, self._store
        j0, full = len(s.hashes), s.computed_tokens(int(st.lens[s.slot])) // B
        if full <= j0:
            return
        parent = s.hashes[-1] if s.hashes else s.root
        new = chain_hashes(parent, st.tokens[s.slot, j0 * B : full * B], B)
        for j, h in enumerate(new, j0):
            self._cache.register(int(st.table[s.slot, j]), h)
        s.hashes.extend(new)

    def _forget(self, s: _Seq) -> None:
        self._store.release_slot(s.slot)
        del self._seqs[s.seq_id], self._by_slot[s.slot]
        self._batch = None

    # ---- public API: tables for kernels ---------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        """Physical GPU block ids of one resident sequence, logical order."""
        s = self._resident(seq_id, "reading its block table")
        return self._store.blocks(s.slot, self.block_size).tolist()

    def block_tables(self, seq_ids: object) -> np.ndarray:
        """int32 [n, width] block tables (width >= max blocks, a doubling capacity),
        padded with 0. A read-only view of a buffer that later append_tokens calls with
        the same ids update in place: copy it to keep a snapshot."""
        return self._batch_for(seq_ids).readonly_table()

    def seq_lens(self, seq_ids: object) -> np.ndarray:
        """int32 [n] tokens in the KV cache; a read-only view, like block_tables."""
        return self._batch_for(seq_ids).readonly_lens()

    def pending_copies(self) -> list[tuple[int, int]]:
        """Drain the copy-on-write (src, dst) GPU block copies, in order. Run them
        before the next kernel and before any swap."""
        out = [(src, dst) for dst, src in self._pending.items()]
        self._pending.clear()
        return out

    def is_resident(self, seq_id: int) -> bool:
        return not self._get(seq_id).on_cpu

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def tokens(self, seq_id: int) -> np.ndarray:
        """A copy of the sequence's token ids (prompt and appended)."""
        s = self._get(seq_id)
        return self._store.tokens[s.slot, : self._store.lens[s.slot]].copy()

    def num_blocks_of(self, seq_id: int) -> int:
        s = self._get(seq_id)
        return -(-int(self._store.lens[s.slot]) // self.block_size)

    def newest_first(self, resident_only: bool = True) -> list[int]:
        """Sequence ids by arrival (add_sequence / fork), newest first."""
        seqs = [s for s in self._seqs.values() if not (resident_only and s.on_cpu)]
        return [s.seq_id for s in sorted(seqs, key=lambda s: -s.arrival)]

    # ---- public API: swap tier ------------------------------------------------------

    def _no_pending(self, what: str) -> None:
        if self._pending:
            raise CopiesPending(
                f"{len(self._pending)} copy-on-write copies are pending; drain pending_copies() "
                f"and run them before {what}"
            )

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move a sequence to the CPU tier. Returns (gpu_src, cpu_dst) copies to run
        before the next kernel; the GPU blocks it held alone are free afterwards."""
        s = self._resident(seq_id, "swapping it out")
        self._no_pending("swap_out")
        st = self._store
        gpu = st.blocks(s.slot, self.block_size).copy()
        if len(gpu) > self._cpu.num_free:
            raise SwapSpaceExhausted(len(gpu), self._cpu.num_free)
        self._name_computed_blocks(s)
        cpu = self._cpu.take(len(gpu))
        self._release_gpu(gpu[::-1])
        st.table[s.slot, : len(gpu)] = cpu
        s.on_cpu = True
        self._batch = None
        self._n["swap_outs"] += 1
        self._n["swapped_blocks"] += len(gpu)
        return list(zip(gpu.tolist(), cpu.tolist(), strict=True))

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back. Returns (cpu_src, gpu_dst) copies; full blocks
        whose content is still in the prefix cache are reused instead of copied."""
        s = self._get(seq_id)
        if not s.on_cpu:
            raise AlreadyResident(f"sequence {s.seq_id} is already resident on the GPU")
        self._no_pending("swap_in")
        st = self._store
        cpu = st.blocks(s.slot, self.block_size).copy()
        hits: dict[int, int] = {}
        if self._cache is not None:
            for j, h in enumerate(s.hashes):
                b = self._cache.lookup(h)
                if b is not None:
                    hits[j] = b
        self._check_room(len(cpu) - len(hits), list(hits.values()), "swap_in")
        self._reuse(list(hits.values()))
        fresh = iter(self._take(len(cpu) - len(hits)).tolist())
        gpu = [hits[j] if j in hits else next(fresh) for j in range(len(cpu))]
        copies = [(int(c), g) for j, (c, g) in enumerate(zip(cpu, gpu, strict=True)) if j not in hits]
        if self._cache is not None:
            for j, h in enumerate(s.hashes):
                if j not in hits:
                    self._cache.register(gpu[j], h)
            self._n["prefix_hit_blocks"] += len(hits)
        self._release_cpu(cpu)
        st.table[s.slot, : len(gpu)] = gpu
        s.on_cpu = False
        self._batch = None
        self._n["swap_ins"] += 1
        return copies

    # ---- public API: reporting -----------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Block states, memory reserved vs holding tokens (GPU), and event counters."""
        B, st, rc = self.block_size, self._store, self._gpu.refcount
        fill = np.zeros(self.num_blocks, dtype=np.int64)
        for s in self._seqs.values():
            if s.on_cpu:
                continue
            n = int(st.lens[s.slot])
            blocks = st.blocks(s.slot, B)
            if len(blocks):
                fill[blocks[:-1]] = B  # shared blocks agree on their fill
                fill[blocks[-1]] = max(fill[blocks[-1]], n - (len(blocks) - 1) * B)
        used = int(np.count_nonzero(rc))
        token_slots = int(fill.sum())
        cached_total = len(self._cache.hash_of) if self._cache is not None else 0
        out: dict[str, int | float] = {
            "num_blocks": self.num_blocks,
            "block_size": B,
            "free_blocks": self._gpu.num_free,
            "cached_blocks": self._evictable(),  # unreferenced, reusable until evicted
            "used_blocks": used,
            "cached_used_blocks": cached_total - self._evictable(),  # in use and findable
            "cpu_free_blocks": self._cpu.num_free,
            "cpu_used_blocks": self.num_cpu_blocks - self._cpu.num_free,
            "num_sequences": len(self._seqs),
            "num_swapped": sum(s.on_cpu for s in self._seqs.values()),
            "pending_copies": len(self._pending),
            "reserved_bytes": used * B * self.bytes_per_token,
            "token_bytes": token_slots * self.bytes_per_token,
            "token_share": token_slots / (used * B) if used else 1.0,
        }
        out.update(self._n)
        return out

    def check_invariants(self, deep: bool = True) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests, debugging).
        deep also recomputes every content hash from the tokens."""
        check_bookkeeping(self, deep)
