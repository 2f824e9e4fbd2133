"""Exceptions of the paged KV-cache manager. All derive from PagingError, a user error:
the call was refused and the manager is exactly as it was before it."""

from __future__ import annotations

from kgen.errors import KgenUserError


class PagingError(KgenUserError):
    """Base of every error raised by kgen.paging."""


class PoolExhausted(PagingError):
    """Not enough GPU blocks, even after evicting every cached block."""

    def __init__(self, needed: int, free: int, evictable: int, what: str = "allocation"):
        self.needed, self.free, self.evictable = needed, free, evictable
        super().__init__(
            f"KV pool exhausted during {what}: needed {needed} blocks, "
            f"{free} free + {evictable} evictable cached"
        )


class SwapSpaceExhausted(PagingError):
    """Not enough CPU (swap tier) blocks to swap a sequence out."""

    def __init__(self, needed: int, free: int):
        self.needed, self.free = needed, free
        super().__init__(f"CPU swap space exhausted: needed {needed} blocks, {free} free")


class UnknownSequence(PagingError, KeyError):
    """A sequence id the manager does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DuplicateSequence(PagingError, ValueError):
    """A sequence id that already exists, or appears twice in one batch."""


class NotResident(PagingError):
    """The sequence lives in the CPU tier; it cannot be handed to a kernel or grown."""


class AlreadyResident(PagingError):
    """swap_in of a sequence that is already on the GPU."""


class CopiesPending(PagingError):
    """Copy-on-write copies must be drained (pending_copies()) before swapping."""


class InvalidTokens(PagingError, TypeError):
    """Tokens or sequence ids of the wrong type, shape or range."""
