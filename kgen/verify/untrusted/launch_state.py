"""The source policy's rules against memory of past launches: a hand-written kernel must compute
each launch from that launch's arguments alone.

A kernel that can keep state from one launch to the next, or read the time, can behave while it
is verified (a run of some tens of launches, today) and differently in service. What gives it
that, in kgen's two compilers, and how each is refused here (over the preprocessed tokens, so
macros and token pasting are already expanded):

- storage with static duration that device code can write: a namespace-scope variable (NVRTC makes
  a plain `int n;` a device global too), `__device__`/`__managed__` variables, `static` data
  members and `static` locals, `thread_local` (and the `extern` declarations of any of these).
  Allowed: `constexpr` (a compile-time value), `const __constant__` (read-only on the device: PTX
  has no store to the .const space; `const`, so that the CPU build, which compiles `__constant__`
  away, puts it in read-only memory too) and `__shared__` (one block's scratch, gone with the
  block). `mutable` data members are refused (writable inside a const object);
- the clocks: `clock()`, `clock64()` (the SM cycle counter), `__nanosleep` (waits on the clock),
  and inline asm naming %globaltimer, %clock, %smid & co. (inline asm is refused anyway: this
  rule names what it read);
- the device heap (`malloc`/`free`/`new`/`delete` in device code): it outlives the launch, and a
  fresh allocation can hand back the bytes the last launch left.

Surface and texture objects and atomics on memory no argument points to need a global (refused
above) to reach anything. The cubins are then checked for what the text cannot dodge
(`check_cubins`: a writable device-global section, a device-heap call).
"""

from __future__ import annotations

import re

from kgen.compile.cubin_state import cubin_state
from kgen.compile.provided import kgen_headers
from kgen.verify.untrusted.cxx_text import Token, tokenize
from kgen.verify.untrusted.definitions import (
    _CLASS_KEYS,
    _declarator,
    _first_key,
    _skip_group,
    _skip_template_header,
)

STATE_RULE = "outlives a launch"  # every refusal of stored state says this, naming the variable
TIME_RULE = "reads the time"      # every refusal of a clock says this
HEAP_RULE = "device heap"

_ALLOWED_STORAGE = frozenset({"constexpr", "consteval", "__constant__", "__shared__"})
_STORAGE_WORDS = frozenset({"static", "thread_local", "__device__", "__managed__", "extern"})
_NOT_VARIABLES = frozenset({"using", "typedef", "static_assert", "namespace", "friend", "enum", "template",
                            "public", "private", "protected", "operator"})
TIME_CALLS = {"clock": "the SM cycle counter", "clock64": "the SM cycle counter",
              "__nanosleep": "waits on the clock"}
HEAP_CALLS = frozenset({"malloc", "free", "calloc", "realloc", "aligned_alloc", "memalign", "posix_memalign",
                        "__nv_aligned_device_malloc"})
# PTX special registers that give the time, or where and among whom the kernel runs
_SPECIAL_REGISTER = re.compile(r"%%?(globaltimer(?:_lo|_hi)?|clock64|clock(?:_hi)?|smid|nsmid|warpid|nwarpid|gridid"
                               r"|envreg\d+|pm\d+(?:_64)?|total_smem_size|dynamic_smem_size)\b")

_TYPE_WORDS = frozenset("""int unsigned signed float double char long short void bool auto const volatile struct
class union __device__ __managed__ __constant__ static extern thread_local mutable""".split())

Problem = tuple[int, str]


def launch_state_problems(tokens: list[Token]) -> list[Problem]:
    """(line, message) of every construct that lets a kernel remember launches or read the time."""
    problems = _storage_problems(tokens)
    for k, t in enumerate(tokens):
        prev = tokens[k - 1].text if k else ""
        nxt = tokens[k + 1].text if k + 1 < len(tokens) else ""
        if t.kind != "id" or prev in (".", "->"):
            continue
        declared = prev not in ("return", "=") and (tokens[k - 1].kind == "id" if k else False) and nxt in (
            ";", "[", ",", "=", "{")  # `int clock;`: a member or local of that name, not the clock
        if t.text in TIME_CALLS and not declared:
            problems.append((t.line, f"'{t.text}' {TIME_RULE} ({TIME_CALLS[t.text]}): not allowed in a kernel source "
                                     "(a kernel whose result depends on when it runs can behave while verified and "
                                     "differently in service)"))
        elif t.text in HEAP_CALLS and nxt == "(" or (t.text == "new" and prev != "operator") or (
                t.text == "delete" and prev not in ("=", "operator")):
            problems.append((t.line, f"'{t.text}' uses the {HEAP_RULE}: not allowed in a kernel source (the heap "
                                     f"{STATE_RULE}: an allocation can hand back what the last launch left; use "
                                     "registers or __shared__ memory)"))
        elif t.text in ("asm", "__asm__", "__asm"):
            registers = sorted({m[1] for s in _asm_strings(tokens, k + 1) for m in _SPECIAL_REGISTER.finditer(s)})
            if registers:
                problems.append((t.line, f"inline asm reading %{', %'.join(registers)} {TIME_RULE} or where the "
                                         "kernel runs: not allowed in a kernel source (its result could depend on "
                                         "when and where it runs)"))
    return problems


