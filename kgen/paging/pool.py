"""Physical blocks of one memory tier: a free stack and per-block reference counts."""

from __future__ import annotations

import numpy as np


class BlockPool:
    """Hands out block ids and counts how many block tables hold each one.

    The free list is a numpy stack so that a decode step takes its k blocks with one
    slice. The pool only knows "free" and "referenced"; cached-but-unreferenced blocks
    are parked by the prefix cache, not here.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        # reversed so that the first blocks handed out are the low ids (easier to read)
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._top = num_blocks

    @property
    def num_free(self) -> int:
        return self._top

    def take(self, k: int) -> np.ndarray:
        """k free blocks (int32) with refcount 1. The caller has checked k <= num_free."""
        out = self._stack[self._top - k : self._top].copy()
        self._top -= k
        self.refcount[out] = 1
        return out

    def put(self, blocks: np.ndarray | list[int]) -> None:
        """Return unreferenced blocks to the free stack."""
        n = len(blocks)
        self._stack[self._top : self._top + n] = blocks
        self._top += n

    def free_blocks(self) -> list[int]:
        return self._stack[: self._top].tolist()
