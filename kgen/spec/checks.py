"""Field checks of the spec models, each wording its own message (`what (got X; allowed: …)`),
so users never see pydantic's phrasing; plus the C-name and constraint-expression rules that
keep spec values from injecting text into generated C++."""

from __future__ import annotations

import ast
import difflib
import json
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, get_args

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

INT32_MAX = 2**31 - 1
_F32_MIN, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # normal fp32 range
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_NAME_RULE = "a letter or _, then letters, digits or _, at most 64 characters"
# C23 and C++20 keywords; _Keywords are caught by the reserved-prefix rule.
C_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t
    class compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
    decltype default delete do double dynamic_cast else enum explicit export extern false float for friend
    goto if inline int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private
    protected public register reinterpret_cast requires restrict return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try typedef typeid
    typename typeof typeof_unqual union unsigned using virtual void volatile wchar_t while xor xor_eq
""".split())


# ---------------------------------------------------------------- message helpers

def _show(v: object) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif v is None:
        s = "null"
    elif isinstance(v, str | int | float):
        s = repr(v)
    else:
        s = json.dumps(v, default=str) if isinstance(v, list | dict) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _kind(v: object) -> str:
    if isinstance(v, bool):
        return "true/false"
    kinds = {type(None): "null", str: "a string", int: "an integer", float: "a number", list: "a list",
             tuple: "a list", dict: "a mapping"}
    return kinds.get(type(v), f"a {type(v).__name__}")


def _suggest(word: str, choices: Iterable[str]) -> str:
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def _fail(what: str, got: object, allowed: str) -> NoReturn:
    # "{msg}" keeps braces in user values away from pydantic's template formatting.
    raise PydanticCustomError("kgen", "{msg}", {"msg": f"{what} (got {_show(got)}; allowed: {allowed})"})


def _quoted_hint(v: object) -> str:
    """YAML 1.1 reads `1e-3` (no dot) and quoted numbers as text: say so."""
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return ""
        dot = ", and write exponents with a dot (1.0e-3)" if "e" in v.lower() and "." not in v else ""
        return f"; YAML read it as text: drop the quotes{dot}"
    return ""


class _Check:
    """A before-validator with kgen wording; `allowed`/`hint` also feed the missing-field message."""

    def __init__(self, fn: Callable[[Any], Any], allowed: str, hint: str = ""):
        self.fn, self.allowed, self.hint = fn, allowed, hint

    def __call__(self, v: Any) -> Any:
        return self.fn(v)


def _int(lo: int, hi: int, rule: str, allowed: str, ok: Callable[[int], bool] = lambda v: True) -> BeforeValidator:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            _fail(f"must be an integer, not {_kind(v)}{_quoted_hint(v)}", v, allowed)
        if not (lo <= v <= hi and ok(v)):
            _fail(rule, v, allowed)
        return v
    return BeforeValidator(_Check(check, allowed))


def _number(v: Any, allowed: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        _fail(f"must be a number, not {_kind(v)}{_quoted_hint(v)}", v, allowed)
    f = float(v)
    if not math.isfinite(f):
        _fail("must be a finite number", v, allowed)
    if not _F32_MIN <= f <= _F32_MAX:
        _fail("must be positive and fit in fp32", v, allowed)
    return f


def _positive(allowed: str, auto: bool = False) -> BeforeValidator:
    return BeforeValidator(_Check(lambda v: v if auto and v == "auto" else _number(v, allowed), allowed))


def _one_of(choices: Any, suggest: bool = True) -> BeforeValidator:
    values = get_args(choices)
    allowed = ", ".join(map(str, values))

    def check(v: Any) -> Any:
        if not isinstance(v, str):
            _fail(f"must be one of the allowed names, not {_kind(v)}", v, allowed)
        if v not in values:
            _fail(f"unknown value{_suggest(v, values) if suggest else ''}", v, allowed)
        return v
    return BeforeValidator(_Check(check, allowed))


def _bool(hint: str = "") -> BeforeValidator:
    def check(v: Any) -> bool:
        if not isinstance(v, bool):
            _fail(f"must be true or false, not {_kind(v)}", v, "true, false")
        return v
    return BeforeValidator(_Check(check, "true, false", hint))


def c_name_problem(v: object, keywords: bool = True) -> str | None:
    """Why `v` cannot be a name in generated C++ (None when it can)."""
    if not isinstance(v, str):
        return f"must be a C identifier, not {_kind(v)}"
    if not _NAME_RE.match(v):
        return f"must be a C identifier: {_NAME_RULE}"
    if keywords and v in C_KEYWORDS:
        return "is a C/C++ keyword"
    if keywords and (v.startswith("__") or re.match(r"_[A-Z]", v)):
        return "names starting with __ or _ and a capital letter are reserved for the compiler"
    if keywords and v == "_":
        return "a lone _ is not a PTX identifier (the kernels' names start with it)"
    return None


def _c_name(example: str) -> BeforeValidator:
    allowed = f"C identifiers such as {example}; not keywords, not starting with __ or _ and a capital"

    def check(v: Any) -> str:
        problem = c_name_problem(v)
        if problem:
            _fail(problem, v, allowed)
        return v
    return BeforeValidator(_Check(check, allowed))


def _list(allowed: str, empty_hint: str = "") -> BeforeValidator:
    def check(v: Any) -> list[Any]:
        if not isinstance(v, list | tuple):
            _fail(f"must be a list, not {_kind(v)}", v, allowed)
        if not v:
            _fail(f"must not be empty{empty_hint}", v, allowed)
        return list(v)
    return BeforeValidator(_Check(check, allowed))


def _mapping(allowed: str) -> BeforeValidator:
    def check(v: Any) -> dict[Any, Any]:
        if not isinstance(v, dict):
            _fail(f"must be a mapping, not {_kind(v)}", v, allowed)
        return v
    return BeforeValidator(_Check(check, allowed))


_SCALAR_ALLOWED = f"integers, numbers, true/false, or names ({_NAME_RULE})"


def _check_scalar(v: Any) -> bool | int | float | str:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and -INT32_MAX - 1 <= v <= INT32_MAX:
        return v
    if isinstance(v, float) and math.isfinite(v):
        return v
    if isinstance(v, str) and _NAME_RE.match(v):
        return v  # strings may reach generated C++ as template arguments
    _fail("must be a 32-bit integer, a finite number, true/false or a name", v, _SCALAR_ALLOWED)


# Constraints are evaluated by the tuner; allow only arithmetic and logic over parameter names.
_EXPR_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
               ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.BinOp, ast.Add,
               ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Name, ast.Load, ast.Constant)
_EXPR_ALLOWED = "parameter names, numbers, and/or/not, comparisons, + - * / // % and parentheses"
_NODE_WORDS = {ast.Call: "a function call", ast.Attribute: "an attribute access", ast.Subscript: "indexing",
               ast.Pow: "**", ast.Lambda: "a lambda", ast.In: "in", ast.NotIn: "not in", ast.Is: "is",
               ast.IsNot: "is not", ast.IfExp: "if/else"}


def constraint_names(expr: str) -> set[str]:
    """The parameter names a (validated) constraint expression uses."""
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}


def _check_constraint(v: Any) -> str:
    if not isinstance(v, str):
        _fail(f"must be an expression in a string, not {_kind(v)}", v, _EXPR_ALLOWED)
    if len(v) > 200:
        _fail("is longer than 200 characters", v, _EXPR_ALLOWED)
    try:
        tree = ast.parse(v, mode="eval")
    except SyntaxError as e:
        _fail(f"is not a valid expression: {e.msg}", v, _EXPR_ALLOWED)
    for node in ast.walk(tree):
        ok = isinstance(node, _EXPR_NODES)
        if isinstance(node, ast.Constant):
            ok = isinstance(node.value, int | float) or (isinstance(node.value, str) and bool(_NAME_RE.match(node.value)))
        if not ok:
            word = _NODE_WORDS.get(type(node), type(node).__name__)
            _fail(f"uses {word}, which constraints may not contain", v, _EXPR_ALLOWED)
    return v
