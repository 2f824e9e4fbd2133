"""What a step is given (Context) and what it hands back (Outcome); both cross a process boundary
as JSON, so a step that crashes or runs out of time still leaves what it had saved."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATUSES = ("passed", "failed", "skipped")


@dataclass
class Context:
    """The run's settings as one step sees them. `deadline`: wall-clock time (time.time()) by which
    the step should have ended on its own (its budget less a margin for writing its result)."""

    backend: str  # "cuda" or "cpu"
    quick: bool
    out_dir: str
    specs: list[str]  # the spec files of the build-and-verify step
    model: str | None  # the checkpoint the vLLM comparison serves (None: a tiny one written here)
    repo: str | None  # the source checkout holding tests/, or None (an installed kgen)
    deadline: float = 0.0
    result_file: str = ""

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def save(self, outcome: Outcome) -> None:
        """Write the outcome so far (atomically): the runner reads it even if the step is killed later."""
        if not self.result_file:
            return
        tmp = f"{self.result_file}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(asdict(outcome), indent=1, default=str))
        os.replace(tmp, self.result_file)


@dataclass
class Outcome:
    """A step's verdict: passed, failed or skipped, the reason (for failed and skipped), and its
    figures (a JSON object; what is in it depends on the step, report.py renders it)."""

    status: str = "passed"
    reason: str = ""
    figures: dict = field(default_factory=dict)

    def fail(self, reason: str) -> Outcome:
        """Mark failed, keeping the first reason and adding later ones."""
        self.status = "failed"
        self.reason = f"{self.reason}; {reason}" if self.reason and reason not in self.reason else reason
        return self

    @classmethod
    def skipped(cls, reason: str, **figures) -> Outcome:
        return cls("skipped", reason, dict(figures))
