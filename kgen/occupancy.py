"""Resident thread blocks per SM, by the CUDA occupancy calculator's rules.

The call-time planner (kgen/plan.py) fills the GPU with as many blocks as it holds at once;
benchmarks/perf_model.py uses the same rules for its estimates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    regs_per_sm: int = 65536
    sub_partitions: int = 4  # registers are allocated per SM sub-partition
    reg_alloc_per_warp: int = 256  # allocation granularity: 8 registers per thread
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    smem_per_block: int = 227 * 1024
    smem_reserved_per_block: int = 1024  # the runtime's per-block reservation on sm_80+
    smem_granularity: int = 128


# Per compute capability (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"); an arch not listed plans with sm_90's.
SM_LIMITS = {
    "sm_80": SmLimits(smem_per_sm=164 * 1024, smem_per_block=163 * 1024),
    "sm_86": SmLimits(max_threads_per_sm=1536, max_blocks_per_sm=16, smem_per_sm=100 * 1024,
                      smem_per_block=99 * 1024),
    "sm_89": SmLimits(max_threads_per_sm=1536, max_blocks_per_sm=24, smem_per_sm=100 * 1024,
                      smem_per_block=99 * 1024),
    "sm_90": SmLimits(),
    "sm_100": SmLimits(),
    "sm_120": SmLimits(max_threads_per_sm=1536, max_blocks_per_sm=32, smem_per_sm=100 * 1024,
                       smem_per_block=99 * 1024),
}


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM
    warps: int  # resident warps per SM
    limiter: str  # registers | shared memory | threads | blocks


def occupancy(threads: int, registers: int, smem_bytes: int, limits: SmLimits = SM_LIMITS["sm_90"]) -> Occupancy:
    """Resident blocks per SM of a kernel with `threads` per block, `registers` per thread and
    `smem_bytes` of shared memory per block (static + dynamic); 0 blocks when it cannot launch."""
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
