"""Fresh random seeds: one rule for every run that draws its own (verification, tuning).

A seed is drawn from the OS's entropy and reported with the run, so any run can be
repeated exactly by passing its seed back.
"""

from __future__ import annotations

import numpy as np


def fresh_seed() -> int:
    """A new seed in [0, 2**63): fits an int64 and every numpy generator."""
    return int(np.random.SeedSequence().entropy % (2**63))
