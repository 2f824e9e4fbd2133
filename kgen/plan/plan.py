"""A call-time launch plan (docs/abi.md, "Plans"): made on the host once, reused by calls.

`kern.plan(seq_lens)` fixes what a call would otherwise decide from the lengths: the
split-KV partition size and the grid. `kern(..., plan=plan)` then only packs pointers: no
value checks (unless debug), no planning, no device synchronisation, and the split-KV
scratch comes from the plan (allocated at its first call, reused after), so the call can
be captured in a CUDA graph. A plan made for the largest batch serves any call with at
most its number of sequences; lengths past the ones planned for are still computed
correctly (the last partition takes the rest), just with less parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kgen.plan.arch import (
    DEFAULT_SMS,  # the SM count a plan fills when there is no GPU to ask (sm_90's)
)

BLOCKS_PER_SM = 2  # the least a plan aims for per SM, where the work allows; and the resident
#                    blocks per SM assumed when a kernel's ptxas figures are unknown
DEFAULT_TARGET_BLOCKS = DEFAULT_SMS * BLOCKS_PER_SM


def target_blocks(num_sms: int, resident_blocks: int) -> int:
    """Thread blocks with work a split-KV plan aims for on a GPU with `num_sms` SMs that holds
    `resident_blocks` of the kernel's blocks at once: a quarter of those (in the static model of
    docs/performance.md that keeps enough bytes in flight, and each further partition costs its
    partial results and their merge), at least BLOCKS_PER_SM per SM, at most one wave."""
    return min(resident_blocks, max(BLOCKS_PER_SM * num_sms, resident_blocks // 4))


@dataclass(frozen=True)
class PlannedLaunch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int  # dynamic shared memory


@dataclass
class Plan:
    kernel: str  # the spec name of the kernel it was made for
    num_seqs: int  # calls may have up to this many sequences
    sizes: dict[str, int]  # the launch sizes it fixes (e.g. partition_tokens, max_partitions)
    launches: list[PlannedLaunch]  # in launch order, for num_seqs sequences
    num_sms: int  # the SM count it filled
    resident_blocks: int  # blocks of the main kernel that GPU holds at once (kgen/plan/occupancy.py)
    target_blocks: int  # blocks with work the split aimed for (target_blocks)
    # Scratch arrays of the plan's calls, flat, by (name, device, index): made at the first call,
    # grown when a call needs more (kern.plan(..., workspace=) shares one dict between plans).
    workspace: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False, compare=False)

    def __str__(self) -> str:
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        grids = "; ".join(f"{ln.kernel} grid {ln.grid} block {ln.block[0]}" for ln in self.launches)
        return (f"plan for {self.kernel} ({self.num_seqs} sequences, {self.num_sms} SMs holding "
                f"{self.resident_blocks} blocks, aiming for {self.target_blocks}: {sizes}): {grids}")
