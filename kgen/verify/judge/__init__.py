"""The judge the families use (docs/verification.md): the derived error bound of floating-point
outputs (bounds.py), bit-exact comparison (bitexact.py), tripwires around a call (guards.py),
arrays far larger than the memory a case touches (sparse.py), and what verification produces
(report.py)."""