def _asm_strings(tokens: list[Token], i: int) -> list[str]:
    """The string literals of the asm statement whose operands start at or after tokens[i]."""
    while i < len(tokens) and tokens[i].text != "(":
        i += 1
    end = _skip_group(tokens, i) if i < len(tokens) else i
    return [t.text for t in tokens[i:end] if t.kind == "str"]


def _storage_problems(tokens: list[Token]) -> list[Problem]:
    """Variables with static storage duration that device code could write, at every scope."""
    problems: list[Problem] = []
    scopes = ["ns"]  # "ns" (file, namespace, extern "C" block) or "class"
    decl: list[Token] = []
    after_class = False  # `struct {...} g;`: the declarators follow the class body
    i, n = 0, len(tokens)
    while i < n:
        s = tokens[i].text
        if s == ";":
            problems += _declaration_problem(decl, scopes[-1], after_class)
            decl, after_class, i = [], False, i + 1
        elif s == "}":
            if len(scopes) > 1:
                after_class = scopes.pop() == "class"
            decl, i = [], i + 1
        elif s == ":" and len(decl) == 1 and decl[0].text in ("public", "private", "protected"):
            decl, i = [], i + 1
        elif s == "template" and i + 1 < n and tokens[i + 1].text == "<":  # a variable template too
            i = _skip_template_header(tokens, i + 1)
        elif s == "=" and not (decl and decl[-1].text == "operator"):
            problems += _declaration_problem(decl, scopes[-1], after_class)
            end = _initializer_end(tokens, i)
            decl, after_class, i = [], False, end + 1
        elif s in ("(", "["):
            j = _skip_group(tokens, i)
            decl.extend(tokens[i:j])
            i = j
        elif s != "{":
            decl.append(tokens[i])
            i += 1
        else:
            texts = [d.text for d in decl]
            if "namespace" in texts or (texts[:1] == ["extern"] and len(decl) == 2 and decl[1].kind == "str"):
                scopes.append("ns")
                decl, i = [], i + 1
            elif _first_key(decl) in _CLASS_KEYS and _declarator(decl) is None:
                scopes.append("class")
                decl, i = [], i + 1
            elif _declarator(decl) is None:  # an enum body or a brace initializer
                j = _skip_group(tokens, i)
                decl = [] if _first_key(decl) == "enum" else decl + tokens[i:j]
                i = j
            else:  # a function body (a constructor's `: a{1}` initializers are part of its declaration)
                j = _skip_group(tokens, i)
                problems += _body_problems(tokens[i + 1:j - 1])
                decl, i = [], j
    return problems


def _initializer_end(tokens: list[Token], i: int) -> int:
    while i < len(tokens):
        if tokens[i].text in ("(", "[", "{"):
            i = _skip_group(tokens, i)
        elif tokens[i].text in (";", "}"):
            return i
        else:
            i += 1
    return i


def _declaration_problem(decl: list[Token], scope: str, after_class: bool) -> list[Problem]:
    """A namespace-scope variable, or a class's static data member, that is not read-only."""
    if not decl:
        return []
    texts = {d.text for d in decl}
    if scope == "class" and "mutable" in texts and not _is_function(decl):
        return [_state_problem(decl, "a mutable member is writable inside a const object (one with static "
                                     "storage outlives a launch)")]
    if "__constant__" in texts and not _is_function(decl) and not _read_only(decl):
        return [_state_problem(decl, "a __constant__ variable must be declared const (the CPU build compiles "
                                     "__constant__ away: a non-const one is an ordinary writable global there)")]
    if texts & _NOT_VARIABLES or texts & _ALLOWED_STORAGE or _first_key(decl) in _CLASS_KEYS and not after_class:
        return []
    if scope == "class" and "static" not in texts:
        return []  # an ordinary member: per object
    if _is_function(decl):
        return []
    return [_state_problem(decl)]


def _is_function(decl: list[Token]) -> bool:
    """A function declaration: a declarator followed by a parameter list (`int x(5)` is a variable)."""
    name = _declarator(decl)
    if name is None:
        return False
    k = next((k for k, d in enumerate(decl) if d is name), -1)
    first = decl[k + 2] if 0 <= k and k + 2 < len(decl) and decl[k + 1].text == "(" else None
    # `T (*p)(...)`, `T (&r)[4]`: a declarator in parentheses (a pointer variable), not parameters
    return first is None or (first.kind not in ("num", "str") and first.text not in ("*", "&", "&&"))


