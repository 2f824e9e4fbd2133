"""Find the function definitions of a preprocessed kernel source that are not device code.

A kernel source holds device code only: every function defined at namespace or class scope
must be `__device__` or `__global__` (`__host__ __device__` is device code too), or `constexpr`
(the compile-time helpers CUDA code writes without `__device__`: what they could call at run
time is held to the same call rules), and a lambda at namespace or class scope (a host lambda)
is refused. Lambdas and local classes inside a
function body are device code by context. The scan follows braces over the token stream;
it is not a C++ parser, so anything it cannot classify as a function is left to the object
check (kgen/compile/object_check.py), which sees what was really compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.verify.untrusted.cxx_text import Token

DEVICE_SPECIFIERS = frozenset({"__device__", "__global__"})
_COMPILE_TIME = frozenset({"constexpr", "consteval"})
# Identifiers followed by "(" that do not declare a function (attributes, operators, macros of
# the CUDA headers that take arguments).
_NOT_DECLARATORS = frozenset({
    "__attribute__", "__declspec", "alignas", "__align__", "__launch_bounds__", "__maxnreg__", "decltype",
    "sizeof", "alignof", "noexcept", "static_assert", "__builtin_offsetof", "throw", "requires",
    "__cluster_dims__", "__grid_constant__",
})
_CLASS_KEYS = frozenset({"class", "struct", "union"})
_LAMBDA_PREV = frozenset({"=", "(", ",", "{", "return", "?", ":", "[", "&&", "||", "!"})


@dataclass(frozen=True)
class HostCode:
    line: int
    what: str  # "function 'f'" or "lambda"


def _skip_group(tokens: list[Token], i: int) -> int:
    """Index just past the bracket group opening at tokens[i] ( ( [ { )."""
    close = {"(": ")", "[": "]", "{": "}"}
    stack = [close[tokens[i].text]]
    i += 1
    while i < len(tokens) and stack:
        t = tokens[i].text
        if t in close:
            stack.append(close[t])
        elif t in (")", "]", "}"):
            # unbalanced input: close what matches, never loop forever
            while stack and stack.pop() != t:
                pass
        i += 1
    return i


def _skip_template_header(tokens: list[Token], i: int) -> int:
    """tokens[i] is '<' after 'template': index just past the matching '>'."""
    depth = 0
    while i < len(tokens):
        t = tokens[i].text
        if t in ("(", "[", "{"):
            i = _skip_group(tokens, i)
            continue
        if t == "<":
            depth += 1
        elif t == ">":
            depth -= 1
        elif t == ">>":
            depth -= 2
        i += 1
        if depth <= 0:
            return i
    return i


def _declarator(decl: list[Token]) -> Token | None:
    """The name token of a function declarator in `decl` (at bracket depth 0), if any."""
    depth = 0
    for k, t in enumerate(decl):
        if t.text in ("(", "["):
            if t.text == "(" and depth == 0 and k > 0:
                prev = decl[k - 1]
                if prev.kind == "id" and prev.text not in _NOT_DECLARATORS:
                    return prev
                if prev.text == ">" or (k > 1 and decl[k - 2].text == "operator"):
                    return _name_before_template_args(decl, k - 1) or prev
            depth += 1
        elif t.text in (")", "]"):
            depth -= 1
        elif t.text == "operator" and depth == 0:
            return t
    return None


def _name_before_template_args(decl: list[Token], k: int) -> Token | None:
    """decl[k] is the '>' closing `name<...>`: the name token."""
    depth = 0
    while k >= 0:
        t = decl[k].text
        if t == ">":
            depth += 1
        elif t == ">>":
            depth += 2
        elif t == "<":
            depth -= 1
            if depth == 0:
                return decl[k - 1] if k > 0 and decl[k - 1].kind == "id" else None
        k -= 1
    return None


def _first_key(decl: list[Token]) -> str:
    """The first keyword of a declaration, past typedef and attribute groups."""
    k = 0
    while k < len(decl):
        t = decl[k].text
        if t in ("__attribute__", "alignas", "__align__", "__declspec") and k + 1 < len(decl):
            k += 2
            depth = 1
            while k < len(decl) and depth:
                depth += {"(": 1, ")": -1}.get(decl[k].text, 0)
                k += 1
            continue
        if t in ("typedef", "extern", "static", "inline", "constexpr", "__device__", "__host__"):
            k += 1
            continue
        if t == "[" and k + 1 < len(decl) and decl[k + 1].text == "[":
            while k < len(decl) and not (decl[k].text == "]" and k > 0 and decl[k - 1].text == "]"):
                k += 1
            k += 1
            continue
        return t
    return ""


def _lambdas(tokens: list[Token], i: int, end: int) -> list[HostCode]:
    """Host lambdas in tokens[i:end] (an initializer at namespace or class scope)."""
    found = []
    k = i
    while k < end:
        t = tokens[k]
        if t.text == "[" and k > 0 and tokens[k - 1].text in _LAMBDA_PREV and not (
                k + 1 < end and tokens[k + 1].text == "["):
            after = _skip_group(tokens, k)
            j, device = after, False
            while j < end and tokens[j].text not in ("{", ";", ","):
                if tokens[j].text in DEVICE_SPECIFIERS:
                    device = True
                j = _skip_group(tokens, j) if tokens[j].text in ("(", "[") else j + 1
            if j < end and tokens[j].text == "{":
                if not device:
                    found.append(HostCode(t.line, "lambda"))
                k = _skip_group(tokens, j)
                continue
        k += 1
    return found


def _initializer_end(tokens: list[Token], i: int) -> int:
    """Index of the ';' ending the initializer that starts at tokens[i] (or len)."""
    while i < len(tokens):
        t = tokens[i].text
        if t in ("(", "[", "{"):
            i = _skip_group(tokens, i)
            continue
        if t in (";", "}"):
            return i
        i += 1
    return i


def _ctor_initializers(decl: list[Token], name: Token) -> bool:
    """Does `decl` have a constructor's member-initializer list (a ':' after the parameters)?"""
    depth, seen = 0, False
    for t in decl:
        if t is name:
            seen = True
        elif t.text in ("(", "["):
            depth += 1
        elif t.text in (")", "]"):
            depth -= 1
        elif seen and depth == 0 and t.text == ":":
            return True
    return False


def host_code(tokens: list[Token]) -> tuple[list[HostCode], set[str]]:
    """(definitions that are not device code, names of the functions the source defines)."""
    found: list[HostCode] = []
    defined: set[str] = set()
    scopes = ["ns"]  # "ns" (file, namespace, extern "C" block) or "class"
    decl: list[Token] = []
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i]
        s = t.text
        if s == ";":
            decl, i = [], i + 1
        elif s == "}":
            if len(scopes) > 1:
                scopes.pop()
            decl, i = [], i + 1
        elif s == ":" and len(decl) == 1 and decl[0].text in ("public", "private", "protected"):
            decl, i = [], i + 1
        elif s == "template" and i + 1 < n and tokens[i + 1].text == "<":
            i = _skip_template_header(tokens, i + 1)
        elif s == "=" and not (decl and decl[-1].text == "operator"):
            # an initializer (variable, default member, `= default`, `using X =`): to its ';'
            end = _initializer_end(tokens, i)
            found.extend(_lambdas(tokens, i, end))
            decl, i = [], (end + 1 if end < n and tokens[end].text == ";" else end)
        elif s in ("(", "["):
            j = _skip_group(tokens, i)
            decl.extend(tokens[i:j])
            i = j
        elif s != "{":
            decl.append(t)
            i += 1
        else:
            i, decl = _open_brace(tokens, i, decl, scopes, found, defined)
    return found, defined


def _open_brace(tokens, i, decl, scopes, found, defined) -> tuple[int, list[Token]]:
    """A '{' at namespace or class scope: classify what it opens; (next index, declaration so far)."""
    texts = [d.text for d in decl]
    key = _first_key(decl)
    name = _declarator(decl)
    if "namespace" in texts or (texts[:1] == ["extern"] and len(decl) == 2 and decl[1].kind == "str"):
        scopes.append("ns")
        return i + 1, []
    if key in _CLASS_KEYS and name is None:
        scopes.append("class")
        return i + 1, []
    if name is None:  # an enum body or a brace initializer: not code
        return _skip_group(tokens, i), ([] if key == "enum" else decl + [tokens[i]])
    if decl[-1].kind == "id" or decl[-1].text == ">":
        if _ctor_initializers(decl, name):  # `: a{1}, b{2}` before the body
            j = _skip_group(tokens, i)
            return j, decl + tokens[i:j]
    defined.add(name.text)
    if not (DEVICE_SPECIFIERS | _COMPILE_TIME) & set(texts):
        found.append(HostCode(name.line, f"function '{name.text}'" if name.text != "operator" else "operator"))
    return _skip_group(tokens, i), []
