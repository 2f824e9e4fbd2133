"""Per-sequence rows (block table, length, token ids) in growable numpy arrays, and the
cached int32 batch table that kernels read.

Rows live in 2-D arrays indexed by a slot number, so a decode step for many sequences is
a handful of vectorized numpy operations. Capacities double when exceeded (amortized
O(1) growth). Unused table entries are 0: a valid block id that kernels never read,
because entries past ceil(seq_len / block_size) are outside the ABI's read range.
"""

from __future__ import annotations

import numpy as np

PAD = 0  # table entries past a sequence's blocks; valid for any pool, never read


def _grown(a: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    """`a` copied into a larger zero-filled array (the old contents keep their place)."""
    out = np.zeros((rows,) if a.ndim == 1 else (rows, cols), dtype=a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def capacity(n: int, cap: int) -> int:
    """cap doubled until it holds n."""
    while cap < n:
        cap *= 2
    return cap


class SlotStore:
    """Rows of every live sequence. The table of a swapped-out sequence holds CPU ids."""

    def __init__(self, slots: int = 64, cols: int = 8, tokens: int = 128):
        self.table = np.zeros((slots, cols), dtype=np.int32)
        self.tokens = np.zeros((slots, tokens), dtype=np.int32)
        self.lens = np.zeros(slots, dtype=np.int32)
        self._free_slots = list(range(slots - 1, -1, -1))

    def alloc_slot(self) -> int:
        if not self._free_slots:
            n = self.table.shape[0]
            self.table = _grown(self.table, 2 * n, self.table.shape[1])
            self.tokens = _grown(self.tokens, 2 * n, self.tokens.shape[1])
            self.lens = _grown(self.lens, 2 * n)
            self._free_slots = list(range(2 * n - 1, n - 1, -1))
        return self._free_slots.pop()

    def release_slot(self, slot: int) -> None:
        self.table[slot] = PAD
        self.lens[slot] = 0
        self._free_slots.append(slot)

    def ensure(self, blocks: int, block_size: int) -> None:
        """Room for `blocks` table entries (and their tokens) in every row."""
        if blocks > self.table.shape[1]:
            self.table = _grown(self.table, self.table.shape[0], capacity(blocks, self.table.shape[1]))
        if blocks * block_size > self.tokens.shape[1]:
            cols = capacity(blocks * block_size, self.tokens.shape[1])
            self.tokens = _grown(self.tokens, self.tokens.shape[0], cols)

    def blocks(self, slot: int, block_size: int) -> np.ndarray:
        """The sequence's blocks (a view), logical order."""
        nb = -(-int(self.lens[slot]) // block_size)
        return self.table[slot, :nb]


class BatchView:
    """The padded int32 block table and seq_lens of one batch of sequences, kept in
    place across decode steps: a step writes one entry per sequence that crossed into
    a new block (or was copied on write) instead of rebuilding the table.

    Because every append_tokens call on the batch adds exactly one token to each
    sequence, the sequences that cross into a new block at step s are known in advance:
    those whose length is -s modulo block_size. They are grouped once, at build time.
    """

    def __init__(
        self, key: bytes, slots: np.ndarray, store: SlotStore, block_size: int, refcount: np.ndarray
    ):
        self.key = key
        self.slots = slots
        self.n = n = len(slots)
        self.rows = np.arange(n)
        self.lens = store.lens[slots]
        self.maxlen = int(self.lens.max()) if n else 0
        nblocks = -(-self.lens // block_size)
        cols = capacity(max(-(-self.maxlen // block_size), 1), 4)
        self.table = np.zeros((n, cols), dtype=np.int32)
        w = min(cols, store.table.shape[1])
        self.table[:, :w] = store.table[slots, :w]
        # the block the next token goes to unless it crosses into a new one
        self.tail = self.table[self.rows, np.maximum(nblocks - 1, 0)]
        self.any_shared = bool(np.any((refcount[self.tail] > 1) & (self.lens > 0)))
        due = (-self.lens) % block_size  # steps until the next block crossing
        order = np.argsort(due, kind="stable")
        bounds = np.searchsorted(due[order], np.arange(block_size + 1))
        self.crossing = [order[bounds[r] : bounds[r + 1]] for r in range(block_size)]
        self.step = 0
        self._ro_table: np.ndarray | None = None
        self._ro_lens: np.ndarray | None = None

    def ensure_cols(self, n: int) -> None:
        if n > self.table.shape[1]:
            self.table = _grown(self.table, self.n, capacity(n, self.table.shape[1]))
            self._ro_table = None

    def readonly_table(self) -> np.ndarray:
        if self._ro_table is None:
            self._ro_table = self.table.view()
            self._ro_table.flags.writeable = False
        return self._ro_table

    def readonly_lens(self) -> np.ndarray:
        if self._ro_lens is None:
            self._ro_lens = self.lens.view()
            self._ro_lens.flags.writeable = False
        return self._ro_lens
