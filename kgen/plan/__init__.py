"""Planning a launch on real hardware: the per-arch limits (arch.py), occupancy (occupancy.py),
the split-KV planner both attention kinds share (split.py) and the call-time plan (plan.py).

`from kgen.plan import Plan` keeps working: the plan's names are re-exported here.
"""

from kgen.plan.plan import (
    BLOCKS_PER_SM,
    DEFAULT_SMS,
    DEFAULT_TARGET_BLOCKS,
    Plan,
    PlannedLaunch,
    target_blocks,
)

__all__ = ["BLOCKS_PER_SM", "DEFAULT_SMS", "DEFAULT_TARGET_BLOCKS", "Plan", "PlannedLaunch", "target_blocks"]
