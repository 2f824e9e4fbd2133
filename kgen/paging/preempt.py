"""Preemption: make room in the GPU pool by evicting running sequences, newest first
(the oldest requests have waited longest and hold the most finished work)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from kgen.paging.errors import PagingError
from kgen.paging.manager import KVCacheManager


@dataclass
class Preemption:
    """What preempt() did. The engine must requeue `freed` sequences for recomputation
    and run `copies` (GPU -> CPU block copies, in order) for the `swapped` ones."""

    swapped: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    satisfied: bool = False  # num_available_blocks() >= blocks_needed afterwards


def preempt(
    mgr: KVCacheManager,
    blocks_needed: int,
    *,
    mode: Literal["swap", "recompute"] = "swap",
    protect: Iterable[int] = (),
) -> Preemption:
    """Preempt resident sequences, newest first, until `blocks_needed` GPU blocks are
    available. mode="swap" swaps a victim to the CPU tier when it fits there and frees
    it otherwise; mode="recompute" always frees. Sequences in `protect` are spared.
    Stops early when satisfied; `satisfied` is False if every candidate went and it
    still was not enough (a victim whose blocks are all shared frees nothing)."""
    if mode not in ("swap", "recompute"):
        raise PagingError(f"preempt mode must be 'swap' or 'recompute', got {mode!r}")
    spared = set(protect)
    out = Preemption()
    for sid in mgr.newest_first():
        if mgr.num_available_blocks() >= blocks_needed:
            break
        if sid in spared:
            continue
        if mode == "swap" and mgr.num_blocks_of(sid) <= mgr.num_free_cpu_blocks():
            out.copies += mgr.swap_out(sid)
            out.swapped.append(sid)
        else:
            mgr.free(sid)
            out.freed.append(sid)
    out.satisfied = mgr.num_available_blocks() >= blocks_needed
    return out
