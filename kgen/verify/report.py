"""What verification produces: one CaseResult per case, gathered in a VerificationReport."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CaseResult:
    name: str
    seq_lens: list[int]
    max_error: float
    bound: float
    lowp_error: float
    passed: bool
    nan_count: int = 0
    first_failure: dict | None = None  # {"sequence", "head", "dim", "got", "expected"}
    note: str = ""


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
        where = first.first_failure or {}
        return (f"{self.spec_name}: FAILED {len(bad)}/{n} cases on {self.backend} (seed {self.seed}); first: "
                f"'{first.name}' error {first.max_error:.3g} > bound {first.bound:.3g}"
                + (f" at sequence {where.get('sequence')}, head {where.get('head')}, dim {where.get('dim')}"
                   if where else "") + (f" ({first.note})" if first.note else ""))

    def to_dict(self) -> dict:
        return {"spec": self.spec_name, "backend": self.backend, "seed": self.seed, "config": self.config,
                "passed": self.passed, "seconds": round(self.seconds, 3),
                "cases": [asdict(c) for c in self.cases]}
