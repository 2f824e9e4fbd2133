"""Resident thread blocks per SM, by the CUDA occupancy calculator's rules.

The call-time planner (kgen/plan/plan.py, kgen/kernel.py) fills the GPU with as many blocks as it
holds at once; the static performance model (kgen/perf/model.py) uses the same rules for its
estimates. The limits are the arch table's (kgen/plan/arch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.plan.arch import ArchLimits, limits_for


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM
    warps: int  # resident warps per SM
    limiter: str  # registers | shared memory | threads | blocks


def occupancy(threads: int, registers: int, smem_bytes: int, limits: ArchLimits | None = None) -> Occupancy:
    """Resident blocks per SM of a kernel with `threads` per block, `registers` per thread and
    `smem_bytes` of shared memory per block (static + dynamic) on an arch with `limits` (default:
    kgen.plan.arch.DEFAULT_ARCH's); 0 blocks when it cannot launch."""
    limits = limits or limits_for(None)
    warps = -(-threads // 32)
    per_warp = _round_up(max(registers, 1) * 32, limits.reg_alloc_per_warp)
    warps_by_regs = (limits.regs_per_sm // limits.sub_partitions // per_warp) * limits.sub_partitions
    smem = _round_up(smem_bytes, limits.smem_granularity) + limits.smem_reserved_per_block
    by = {
        "registers": warps_by_regs // warps,
        "shared memory": limits.smem_per_sm // smem if smem_bytes <= limits.smem_per_block else 0,
        "threads": limits.max_threads_per_sm // (warps * 32),
        "blocks": limits.max_blocks_per_sm,
    }
    limiter = min(by, key=lambda k: by[k])
    return Occupancy(by[limiter], by[limiter] * warps, limiter)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
