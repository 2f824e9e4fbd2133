"""Where kgen's data files live, in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """templates/ of the checkout, or kgen/_templates inside an installed wheel."""
    for candidate in (_PKG / "_templates", _PKG.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kgen templates not found next to {_PKG}")


def simt_dir() -> Path:
    return templates_dir() / "simt"
