"""The layout rules of docs/architecture.md, checked over the source: no import cycles (imports
inside functions count), imports inside functions only for heavy optional dependencies, no
branching on a kernel kind outside kgen/families/ and kgen/spec/, no comparing families by identity
or reading the cache layout to tell them apart outside kgen/families/ (ask the family's capabilities:
rows, perf_model, fib_kind), and no pointer at a document that is not in the repository."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import kgen.families
from kgen.families.base import FamilyBase
from kgen.families.registry import FAMILIES
from kgen.spec.models import LAYOUTS

ROOT = Path(__file__).resolve().parents[1]
KGEN = ROOT / "kgen"
# ml_dtypes is a required dependency, but its extension module alone takes longer to import than the
# rest of `import kgen` (docs/pipeline.md): kgen.formats.dtypes imports it on first use.
HEAVY = {"torch", "cupy", "cupyx", "ray", "matplotlib", "vllm", "transformers", "ml_dtypes"}
KINDS = tuple(FAMILIES)  # every registered kind: a new family is covered by the rules below


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in KGEN.rglob("*.py")}


def imported_modules(tree: ast.AST, own: str) -> list[tuple[str, ast.AST]]:
    """(kgen module, node) for every import of a kgen module, resolving `from kgen.x import y`
    to kgen.x.y when y is itself a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names if a.name.split(".")[0] == "kgen"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = own.split(".")[: -node.level] if not MODULES[own].name == "__init__.py" else \
                    own.split(".")[: len(own.split(".")) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            if base.split(".")[0] != "kgen":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub if sub in MODULES else base, node))
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {m for m, _ in imported_modules(tree, name) if m in MODULES and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_counting_function_local_imports():
    graph = import_graph()
    # the public API module imports everything; nothing inside kgen may import it back
    importers_of_api = sorted(n for n, deps in graph.items() if "kgen" in deps)
    assert importers_of_api == [], f"modules importing the public API module kgen: {importers_of_api}"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def function_local_imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


def test_imports_inside_functions_only_for_heavy_optional_dependencies():
    bad = []
    for path in MODULES.values():
        for line, mod in function_local_imports(ast.parse(path.read_text())):
            if mod.split(".")[0] not in HEAVY:
                bad.append(f"{path.relative_to(ROOT)}:{line}: import {mod}")
    assert not bad, "imports inside functions:\n" + "\n".join(sorted(set(bad)))


def kind_comparisons(source: str) -> list[int]:
    """Lines that compare against a kind name or branch on `.kind`."""
    lines = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = [o for o in operands if isinstance(o, ast.Constant) and o.value in KINDS]
            containers = [o for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                          and any(isinstance(e, ast.Constant) and e.value in KINDS for e in o.elts)]
            kind_attr = [o for o in operands if isinstance(o, ast.Attribute) and o.attr == "kind"
                         and "spec" in ast.unparse(o.value).lower()]
            if names or containers or kind_attr:
                lines.append(node.lineno)
    return lines


def test_kinds_are_the_registered_families():
    assert {"paged_decode", "paged_prefill", "cache_write", "copy_blocks"} <= set(KINDS)
    assert all(family.kind == k for k in KINDS for family in FAMILIES[k].values())


def test_kind_comparison_detector_sees_the_forms_it_must():
    assert kind_comparisons("x = spec.kind == 'cache_write'\n") == [1]
    assert kind_comparisons("if spec.kind in ('cache_write', 'copy_blocks'): pass\n") == [1]
    assert kind_comparisons("if k != 'paged_decode': pass\n") == [1]
    assert kind_comparisons("x = a == b\n") == []
    assert kind_comparisons("ok = arr.dtype.kind == 'f'\n") == []  # numpy's kind, not a kernel kind


def test_no_kind_branches_outside_families_and_spec():
    bad = []
    files = [p for n, p in MODULES.items() if not n.startswith(("kgen.families", "kgen.spec"))]
    for path in files + sorted((ROOT / "benchmarks").rglob("*.py")):
        bad += [f"{path.relative_to(ROOT)}:{n}" for n in kind_comparisons(path.read_text())]
    assert not bad, "kind comparisons outside kgen/families and kgen/spec (kgen and benchmarks): " + ", ".join(bad)


def family_names() -> tuple[set[str], set[str]]:
    """The names family singletons (PAGED_DECODE, ...) and family classes go by in kgen/families/."""
    singletons, classes = set(), set()
    for info in pkgutil.walk_packages(kgen.families.__path__, "kgen.families."):
        for name, value in vars(importlib.import_module(info.name)).items():
            if isinstance(value, FamilyBase):
                singletons.add(name)
            elif isinstance(value, type) and issubclass(value, FamilyBase):
                classes.add(name)
    return singletons, classes


SINGLETONS, FAMILY_CLASSES = family_names()


def _named(node: ast.AST, names: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr in names)


def _layout_constant(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(map(_layout_constant, node.elts))
    return isinstance(node, ast.Constant) and node.value in LAYOUTS


def identity_comparisons(source: str) -> list[int]:
    """Lines that tell families apart by who they are instead of asking them: a comparison (is, ==, in, ...)
    with a family singleton, isinstance/issubclass against a family class, or a cache layout read as a
    string (`kv_cache.layout == "mla"`; kgen.formats.cache.CacheFormat answers format questions)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            singleton = any(_named(o, SINGLETONS) or (isinstance(o, (ast.Tuple, ast.List, ast.Set))
                                                      and any(_named(e, SINGLETONS) for e in o.elts))
                            for o in operands)
            layout = (any(_named(o, {"layout"}) for o in operands) and any(map(_layout_constant, operands)))
            if singleton or layout:
                lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            cls = node.args[1]
            classes = cls.elts if isinstance(cls, ast.Tuple) else [cls]
            if any(_named(c, FAMILY_CLASSES) for c in classes):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_family_names_are_found():
    assert {"PAGED_DECODE", "PAGED_PREFILL", "CACHE_WRITE", "COPY_BLOCKS"} <= SINGLETONS
    assert {"FamilyBase", "AttentionFamily"} <= FAMILY_CLASSES


def test_identity_detector_flags_planted_comparisons():
    planted = ("from kgen.families.attention.decode import PAGED_DECODE, PagedDecodeFamily\n"
               "a = family_for(spec) is PAGED_DECODE\n"
               "b = family is not registry.MLA_DECODE\n"
               "c = family == PAGED_PREFILL\n"
               "d = family in (PAGED_DECODE, COPY_BLOCKS)\n"
               "e = isinstance(family, PagedDecodeFamily)\n"
               "f = isinstance(family, (int, prefill.PagedPrefillFamily))\n"
               "g = spec.kv_cache.layout == 'mla'\n"
               "h = kv.layout != 'separate'\n"
               "i = layout in ('fused', 'vllm')\n")
    assert identity_comparisons(planted) == list(range(2, 11))


def test_identity_detector_passes_capability_questions():
    fine = ("a = family.perf_model is PerfModel.STREAMING\n"
            "b = family.rows is not None and family.rows.packed\n"
            "c = family.fib_kind == 'gqa_paged_decode'\n"
            "d = isinstance(x, dict)\n"
            "e = CacheFormat.of(spec).mla\n"
            "f = PAGED_DECODE.kernels(spec, config)\n"
            "g = plot.layout == 'tight'\n")
    assert identity_comparisons(fine) == []


# kgen.model_specs writes specs from model configs: the layout is what it chooses, not a family it tells apart
LAYOUT_VOCABULARY = ("kgen.families", "kgen.spec", "kgen.formats", "kgen.model_specs")


def test_no_identity_comparisons_outside_families():
    bad = []
    files = [p for n, p in MODULES.items() if not n.startswith(LAYOUT_VOCABULARY)]
    for path in files + sorted((ROOT / "benchmarks").rglob("*.py")):
        bad += [f"{path.relative_to(ROOT)}:{n}" for n in identity_comparisons(path.read_text())]
    assert not bad, ("families compared by identity or told apart by kv_cache.layout (ask the family: rows, "
                     "perf_model, fib_kind): " + ", ".join(bad))


def path_edits(source: str) -> list[int]:
    """Lines that change sys.path (sys.path.insert/append/extend, or an assignment to sys.path)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) == "sys.path":
            lines.append(node.lineno)
        elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "sys.path" for t in node.targets):
            lines.append(node.lineno)
    return sorted(lines)


