"""The source policy of `kgen verify --source`: a submission is kernel code only, and NVRTC and
g++ compile one and the same text.

`prepare_source` checks a hand-written source and returns the text both compilers get:

1. kgen's own inlined platform block (ABI 1 `kgen show` output) is recognised by its exact
   text and replaced by `#include "kgen/platform.cuh"`, the header kgen now provides;
2. every directive is read before anything is compiled: `#include` only of the headers in
   kgen.compile.provided (literal names: no paths, no macros), `#pragma` only unroll,
   nounroll and once, no `#line`/`#include_next`/`#embed`..., no `#define` of reserved names;
3. the text is preprocessed once (kgen/verify/untrusted/preprocess.py) with the includes held out and
   every compiler-identity macro poisoned, so a branch on the compiler is refused, even
   through a macro, and the output has no conditional left for either compiler to read;
4. the preprocessed tokens are checked: no inline asm, no host function or host lambda, no
   host-only call (process, file, environment), no constructor/destructor attributes, no
   names of kgen's CPU runtime, and nothing that lets a kernel remember past launches or read
   the time (kgen/verify/untrusted/launch_state.py: writable globals, static locals, the
   clocks, the device heap).

A violation is a KgenUserError (exit 2) naming the rule, the file and the line. The CPU
build then checks the compiled object itself (kgen/compile/object_check.py): the check the
text cannot dodge.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePath

from kgen.compile.object_check import HOST_ONLY_CALLS
from kgen.compile.provided import ALLOWED_INCLUDES, kgen_headers
from kgen.errors import CompileError, KgenUserError
from kgen.verify.untrusted.cxx_text import Token, logical_lines, tokenize
from kgen.verify.untrusted.definitions import host_code
from kgen.verify.untrusted.launch_state import launch_state_problems
from kgen.verify.untrusted.preprocess import compiler_predefined_macros, preprocess

PLATFORM_INCLUDE = '#include "kgen/platform.cuh"'
# The platform block `kgen show` inlined under ABI 1 (templates/common/platform.cuh before it
# became a provided header): sha256 of its lines, trailing blanks stripped, joined by "\n".
ABI1_PLATFORM_BLOCK = (52, "a0c4ff9cc6d6719a8e47be74cb605666f659db355a729787ab0eaee8b4797037")
_PLATFORM_FIRST_LINE = "// kgen platform layer:"

# Macros that say which compiler (or which pass, or which machine) is reading.
IDENTITY_MACROS = frozenset("""
__CUDACC__ __CUDACC_RTC__ __CUDACC_RTC_INT128__ __CUDACC_VER_MAJOR__ __CUDACC_VER_MINOR__ __CUDACC_VER_BUILD__
__CUDACC_DEBUG__ __CUDACC_RDC__ __CUDACC_EWP__ __CUDACC_RELAXED_CONSTEXPR__ __CUDACC_EXTENDED_LAMBDA__
__NVCC__ __CUDA_ARCH__ __CUDA_ARCH_LIST__ __CUDA_ARCH_HAS_FEATURE__ __CUDA_ARCH_SPECIFIC__
__CUDA_ARCH_FAMILY_SPECIFIC__ __NVCOMPILER _NVHPC_CUDA
__GNUC__ __GNUC_MINOR__ __GNUC_PATCHLEVEL__ __GNUG__ __clang__ __clang_major__ __clang_minor__ __llvm__
_MSC_VER _MSC_FULL_VER _WIN32 _WIN64 __INTEL_COMPILER __INTEL_LLVM_COMPILER __ICC __EDG__ __EDG_VERSION__
__HIP__ __HIPCC__ __HIP_DEVICE_COMPILE__ __x86_64__ __x86_64 __amd64__ __aarch64__ __linux__ __linux
__unix__ __unix __APPLE__ __ELF__ __OPTIMIZE__ __SANITIZE_ADDRESS__ __STRICT_ANSI__
KGEN_SIMT KGEN_SIMT_ASAN KGEN_SIMT_UCONTEXT KGEN_SIMT_ASM_SWITCH
""".split())
# Predefined macros that only give a type's limits or layout (the same on both compilers): not poisoned.
_VALUE_MACROS = re.compile(r"__(?:FLT|DBL|LDBL|FLT\d+X?|BFLT16)_\w+__|__\w+_(?:MAX|MIN|WIDTH)__|__CHAR_BIT__")
IDENTITY_PREFIXES = ("__CUDA", "__NVCC", "__NVCOMPILER", "_NVHPC", "__GNUC", "__GCC_", "__clang", "__llvm", "_MSC_",
                     "__INTEL", "__EDG", "__HIP", "KGEN_SIMT", "__SANITIZE_")
# Preprocessor operators that open files or run pragmas from inside the text.
_FILE_OPERATORS = frozenset({"__has_include", "__has_include_next"})
_PRAGMA_OPERATORS = frozenset({"_Pragma"})

_ALLOWED_DIRECTIVES = frozenset({"define", "undef", "if", "ifdef", "ifndef", "elif", "elifdef", "elifndef", "else",
                                 "endif", "error", "warning", "include", "pragma", ""})
_ALLOWED_PRAGMAS = frozenset({"unroll", "nounroll", "once"})
_LOAD_TIME_ATTRIBUTES = frozenset({"constructor", "destructor", "init_priority", "ifunc"})
_ASM = frozenset({"asm", "__asm__", "__asm"})
_RESERVED = re.compile(r"__|_[A-Z]")
_DIRECTIVE = re.compile(r"^\s*#\s*(\w*)(.*)$", re.S)
_INCLUDE = re.compile(r'^\s*(?:<([^<>"]+)>|"([^<>"]+)")\s*$')
_UNROLL = "__kgen_pragma_unroll__"
_PLACEHOLDER = re.compile(r"^\s*#\s*pragma kgen include (\d+)\s*$")
_UNROLL_LINE = re.compile(rf"^\s*{_UNROLL}\s*\((.*)\)\s*$")


@dataclass(frozen=True)
class PreparedSource:
    text: str  # what NVRTC and g++ compile: preprocessed, includes restored, #line to the user's file
    name: str  # the file name every diagnostic uses
    platform_block_replaced: bool  # an ABI-1 inlined platform block became the provided include


@dataclass(frozen=True)
class _Violation:
    line: int
    message: str


class SourcePolicyError(KgenUserError):
    """A kernel source breaks the source policy; every violation is in the message."""


def display_name(origin: str) -> str:
    """The file name diagnostics use: the origin's base name, in characters safe in a #line."""
    base = PurePath(origin).name if origin and not origin.startswith("<") else "kernel.cu"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", base) or "kernel.cu"


