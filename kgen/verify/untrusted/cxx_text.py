"""Just enough C++ lexing for the source policy: logical lines with comments removed, and tokens.

Not a parser: it knows comments, string/character literals (raw strings included), line
splices and identifiers, which is what the policy's rules look at.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LogicalLine:
    line: int  # 1-based physical line where it starts
    span: int  # physical lines it covers (line splices and block comments join lines)
    text: str  # comments replaced by a space, splices removed


_LITERAL_START = re.compile(r'(?:u8|u|U|L)?R"|(?:u8|u|U|L)?["\']')


def logical_lines(source: str) -> list[LogicalLine]:
    """Split `source` into logical lines (translation phases 1-3, simplified)."""
    out: list[LogicalLine] = []
    buf: list[str] = []
    start, line = 1, 1
    i, n = 0, len(source)
    in_block = False

    def flush(end_line: int) -> None:
        nonlocal buf, start
        out.append(LogicalLine(start, end_line - start + 1, "".join(buf)))
        buf, start = [], end_line + 1

    while i < n:
        c = source[i]
        if in_block:
            if source.startswith("*/", i):
                in_block, i = False, i + 2
                buf.append(" ")
            else:
                if c == "\n":
                    line += 1
                i += 1
            continue
        if c == "\\" and source.startswith("\n", i + 1):  # line splice
            i, line = i + 2, line + 1
            continue
        if c == "\\" and source.startswith("\r\n", i + 1):
            i, line = i + 3, line + 1
            continue
        if c == "\n":
            flush(line)
            line, i = line + 1, i + 1
            continue
        if source.startswith("//", i):
            while i < n and source[i] != "\n":
                if source[i] == "\\" and source.startswith("\n", i + 1):  # a spliced // comment goes on
                    line += 1
                    i += 1
                i += 1
            buf.append(" ")
            continue
        if source.startswith("/*", i):
            in_block, i = True, i + 2
            continue
        m = _LITERAL_START.match(source, i)
        if m and (i == 0 or not (source[i - 1].isalnum() or source[i - 1] == "_")):
            end = _literal_end(source, m.end(), m.group(0))
            lit = source[i:end]
            buf.append(lit)
            line += lit.count("\n")
            i = end
            continue
        buf.append(c)
        i += 1
    if buf or not out:
        flush(line)
    return out


def _literal_end(source: str, i: int, opener: str) -> int:
    """Index just past the literal whose opener ends at `i`."""
    if opener.endswith('R"'):
        m = re.compile(r'([^()\\\s]{0,16})\(').match(source, i)
        if not m:
            return i
        close = source.find(")" + m.group(1) + '"', m.end())
        return len(source) if close < 0 else close + len(m.group(1)) + 2
    quote = opener[-1]
    n = len(source)
    while i < n and source[i] != quote and source[i] != "\n":
        i += 2 if source[i] == "\\" else 1
    return min(i + 1, n)


@dataclass(frozen=True)
class Token:
    text: str
    kind: str  # "id", "num", "str", "punct"
    line: int  # line in the text it was read from (1-based)


_TOKEN = re.compile(
    r"""(?P<str>(?:u8|u|U|L)?R"(?P<delim>[^()\\\s]{0,16})\(.*?\)(?P=delim)"
              |(?:u8|u|U|L)?"(?:[^"\\\n]|\\.)*"|(?:u8|u|U|L)?'(?:[^'\\\n]|\\.)*')
      |(?P<id>[A-Za-z_$][A-Za-z0-9_$]*)
      |(?P<num>\.?\d(?:[eEpP][+-]|[A-Za-z0-9_.']|)*)
      |(?P<punct>::|->\*?|\.\.\.|<=>|<<=|>>=|[<>=!+\-*/%&|^]=|&&|\|\||\+\+|--|<<|>>|\#\#|\S)""",
    re.S | re.X,
)


def tokenize(text: str) -> list[Token]:
    """Tokens of comment-free text (e.g. preprocessor output), with their 1-based line numbers."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    out = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup if m.lastgroup != "delim" else "str"
        if kind is None:
            continue
        if m.group("str") is not None:
            kind = "str"
        out.append(Token(m.group(0), kind, bisect.bisect_right(starts, m.start())))
    return out
