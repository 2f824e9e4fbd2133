"""Follow `#line` directives: which line of a compiled text a diagnostic's (file, line) names.

A hand-written kernel is compiled as kgen's preprocessed text with `#line N "file"`
directives, so both compilers report the user's file and line; the error formatters use
this to show the text at that place.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_LINE = re.compile(r'^\s*#\s*line\s+(\d+)(?:\s+"((?:[^"\\]|\\.)*)")?\s*$')


def display_name(source: str) -> str | None:
    """The file name of the first `#line` directive, if the text starts with one."""
    first = source.split("\n", 1)[0]
    m = _LINE.match(first)
    return m[2] if m and m[2] else None


def numbered_lines(source: str, main_name: str) -> Iterator[tuple[str, int, str]]:
    """(file, line, text) of each line of `source` as the compiler numbers it, the directives left out
    (`main_name`: the text's own name, until a directive names another)."""
    cur_file, cur = main_name, 1
    for text in source.splitlines():
        m = _LINE.match(text)
        if m:
            cur = int(m[1])
            cur_file = m[2] if m[2] is not None else cur_file
            continue
        yield cur_file, cur, text
        cur += 1


def source_line(source: str, file: str, line: int, main_name: str) -> str | None:
    """The text at (`file`, `line`) as the compiler numbers it (`main_name`: the text's own name)."""
    return next((text for f, n, text in numbered_lines(source, main_name) if n == line and f == file), None)


def find_word(source: str, word: str, main_name: str) -> tuple[str, int] | None:
    """(file, line) of the first line that holds `word` as a whole word (in code or a string)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])")
    return next(((f, n) for f, n, text in numbered_lines(source, main_name) if pattern.search(text)), None)