def _body_problems(body: list[Token]) -> list[Problem]:
    """`static`, `thread_local`, `__device__` ... declarations inside a function body."""
    problems = []
    for k, t in enumerate(body):
        if t.text not in _STORAGE_WORDS or (k and body[k - 1].text in ("]", ")")):  # `[] __device__ (...)` lambdas
            continue
        start = k
        while start and body[start - 1].text not in (";", "{", "}", ":", ")"):
            start -= 1
        end = k
        while end < len(body) and body[end].text not in (";", "=", "{"):
            end = _skip_group(body, end) if body[end].text in ("(", "[") else end + 1
        decl = body[start:end]
        if not ({d.text for d in decl} & _ALLOWED_STORAGE) and not _is_function(decl):
            problems.append(_state_problem(decl))
    return problems


def _read_only(decl: list[Token]) -> bool:
    """The declared object itself is const: `const T x`, `T const x`, `constexpr`, `T* const p`,
    `T (*const p)(...)`; not `const T* p` (the pointer is writable)."""
    texts = [d.text for d in decl]
    if "constexpr" in texts:
        return True
    k = _name_index(decl)
    if k is None:
        return "const" in texts
    j = k - 1
    while j >= 0 and texts[j] in ("const", "volatile", "__restrict__"):
        if texts[j] == "const":
            return True
        j -= 1
    return j >= 0 and texts[j] not in ("*", "&", "&&", "(") and "const" in texts[:k]


def _name_index(decl: list[Token]) -> int | None:
    """Index of the declared name: the first identifier that is not a type word and ends a declarator."""
    for k, d in enumerate(decl):
        if d.kind == "id" and d.text not in _TYPE_WORDS and (
                k + 1 == len(decl) or decl[k + 1].text in ("[", ",", "(", "{", ")")):
            return k
    return None


def _state_problem(decl: list[Token], why: str = "") -> Problem:
    k = _name_index(decl)
    what = f"'{decl[k].text}'" if k is not None else "this declaration"
    why = why or ("a writable variable with static storage is not allowed in a kernel source (it lets a kernel "
                  "count launches); constants are constexpr or const __constant__, per-launch state lives in "
                  "registers or __shared__ memory")
    return (decl[0].line, f"global {what} {STATE_RULE}: {why}")


def check_cubins(cubins: dict, text: str, name: str) -> list[Problem]:
    """What the compiled cubins hold that the text rules should have refused: a writable
    device-global section (its variables), a device-heap call. (line, message); line 0 when the
    variable's declaration is not found in `text` (the preprocessed source, with #line).
    NVRTC also gives odr-used `static constexpr` members storage there: names the text or kgen's
    headers declare constexpr are not listed."""
    constants = _constexpr_names(text + "\n".join(kgen_headers().values()))
    problems: list[Problem] = []
    for arch, artifact in sorted(cubins.items()):
        state = cubin_state(artifact.cubin)
        for var in state.globals:
            short = re.sub(r"<.*>", "", var).rsplit("::", 1)[-1]
            if short in constants:
                continue
            problems.append((_declared_line(text, short), f"global '{var}' {STATE_RULE}: the {arch} cubin holds it "
                                                          "in writable device memory; a writable variable with static "
                                                          "storage is not allowed in a kernel source"))
        for call in state.heap_calls:
            problems.append((0, f"the {arch} cubin calls '{call}' (the {HEAP_RULE}, which {STATE_RULE}): not "
                                "allowed in a kernel source"))
    return problems


def _constexpr_names(text: str) -> set[str]:
    """Names a `constexpr` declaration of `text` gives a value (`= v` or `{v}`), every declarator."""
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in text.split("\n"))
    tokens, names = tokenize(code), set()
    for k, t in enumerate(tokens):
        if t.text != "constexpr":
            continue
        j = k + 1
        while j < len(tokens) and tokens[j].text not in (";", "}"):
            if tokens[j].text in ("=", "{") and tokens[j - 1].kind == "id":
                names.add(tokens[j - 1].text)
            elif tokens[j].text == "{":
                break  # a function body ends the declaration
            j = _skip_group(tokens, j) if tokens[j].text in ("(", "[", "{") else j + 1
    return names


def _declared_line(text: str, var: str) -> int:
    """The user's line of the first line of `text` naming `var` (following #line), 0 if none."""
    line, pattern = 0, re.compile(rf"\b{re.escape(var)}\b")
    for raw in text.split("\n"):
        if m := re.match(r'#line (\d+)', raw):
            line = int(m[1]) - 1
            continue
        line += 1
        if pattern.search(raw):
            return line
    return 0
