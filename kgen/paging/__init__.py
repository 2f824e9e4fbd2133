"""Host-side paged KV-cache management: builds the block tables kgen's kernels read.
See docs/paging.md."""

from kgen.paging.errors import (
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
from kgen.paging.manager import KVCacheManager
from kgen.paging.preempt import Preemption, preempt
from kgen.paging.tables import PAD

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
