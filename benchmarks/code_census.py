"""Code census of the device code and the host package: lines per kernel body and per shared attention
part, and the runs of six or more lines that stand in two places or more in templates/ and in kgen/.

    PYTHONPATH=. python benchmarks/code_census.py [--rev REV] [--min-lines 6] [--most 10] [--json]

Bodies are templates/common/paged_*.cuh (each file's lines, its code lines, and the lines of each
`*_body` function and of MLA's shared `mla_*attend`, from its signature to its closing brace); shared parts are
templates/common/attention/*.cuh. `--rev` reads the files as they were at a git revision (the
figures "before" a change) instead of the working tree.

Repeated runs are counted here, by this script, as exact repeats: a line is kept when it is code
(blank lines, comments, docstrings, lone punctuation and include/import lines are passed over) and
compared with white space folded; every window of `--min-lines` kept lines that stands at two places
or more (in one file or two) marks its lines, and a run is a stretch of marked lines in one file.
Each place counts: a block written twice is two runs. Lines alike but for their names are not
counted (a shape-aware duplicate finder would list more).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_SUFFIXES = (".py", ".cuh", ".h", ".cu", ".j2", ".cpp")
_PUNCT = re.compile(r"^[\s{}()\[\];,:]*$")
_IMPORT = re.compile(r"^(import\s|from\s+\S+\s+import\s|#\s*include\b|#\s*pragma\s+once\b)")
_BODY = re.compile(r"^[^\n;{}]*?\b(\w+_body|mla_\w*attend)\s*\(", re.M)  # MLA's bodies share mla_*attend


@dataclass(frozen=True)
class Run:
    path: str
    first: int  # 1-based source lines
    last: int
    lines: int  # kept (code) lines in the run


def tree_files(folders: tuple[str, ...], rev: str | None = None, root: Path = ROOT) -> dict[str, str]:
    """{path relative to root: text} of the code files under `folders`, from the working tree or `rev`."""
    if rev is None:
        return {str(p.relative_to(root)): p.read_text(errors="replace") for f in folders
                for p in sorted((root / f).rglob("*")) if p.is_file() and p.name.endswith(CODE_SUFFIXES)
                and "__pycache__" not in p.parts}
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", rev, "--", *folders],
                           check=True, capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "-C", str(root), "show", f"{rev}:{n}"], check=True, capture_output=True,
                              text=True, errors="replace").stdout
            for n in names if n.endswith(CODE_SUFFIXES)}


def code_lines(text: str, python: bool) -> list[tuple[int, str]]:
    """(1-based line number, line with white space folded) of each code line of `text`."""
    out, in_doc, in_block, in_import = [], False, False, False
    for n, raw in enumerate(text.splitlines(), 1):
        line = " ".join(raw.split())
        if python:
            quotes = line.count('"""') + line.count("'''")
            if in_doc or (quotes and line.lstrip("rbuRBU").startswith(('"""', "'''"))):
                in_doc = in_doc != (quotes % 2 == 1)  # a one-line docstring opens and closes
                continue
            if in_import or (_IMPORT.match(line) and line.endswith("(")):  # a parenthesised import list
                in_import = ")" not in line
                continue
            if line.startswith("#"):
                continue
        else:
            if in_block:
                in_block = "*/" not in line
                continue
            if line.startswith("/*"):
                in_block = "*/" not in line
                continue
            if line.startswith(("//", "{#")):
                continue
        if not line or _PUNCT.match(line) or _IMPORT.match(line):
            continue
        out.append((n, line))
    return out


