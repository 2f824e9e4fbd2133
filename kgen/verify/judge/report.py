"""What verification produces: one CaseResult per case, gathered in a VerificationReport.

A failed case says where: `first_failure` names the case, the output (or the input or guard
the kernel broke), the sequence, head, its length, the first wrong element, what was expected
and what the kernel wrote; `describe_failure` turns it into one line for the table and summary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CaseResult:
    name: str
    sizes: list[int]  # what the case is made of, in the kind's terms (attention: its sequence lengths)
    max_error: float  # of the worst row (attention: (sequence, head)): the highest error / bound
    bound: float  # that row's bound (bit-exact cases: 0, and max_error counts the wrong elements)
    passed: bool
    nan_count: int = 0
    # {"case", "output", "sequence", "head", "length", "dim", "got", "expected", "error", "bound", ...};
    # a broken input or guard: {"case", "input" or "buffer", ...}
    first_failure: dict | None = None
    note: str = ""
    seconds: float = 0.0  # wall time of the case (inputs, call, reference, checks)

    def fail(self, note: str, where: dict | None = None) -> None:
        """Mark the case failed for a reason beyond its numbers (an input written, a guard broken)."""
        self.passed = False
        self.note = f"{self.note}; {note}" if self.note else note
        if self.first_failure is None and where is not None:
            self.first_failure = {"case": self.name, **where}


def _num(x) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def describe_failure(case: CaseResult) -> str:
    """One line: where the case failed first, and why."""
    f = case.first_failure or {}
    if "got" in f and f.get("head") is not None:
        dim = f", dim {f['dim']}" if f.get("dim") is not None else ""
        text = (f"{f.get('output', 'out')}[sequence {f['sequence']} (length {f.get('length', '?')}), head {f['head']}"
                f"{dim}]: got {_num(f.get('got'))}, expected {_num(f.get('expected'))}")
        if "bound" in f:
            text += f" (error {_num(f.get('error'))} > bound {_num(f['bound'])})"
        if f.get("rows_failed", 1) > 1:
            text += f"; {f['rows_failed']} (sequence, head) rows fail"
    else:
        text = ""
    note = case.note
    return "; ".join(t for t in (text, note) if t)


@dataclass
class VerificationReport:
    spec_name: str
    backend: str
    seed: int
    config: dict
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def failed_cases(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def summary(self) -> str:
        n, bad = len(self.cases), self.failed_cases
        if not bad:
            worst = max(self.cases, key=lambda c: c.max_error / c.bound if c.bound else 0)
            return (f"{self.spec_name}: verified {n}/{n} cases on {self.backend} (seed {self.seed}; "
                    f"worst error {worst.max_error:.3g} vs bound {worst.bound:.3g} in '{worst.name}')")
        first = bad[0]
        worst = (f" (worst (sequence, head): error {first.max_error:.3g} vs its bound {first.bound:.3g})"
                 if first.bound else "")
        return (f"{self.spec_name}: FAILED {len(bad)}/{n} cases on {self.backend} (seed {self.seed}; rerun with "
                f"--seed {self.seed}); first: '{first.name}'{worst}"
                + (f": {describe_failure(first)}" if describe_failure(first) else ""))

    def to_dict(self) -> dict:
        return {"spec": self.spec_name, "backend": self.backend, "seed": self.seed, "config": self.config,
                "passed": self.passed, "seconds": round(self.seconds, 3),
                "cases": [{**asdict(c), "failure": describe_failure(c) if not c.passed else ""}
                          for c in self.cases]}