def test_module_import_detectors_see_planted_examples():
    assert path_edits("import sys\nsys.path.insert(0, 'benchmarks')\nsys.path = []\nx = 'sys.path.append(1)'\n") == [2, 3]
    assert imported_test_modules("from test_static_perf import needs_sass\nimport test_x as t\nfrom sass_tools import "
                               "listing\nfrom benchmarks import static_perf\n") == [1, 2]


def imported_test_modules(source: str) -> list[int]:
    """Lines importing another test module (test_*.py): shared helpers belong in conftest.py or a helper
    module of tests/."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[-1].startswith("test_") or n.startswith("tests.") for n in names):
            lines.append(node.lineno)
    return lines


def test_scripts_and_tests_import_normally():
    """Benchmark scripts share code through the benchmarks package and tests through tests/ helper modules
    (pytest's pythonpath puts tests/ and the root on the path): no sys.path edits, no test module imported."""
    bad = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")):
        source = path.read_text()
        bad += [f"{path.relative_to(ROOT)}:{n}: sys.path" for n in path_edits(source)]
        if path.is_relative_to(ROOT / "tests"):
            bad += [f"{path.relative_to(ROOT)}:{n}: imports a test module" for n in imported_test_modules(source)]
    assert not bad, "\n".join(bad)


DOC_REF = re.compile(r"\b((?:docs/)?[\w.-]+\.md)\b")
WRITTEN = {"REPORT.md"}  # files kgen writes (`kgen selftest`'s report), not documents it points at


@pytest.mark.parametrize("folder", ["kgen", "templates", "tests", "benchmarks", "docs", "README.md"])
def test_every_referenced_document_is_in_the_repository(folder):
    docs = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    names = {Path(d).name for d in docs}
    target = ROOT / folder
    files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()
                                               and p.suffix in (".py", ".md", ".cuh", ".j2", ".h", ".txt")]
    missing = []
    for f in files:
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for ref in DOC_REF.findall(line):
                if ref in docs or ref in WRITTEN or (ref.startswith("docs/") is False and ref in names):
                    continue
                missing.append(f"{f.relative_to(ROOT)}:{i}: {ref}")
    assert not missing, "references to documents not in the repository:\n" + "\n".join(missing)


