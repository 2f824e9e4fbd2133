"""Host-side paged KV-cache management: builds the block tables kgen's kernels read.
See docs/paging.md."""

from .errors import (
    AlreadyResident,
    CopiesPending,
    DuplicateSequence,
    InvalidTokens,
    NotResident,
    PagingError,
    PoolExhausted,
    SwapSpaceExhausted,
    UnknownSequence,
)
from .manager import KVCacheManager
from .preempt import Preemption, preempt
from .tables import PAD

__all__ = [
    "PAD",
    "AlreadyResident",
    "CopiesPending",
    "DuplicateSequence",
    "InvalidTokens",
    "KVCacheManager",
    "NotResident",
    "PagingError",
    "PoolExhausted",
    "Preemption",
    "SwapSpaceExhausted",
    "UnknownSequence",
    "preempt",
]
