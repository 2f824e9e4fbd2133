"""Preprocess a kernel source once, with g++, so that NVRTC and g++ compile the same text.

`g++ -E -undef -nostdinc`: no predefined macro says which compiler is reading, no include
path exists, and every user conditional and macro is resolved here, once. The caller holds
`#include` lines out beforehand (they come back afterwards, untouched) and poisons the
identifiers a source must not use (`#pragma GCC poison`), so a use of them, directly or
through a macro or token pasting, is an error that names the line.

g++ runs in an empty scratch directory with the text on stdin and without caret snippets,
so it opens no file of the user's.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from kgen.compile.host import compiler
from kgen.errors import CompileError, ToolchainError

E_FLAGS = ("-std=c++17", "-E", "-undef", "-nostdinc", "-w", "-fno-diagnostics-show-caret",
           "-fdiagnostics-color=never", "-x", "c++", "-")
# The macros g++ predefines under the flags kgen compiles kernels with (minus the standard ones
# -undef keeps): none of them may appear in a kernel source.
_DM_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-pthread", "-dM", "-E", "-x", "c++", os.devnull)


@functools.lru_cache(maxsize=4)
def _predefined(cxx: str, mtime: float) -> frozenset[str]:
    def names(flags) -> set[str]:
        try:
            res = subprocess.run([cxx, *flags], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        except OSError as e:
            raise ToolchainError(f"C++ compiler {cxx!r} cannot run: {e}") from e
        return set(re.findall(r"^#define (\w+)", res.stdout, re.M))

    return frozenset(names(_DM_FLAGS) - names((*_DM_FLAGS[:1], "-undef", *_DM_FLAGS[4:])))


def _compiler() -> str:
    try:
        return compiler()
    except ToolchainError as e:
        raise ToolchainError(f"{e} (kgen verify --source preprocesses every kernel source with it, on either "
                             "backend)") from None


def compiler_predefined_macros() -> frozenset[str]:
    cxx = _compiler()
    return _predefined(cxx, os.path.getmtime(cxx))


@dataclass(frozen=True)
class Preprocessed:
    lines: list[tuple[int, str]]  # (line in the user's file, text) of every output line
    diagnostics: list[tuple[int, str]]  # (line, g++'s error message); empty on success


_MARKER = re.compile(r'^# (\d+) "((?:[^"\\]|\\.)*)"')
_DIAG = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<msg>.*)$")


def preprocess(text: str, name: str, poison: list[str]) -> Preprocessed:
    """Run g++ -E over `text` (file name `name` in diagnostics) with `poison`ed identifiers."""
    prelude = f"#pragma GCC poison {' '.join(poison)}\n" if poison else ""
    stdin = f'{prelude}#line 1 "{name}"\n{text}'
    with tempfile.TemporaryDirectory(prefix="kgen-pp-") as scratch:
        try:
            res = subprocess.run([_compiler(), *E_FLAGS], input=stdin, capture_output=True, text=True,
                                 cwd=scratch, timeout=120, env={"LC_ALL": "C"})  # g++ by absolute path: no PATH
        except OSError as e:
            raise ToolchainError(f"C++ compiler cannot run: {e}") from e
        except subprocess.TimeoutExpired as e:
            raise CompileError(f"{name}: preprocessing took longer than 120 s") from e
    diagnostics = [(int(m["line"]), m["msg"]) for m in map(_DIAG.match, res.stderr.splitlines())
                   if m and m["file"] == name]
    if res.returncode != 0 and not diagnostics:
        raise CompileError(f"{name}: g++ -E failed:\n{res.stderr.strip()[-2000:]}")
    lines: list[tuple[int, str]] = []
    current, line = None, 0
    for out in res.stdout.splitlines():
        if m := _MARKER.match(out):
            current, line = m[2], int(m[1])
            continue
        if current == name:
            lines.append((line, out))
        line += 1
    return Preprocessed(lines, diagnostics)
