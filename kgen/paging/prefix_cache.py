"""Automatic prefix caching: full blocks named by a chained content hash, with LRU eviction.

A block's hash covers its own tokens and, through the parent hash, every token before it,
so equal hashes mean equal KV for the whole prefix. The chain starts from a hash of the
sequence's salt, so sequences with different salts (LoRA ids, images) never share.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

_DIGEST = 16  # 128-bit blake2b: collisions are not a practical concern


def chain_root(salt: str | bytes | None) -> bytes:
    """The parent hash of a sequence's first block."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        salt = salt.encode()
    return hashlib.blake2b(b"salt:" + salt, digest_size=_DIGEST).digest()


def block_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """Hash of one full block; tokens are int32 so their bytes are canonical."""
    return hashlib.blake2b(parent + tokens.tobytes(), digest_size=_DIGEST).digest()


def chain_hashes(parent: bytes, tokens: np.ndarray, block_size: int) -> list[bytes]:
    """Hashes of every full block of `tokens`, chained from `parent`."""
    out = []
    for j in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[j * block_size : (j + 1) * block_size])
        out.append(parent)
    return out


class PrefixCache:
    """Maps content hashes to physical blocks and keeps unreferenced ones evictable.

    A registered block is either in use (refcount > 0, owned by tables) or parked in
    the LRU list (refcount 0), from which the allocator evicts oldest first. Callers
    park a sequence's blocks tail first, so within one chain the tail goes before the
    head (a head without its tail is still useful; a tail without its head is not).
    """

    def __init__(self) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def register(self, block: int, h: bytes) -> bool:
        """Name `block` by `h` unless that content is cached already (the duplicate
        stays private and goes back to the free list when released)."""
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        return True

    def is_cached(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, block: int) -> None:
        """A cached block lost its last reference: most recently used from now on."""
        self.lru[block] = None

    def unpark(self, block: int) -> None:
        """A parked block got a new reference (prefix hit)."""
        del self.lru[block]

    def evict(self, k: int) -> list[int]:
        """Forget the k least recently used parked blocks and return their ids."""
        out = []
        for _ in range(k):
            block, _ = self.lru.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
            out.append(block)
        return out
