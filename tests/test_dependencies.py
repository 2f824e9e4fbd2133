"""Every third-party module kgen imports (function-local imports included) is declared in pyproject.toml:
a dependency, or an extra other than `test` (the test extra is not what users install)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))


def _imported_modules() -> dict[str, str]:
    """{top-level module: a file importing it} over kgen/, the standard library and kgen left out (kgen's
    own files too where a script imports a sibling by name: the isolated children import _wire so)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "kgen").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                sibling = (path.parent / f"{top}.py").is_file()
                if top not in sys.stdlib_module_names and top != "kgen" and not sibling:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    """Distributions pyproject declares for users, and those they require in turn (pydantic -> pydantic-core)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = {_requirement_name(r) for r in project["dependencies"]}
    for extra, requirements in project["optional-dependencies"].items():
        if extra != "test":
            direct |= {_requirement_name(r) for r in requirements}
    declared = set(direct)
    for name in direct:
        try:
            declared |= {_requirement_name(r) for r in importlib.metadata.requires(name) or []}
        except importlib.metadata.PackageNotFoundError:
            pass
    return declared


def test_every_imported_package_is_declared():
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = []
    for module, where in _imported_modules().items():
        candidates = {_normalize(d) for d in distributions.get(module, [module])}
        if not candidates & declared:
            missing.append(f"{module} (imported by {where}; distribution {', '.join(sorted(candidates))})")
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)
