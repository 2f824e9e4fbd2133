"""The per-arch limits table (kgen/plan/arch.py): its figures, the launch check built on it, and
that no other module of kgen restates a hardware limit."""

from __future__ import annotations

import re
from pathlib import Path

from kgen.plan.arch import (
    ARCH_LIMITS,
    DEFAULT_SMS,
    launch_problems,
    limits_for,
    smem_limit,
    static_smem_limit,
)
from kgen.plan.occupancy import occupancy

ROOT = Path(__file__).resolve().parents[2]
KIB = 1024


def test_the_table_has_the_programming_guide_figures():
    a100, h100 = ARCH_LIMITS["sm_80"], ARCH_LIMITS["sm_90"]
    assert (a100.static_smem_per_block, a100.smem_per_block, a100.smem_per_sm) == (48 * KIB, 163 * KIB, 164 * KIB)
    assert (h100.static_smem_per_block, h100.smem_per_block, h100.smem_per_sm) == (48 * KIB, 227 * KIB, 228 * KIB)
    assert ARCH_LIMITS["sm_89"].smem_per_block == 99 * KIB and ARCH_LIMITS["sm_89"].max_warps_per_sm == 48
    for lim in ARCH_LIMITS.values():
        assert lim.regs_per_block == lim.regs_per_sm == 65536 and lim.regs_per_thread == 255
        assert lim.max_threads_per_block == 1024
    assert DEFAULT_SMS == 132 and limits_for("sm_75") is limits_for(None) is ARCH_LIMITS["sm_90"]


def test_spec_limits_are_the_least_over_the_targets():
    assert smem_limit(["sm_80", "sm_90"]) == 163 * KIB and smem_limit(["sm_90"]) == 227 * KIB
    assert smem_limit(["sm_89", "sm_90"]) == 99 * KIB and smem_limit([]) == 163 * KIB
    assert static_smem_limit(["sm_80", "sm_90"]) == 48 * KIB


def test_launch_problems_follow_the_opt_in_rules():
    assert launch_problems("sm_80", "k", 128, 96, 0, 87_040) == []  # past 48 KiB: the launcher opts in
    assert launch_problems("sm_90", "k", 128, 96, 1024, 227 * KIB - 1024) == []
    over = launch_problems("sm_80", "k", 128, 96, 1024, 163 * KIB)
    assert over == [f"sm_80: k: 1024 + {163 * KIB} bytes of shared memory (static + dynamic) > {163 * KIB}, "
                    "the arch's opt-in limit per block"]
    assert launch_problems("sm_90", "k", 1024, 65, 0, 0) == ["sm_90: k: 65 registers x 1024 threads > 65536 per block"]
    assert "static shared memory" in launch_problems("sm_90", "k", 32, 32, 48 * KIB + 16, 0)[0]
    assert "threads per block" in launch_problems("sm_90", "k", 2048, 16, 0, 0)[0]
    # a setmaxnreg split counts on an exact allocation at launch: fewer (or more) is a problem
    assert launch_problems("sm_90", "k", 384, 168, 0, 0, launch_registers=168) == []
    (short,) = launch_problems("sm_90", "k", 384, 160, 0, 0, launch_registers=168)
    assert short.startswith("sm_90: k: 160 registers per thread at launch") and "exactly 168" in short


def test_occupancy_reads_the_table():
    assert occupancy(128, 32, 0, limits_for("sm_90")).blocks == 16  # threads: 2048 / 128
    assert occupancy(128, 32, 0, limits_for("sm_89")).blocks == 12  # 1536 / 128
    assert occupancy(128, 32, 100 * KIB, limits_for("sm_89")).blocks == 0  # past the 99 KiB per block


def test_no_other_module_restates_a_limit():
    """48 KiB, 99/163/227 KiB and 65,536 registers are written in kgen/plan/arch.py only."""
    pattern = re.compile(r"\b(48|99|163|164|227|228) \* 1024\b|\b(49152|101376|166912|232448|65536|65_536)\b")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "kgen").rglob("*.py")) if p.name != "arch.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
