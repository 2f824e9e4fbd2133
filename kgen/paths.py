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


def specs_dir() -> Path:
    """specs/ of the checkout (the bundled specs), or kgen/_specs inside an installed wheel."""
    for candidate in (_PKG / "_specs", _PKG.parent / "specs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kgen's bundled specs not found next to {_PKG}")


def source_checkout() -> Path | None:
    """The source checkout kgen runs from (the folder holding tests/ beside kgen/), or None for an
    installed kgen, which carries no tests."""
    root = _PKG.parent
    return root if (root / "tests" / "conftest.py").is_file() and (root / "pyproject.toml").is_file() else None