def test_families_use_the_judge_never_the_untrusted_source_analysis():
    """kgen/verify/judge is what families use (bounds, bit-exact, guards, reports);
    kgen/verify/untrusted (source policy, preprocessing, C++ text) is `kgen verify --source`'s."""
    graph = import_graph()
    wrong = sorted((m, d) for m, deps in graph.items() if m.startswith("kgen.families")
                   for d in deps if d.startswith("kgen.verify.untrusted"))
    assert not wrong, wrong


def test_decode_and_prefill_share_one_host_side_and_import_no_private_names():
    """Neither attention kind imports the other; both import kgen/families/attention/common.py."""
    graph = import_graph()
    decode, prefill = "kgen.families.attention.decode", "kgen.families.attention.prefill"
    assert prefill not in graph[decode] and decode not in graph[prefill]
    assert "kgen.families.attention.common" in graph[decode] & graph[prefill]
    for path in (MODULES[decode], MODULES[prefill]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kgen"):
                assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.module)


def test_no_family_module_imports_another_modules_private_names():
    """A family module (kgen/families/) takes from another only what that module makes public: what two
    families share lives in a shared module (attention/common.py, pool.py, cache/write_rules.py)."""
    wrong = []
    for name, path in MODULES.items():
        if not name.startswith("kgen.families"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kgen.families"):
                wrong += [(name, node.module, a.name) for a in node.names if a.name.startswith("_")]
    assert not wrong, wrong