def prepare_source(source: str, origin: str = "<source>") -> PreparedSource:
    """Check `source` against the policy; the one text both compilers compile."""
    name = display_name(origin)
    source = source.replace("\r\n", "\n")
    source, replaced = replace_platform_block(source)
    held, includes, problems = _hold_out_directives(source)
    identifiers = {t.text for ll in logical_lines(source) for t in tokenize(ll.text) if t.kind == "id"}
    predefined = {m for m in compiler_predefined_macros() if not _VALUE_MACROS.fullmatch(m)}
    poison = sorted(predefined | IDENTITY_MACROS
                    | {i for i in identifiers if i.startswith(IDENTITY_PREFIXES)}
                    | _FILE_OPERATORS | _PRAGMA_OPERATORS)
    pre = preprocess(held, name, poison)  # refused directives are blank lines by now: nothing is opened
    poisoned, errors = _preprocessor_problems(pre.diagnostics)
    _raise(name, problems + poisoned)
    if errors:
        raise CompileError("\n".join([f"preprocessing {name} failed:"]
                                     + [f"{name}:{line}: error: {msg}" for line, msg in errors[:10]]))
    out_lines = [(line, _restore(text, includes)) for line, text in pre.lines]
    _raise(name, _check_tokens(out_lines))
    return PreparedSource(_with_line_directives(name, out_lines), name, replaced)


def replace_platform_block(source: str) -> tuple[str, bool]:
    """Replace kgen's own ABI-1 inlined platform block (exact text) by the provided include,
    keeping every other line where it was."""
    lines = source.split("\n")
    known = {ABI1_PLATFORM_BLOCK, _block_key(kgen_headers()["kgen/platform.cuh"].split("\n"))}
    for start, text in enumerate(lines):
        if not text.startswith(_PLATFORM_FIRST_LINE):
            continue
        for count, _digest in known:
            block = lines[start:start + count]
            if (count, _block_key(block)[1]) in known:
                lines[start:start + count] = [PLATFORM_INCLUDE] + [""] * (count - 1)
                return "\n".join(lines), True
    return source, False


