"""Device buffers a layer call fills every step, made once and reused (vLLM on a GPU must not
allocate at every step, and a CUDA graph replays the pointers it captured).

One `StepBuffers` belongs to one metadata builder (so to one KV-cache group and one micro-batch):
its layers run one after another on one stream, and each consumes what it took before the next
layer's call, so one buffer of a name serves them all.
"""

from __future__ import annotations

import math

import torch


class StepBuffers:
    """Buffers by (name, dtype, device), each made at `rows` rows (the scheduler's most tokens a
    step) the first time it is taken, and again larger only when a step needs more."""

    def __init__(self, rows: int) -> None:
        self.rows = max(int(rows), 1)
        self._held: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous `shape` view of buffer `name` (its first dimension: rows); what it held is stale."""
        per_row = math.prod(shape[1:])
        needed = shape[0] * per_row
        key = (name, dtype, torch.device(device))
        held = self._held.get(key)
        if held is None or held.numel() < needed:
            held = self._held[key] = torch.empty(max(shape[0], self.rows) * per_row, dtype=dtype, device=device)
        return held[:needed].view(shape)