def repeated_runs(files: dict[str, str], min_lines: int = 6) -> list[Run]:
    """The runs of `min_lines` or more code lines of `files` that stand at two places or more."""
    kept = {p: code_lines(t, p.endswith(".py")) for p, t in files.items()}
    where: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path, lines in kept.items():
        for i in range(len(lines) - min_lines + 1):
            where[tuple(text for _, text in lines[i:i + min_lines])].append((path, i))
    marked: dict[str, set[int]] = defaultdict(set)
    for places in where.values():
        if len(places) > 1:
            for path, i in places:
                marked[path].update(range(i, i + min_lines))
    runs = []
    for path, idx in marked.items():
        order = sorted(idx)
        start = prev = order[0]
        for i in [*order[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(Run(path, kept[path][start][0], kept[path][prev][0], prev - start + 1))
            if i is not None:
                start = prev = i
    return sorted(runs, key=lambda r: (-r.lines, r.path, r.first))


def body_functions(text: str) -> dict[str, int]:
    """{name: lines} of each `*_body` or `mla_*attend` function defined in `text` (signature to
    closing brace)."""
    out = {}
    for m in _BODY.finditer(text):
        opening = text.find("{", m.end())
        semicolon = text.find(";", m.end())
        if opening < 0 or (0 <= semicolon < opening and text[m.end():semicolon].count(")") > 0
                           and "{" not in text[m.end():semicolon]):
            continue  # a call or a declaration, not a definition
        depth, i = 0, opening
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = text.count("\n", m.start(), i) + 1
    return out


def census(rev: str | None = None, min_lines: int = 6, root: Path = ROOT) -> dict:
    templates = tree_files(("templates",), rev, root)
    host = tree_files(("kgen",), rev, root)

    def sizes(pattern: str) -> dict[str, dict]:
        return {p: {"lines": len(t.splitlines()), "code_lines": len(code_lines(t, False)),
                    "bodies": body_functions(t)}
                for p, t in sorted(templates.items()) if re.fullmatch(pattern, p)}

    return {"rev": rev or "working tree", "min_lines": min_lines,
            "bodies": sizes(r"templates/common/paged_\w+\.cuh"),
            "parts": sizes(r"templates/common/attention/\w+\.cuh"),
            "repeats": {name: [asdict(r) for r in repeated_runs(files, min_lines)]
                        for name, files in (("templates/", templates), ("kgen/", host))}}


def report(c: dict, most: int) -> str:
    out = [f"code census of {c['rev']}", ""]
    for title, rows in (("kernel bodies (templates/common/paged_*.cuh)", c["bodies"]),
                        ("shared attention parts (templates/common/attention/*.cuh)", c["parts"])):
        out.append(f"{title}: file lines, code lines; body functions' lines")
        for path, s in rows.items():
            funcs = ", ".join(f"{n} {k}" for n, k in s["bodies"].items())
            out.append(f"  {path:48s} {s['lines']:5d} {s['code_lines']:5d}  {funcs}")
        out.append(f"  {'total':48s} {sum(s['lines'] for s in rows.values()):5d} "
                   f"{sum(s['code_lines'] for s in rows.values()):5d}")
        out.append("")
    for folder, runs in c["repeats"].items():
        out.append(f"repeated runs of {c['min_lines']}+ code lines in {folder}: {len(runs)} runs (places), "
                   f"{sum(r['lines'] for r in runs)} code lines, in {len({r['path'] for r in runs})} files")
        out += [f"  {r['lines']:4d}  {r['path']}:{r['first']}-{r['last']}" for r in runs[:most]]
        if len(runs) > most:
            out.append(f"  (+{len(runs) - most} more)")
        out.append("")
    return "\n".join(out).rstrip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="a git revision to read instead of the working tree")
    ap.add_argument("--min-lines", type=int, default=6, help="shortest repeated run counted (default 6)")
    ap.add_argument("--most", type=int, default=10, help="longest runs listed per folder (default 10)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.min_lines < 2:
        ap.error(f"--min-lines must be 2 or more (got {a.min_lines})")
    c = census(a.rev, a.min_lines)
    print(json.dumps(c, indent=1) if a.json else report(c, a.most))


if __name__ == "__main__":
    main()