def _block_key(lines: list[str]) -> tuple[int, str]:
    stripped = [line.rstrip() for line in lines]
    while stripped and not stripped[-1]:
        stripped.pop()
    return len(stripped), hashlib.sha256("\n".join(stripped).encode()).hexdigest()


def _hold_out_directives(source: str) -> tuple[str, list[str], list[_Violation]]:
    """Check every directive; replace each #include by a placeholder pragma (restored after
    preprocessing) and each `#pragma unroll N` by a line whose N the preprocessor expands."""
    physical = source.split("\n")
    includes: list[str] = []
    problems: list[_Violation] = []
    for ll in logical_lines(source):
        problems += [_Violation(ll.line, f"'{t.text}' is reserved for kgen: it is not allowed in a kernel source")
                     for t in tokenize(ll.text) if t.kind == "id" and t.text.startswith("__kgen")]
        m = _DIRECTIVE.match(ll.text)
        if not m:
            continue
        directive, rest = m[1], m[2]
        replacement, problem_count = None, len(problems)
        if directive not in _ALLOWED_DIRECTIVES:
            problems.append(_Violation(ll.line, f"directive '#{directive}' is not allowed in a kernel source "
                                                "(allowed: #include of kgen's headers, #define, #undef, "
                                                "conditionals, #pragma unroll)"))
        elif directive == "include":
            inc = _INCLUDE.match(rest)
            header = inc and (inc[1] or inc[2])
            if header not in ALLOWED_INCLUDES:
                what = rest.strip() if inc else "with a macro or malformed operand"
                problems.append(_Violation(ll.line, f"#include {what} is not allowed in a kernel source (allowed: "
                                                    f"{', '.join(ALLOWED_INCLUDES)})"))
            else:
                replacement = f"#pragma kgen include {len(includes)}"
                includes.append(f'#include "{header}"' if header.startswith("kgen/") else f"#include <{header}>")
        elif directive == "pragma":
            word, operand = re.match(r"\s*(\w*)(.*)", rest, re.S).groups()
            if word not in _ALLOWED_PRAGMAS:
                problems.append(_Violation(ll.line, f"#pragma {rest.strip()[:40]} is not allowed in a kernel source "
                                                    "(allowed: #pragma unroll, nounroll, once)"))
            elif word == "unroll" and operand.strip():
                replacement = f"{_UNROLL}({operand.strip()})"
        elif directive in ("define", "undef"):
            macro = re.match(r"\s*(\w*)", rest)[1]
            if _RESERVED.match(macro) or "kgen_simt" in macro:
                problems.append(_Violation(ll.line, f"#{directive} of the reserved name '{macro}' is not allowed in "
                                                    "a kernel source (reserved names belong to the compilers and "
                                                    "the provided headers)"))
        if len(problems) > problem_count:
            replacement = ""  # refused: the preprocessor never sees it
        if replacement is not None:
            physical[ll.line - 1:ll.line - 1 + ll.span] = [replacement] + [""] * (ll.span - 1)
    return "\n".join(physical), includes, problems


def _operator_message(op: str) -> str:
    if op in _PRAGMA_OPERATORS:
        return f"'{op}' is not allowed in a kernel source (allowed pragmas: #pragma unroll, nounroll, once)"
    return f"'{op}' is not allowed in a kernel source: it probes the file system"


def _preprocessor_problems(diagnostics: list[tuple[int, str]]) -> tuple[list[_Violation], list[tuple[int, str]]]:
    """(policy violations: uses of poisoned identifiers, other preprocessing errors)."""
    problems, errors = [], []
    for line, msg in diagnostics:
        m = re.match(r'attempt to use poisoned "(\w+)"', msg)
        if not m:
            errors.append((line, msg))
        elif m[1] in _FILE_OPERATORS | _PRAGMA_OPERATORS:
            problems.append(_Violation(line, _operator_message(m[1])))
        else:
            problems.append(_Violation(line, f"'{m[1]}' tells which compiler is reading: branching on the compiler "
                                             "is not allowed in a kernel source (NVRTC and g++ compile the same "
                                             "preprocessed text; use #include \"kgen/platform.cuh\" for what "
                                             "differs)"))
    # an error that only follows from a refused identifier (`#if X(...)`) is not worth showing
    return problems, ([] if problems else errors)


