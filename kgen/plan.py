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

DEFAULT_SMS = 132  # H100 / H200 SXM: the SM count a plan fills when there is no GPU to ask


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
    # Scratch arrays of the plan's calls, by (name, device): made at the first call.
    workspace: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False, compare=False)

    def __str__(self) -> str:
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        grids = "; ".join(f"{ln.kernel} grid {ln.grid} block {ln.block[0]}" for ln in self.launches)
        return f"plan for {self.kernel} ({self.num_seqs} sequences, {self.num_sms} SMs: {sizes}): {grids}"
