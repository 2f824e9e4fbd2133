"""The hardware facts kgen relies on, once: per-arch limits of one thread block and one SM.

Everything that decides whether a kernel fits, or how many of its blocks a GPU holds, reads
them from here: the families' geometry (decode's static shared memory, prefill's dynamic
shared memory), the occupancy calculator (kgen/plan/occupancy.py) and the planner, the
tuner's resource check (kgen/tune/measure.py), the CUDA launcher's opt-in to large dynamic
shared memory (kgen/runtime/cuda.py) and the launch-contract check against the cubin
(kgen/compile/launch_contract.py).

Source: CUDA C++ Programming Guide, "Compute Capabilities", table "Technical
Specifications per Compute Capability" (and cudaDeviceProp: sharedMemPerBlock,
sharedMemPerBlockOptin, sharedMemPerMultiprocessor, regsPerBlock, ...).
An arch not listed is treated as sm_90 (ARCH_LIMITS["sm_90"]); `limits_for` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class ArchLimits:
    """Limits of one compute capability (the defaults are sm_90's)."""

    # shared memory
    static_smem_per_block: int = 48 * KIB  # sharedMemPerBlock: static, and dynamic without the opt-in attribute
    smem_per_block: int = 227 * KIB  # sharedMemPerBlockOptin: static + dynamic with the opt-in attribute
    smem_per_sm: int = 228 * KIB  # sharedMemPerMultiprocessor
    smem_reserved_per_block: int = 1 * KIB  # the runtime's per-block reservation (sm_80 and newer)
    smem_granularity: int = 128  # allocation unit of shared memory per block
    # registers
    regs_per_thread: int = 255
    regs_per_block: int = 64 * KIB  # regsPerBlock: registers x threads of one block
    regs_per_sm: int = 64 * KIB
    sub_partitions: int = 4  # registers are allocated per SM sub-partition
    reg_alloc_per_warp: int = 256  # allocation granularity: 8 registers per thread
    # threads and blocks
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    # what a plan fills when there is no GPU to ask (the flagship part of the arch)
    sm_count: int = 132  # H100 / H200 SXM

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32

    @property
    def dynamic_smem_default(self) -> int:
        """Dynamic shared memory a launch gets without the opt-in attribute (static smem of 0)."""
        return self.static_smem_per_block


ARCH_LIMITS: dict[str, ArchLimits] = {
    "sm_80": ArchLimits(smem_per_block=163 * KIB, smem_per_sm=164 * KIB, sm_count=108),  # A100
    "sm_86": ArchLimits(smem_per_block=99 * KIB, smem_per_sm=100 * KIB, max_threads_per_sm=1536,
                        max_blocks_per_sm=16, sm_count=84),  # A40 / RTX 3090
    "sm_89": ArchLimits(smem_per_block=99 * KIB, smem_per_sm=100 * KIB, max_threads_per_sm=1536,
                        max_blocks_per_sm=24, sm_count=142),  # L40S
    "sm_90": ArchLimits(sm_count=132),  # H100 / H200 SXM
    "sm_100": ArchLimits(sm_count=148),  # B200
    "sm_120": ArchLimits(smem_per_block=99 * KIB, smem_per_sm=100 * KIB, max_threads_per_sm=1536,
                         max_blocks_per_sm=32, sm_count=170),  # RTX 5090
}
DEFAULT_ARCH = "sm_90"  # what an arch-free plan assumes (kern.plan without a GPU)
DEFAULT_SMS = ARCH_LIMITS[DEFAULT_ARCH].sm_count


def limits_for(arch: str | None) -> ArchLimits:
    """The limits of `arch` ("sm_80"); an arch not in the table (or None) gets DEFAULT_ARCH's."""
    return ARCH_LIMITS.get(arch or DEFAULT_ARCH, ARCH_LIMITS[DEFAULT_ARCH])


def static_smem_limit(archs) -> int:
    """Static shared memory one block may declare on every arch of `archs` (48 KiB on all)."""
    return min(limits_for(a).static_smem_per_block for a in archs or [DEFAULT_ARCH])


def smem_limit(archs) -> int:
    """Shared memory (static + opted-in dynamic) one block may use on every arch of `archs`
    (a spec's targets; none: sm_80's, the oldest arch kgen builds for by default)."""
    return min(limits_for(a).smem_per_block for a in archs or ["sm_80"])


def launch_problems(arch: str, kernel: str, threads: int, registers: int, static_smem: int,
                    dynamic_smem: int, launch_registers: int = 0) -> list[str]:
    """Why one launch of `kernel` (ptxas figures `registers` per thread and `static_smem` bytes;
    `threads` per block and `dynamic_smem` bytes at launch) cannot run on `arch`, as kgen's CUDA
    launcher launches it: it opts in to dynamic shared memory past the default
    (kgen/runtime/cuda.py), so the bound is the opt-in limit of static + dynamic. `launch_registers`
    (KernelDecl's): the exact count the code's setmaxnreg split assumes. [] when it can."""
    lim = limits_for(arch)
    out = []
    if launch_registers and registers != launch_registers:
        out.append(f"{arch}: {kernel}: {registers} registers per thread at launch, but its setmaxnreg split "
                   f"counts on exactly {launch_registers} (with fewer the warpgroups' registers cannot be moved)")
    if threads > lim.max_threads_per_block:
        out.append(f"{arch}: {kernel}: {threads} threads per block > {lim.max_threads_per_block}")
    if registers > lim.regs_per_thread:
        out.append(f"{arch}: {kernel}: {registers} registers per thread > {lim.regs_per_thread}")
    if registers * threads > lim.regs_per_block:
        out.append(f"{arch}: {kernel}: {registers} registers x {threads} threads > {lim.regs_per_block} per block")
    if static_smem > lim.static_smem_per_block:
        out.append(f"{arch}: {kernel}: {static_smem} bytes of static shared memory > {lim.static_smem_per_block}")
    if static_smem + dynamic_smem > lim.smem_per_block:
        out.append(f"{arch}: {kernel}: {static_smem} + {dynamic_smem} bytes of shared memory (static + dynamic) > "
                   f"{lim.smem_per_block}, the arch's opt-in limit per block")
    return out