def _restore(text: str, includes: list[str]) -> str:
    if m := _PLACEHOLDER.match(text):
        return includes[int(m[1])]
    if m := _UNROLL_LINE.match(text):
        return f"#pragma unroll {m[1].strip()}"
    return text


def _check_tokens(lines: list[tuple[int, str]]) -> list[_Violation]:
    """The rules read from the preprocessed text (macros expanded, conditionals resolved)."""
    code = "\n".join("" if text.lstrip().startswith("#") else text for _, text in lines)
    user_line = [line for line, _ in lines]
    tokens = [Token(t.text, t.kind, user_line[t.line - 1]) for t in tokenize(code)]
    problems: list[_Violation] = []
    for line, text in lines:
        words = text.split()
        if text.lstrip().startswith("#") and words[:1] == ["#pragma"] and words[1:2] and \
                words[1] not in _ALLOWED_PRAGMAS:
            problems.append(_Violation(line, f"{text.strip()[:60]} is not allowed in a kernel source"))
    hosts, defined = host_code(tokens)
    problems += [_Violation(h.line, f"host {h.what} is not allowed in a kernel source: every function must be "
                                    "__device__ or __global__") for h in hosts]
    for k, t in enumerate(tokens):
        if t.kind != "id":
            continue
        prev = tokens[k - 1].text if k else ""
        nxt = tokens[k + 1].text if k + 1 < len(tokens) else ""
        if t.text in _ASM:
            problems.append(_Violation(t.line, "inline asm is not allowed in a kernel source (the CPU backend would "
                                               "run it as host code): use the primitives kgen provides"))
        elif t.text in HOST_ONLY_CALLS and nxt == "(" and prev not in (".", "->") and t.text not in defined:
            problems.append(_Violation(t.line, f"host-only call '{t.text}' is not allowed in a kernel source "
                                               "(allowed: device math, memcpy/memset/memmove, printf)"))
        elif "kgen_simt" in t.text or t.text.startswith(("_Z", "__kgen")):
            problems.append(_Violation(t.line, f"'{t.text}' is reserved for kgen's CPU runtime: it is not allowed in a "
                                               "kernel source"))
        elif t.text.startswith(IDENTITY_PREFIXES):
            problems.append(_Violation(t.line, f"'{t.text}' tells which compiler is reading: not allowed in a "
                                               "kernel source"))
    problems += _attribute_problems(tokens)
    problems += [_Violation(line, message) for line, message in launch_state_problems(tokens)]
    return problems


def _attribute_problems(tokens: list[Token]) -> list[_Violation]:
    """`__attribute__((constructor))`, `[[gnu::destructor]]` & co.: code run at load or exit."""
    problems = []
    for k, t in enumerate(tokens):
        if t.text == "__attribute__" or (t.text == "[" and k + 1 < len(tokens) and tokens[k + 1].text == "["):
            depth, j = 0, k + 1
            while j < len(tokens):
                s = tokens[j].text
                depth += 1 if s in ("(", "[") else -1 if s in (")", "]") else 0
                name = s.strip("_")
                if tokens[j].kind == "id" and name in _LOAD_TIME_ATTRIBUTES:
                    problems.append(_Violation(t.line, f"attribute '{name}' (code run when the library is loaded "
                                                       "or unloaded) is not allowed in a kernel source"))
                    break
                if depth <= 0 and j > k + 1:
                    break
                j += 1
    return problems


def _with_line_directives(name: str, lines: list[tuple[int, str]]) -> str:
    out = [f'#line 1 "{name}"']
    expected = 1
    for line, text in lines:
        if line != expected:
            out.append(f"#line {line}")
        out.append(text)
        expected = line + 1
    return "\n".join(out) + "\n"


def _raise(name: str, problems: list[_Violation]) -> None:
    if not problems:
        return
    seen, messages = set(), []
    for p in sorted(problems, key=lambda p: p.line):
        msg = f"{name}:{p.line}: {p.message}"
        if msg not in seen:
            seen.add(msg)
            messages.append(msg)
    raise SourcePolicyError("\n".join(messages[:20] + ([f"... and {len(messages) - 20} more"]
                                                       if len(messages) > 20 else [])))
