"""Check a kernel's CPU object file before it is linked: what it may call, and that nothing in
it runs when the library is loaded.

The CPU backend compiles a kernel source as its own translation unit (`g++ -c`), so every
function it can reach outside itself is an undefined symbol of the object, however the text
spelled it (macros, token pasting, `weakref`/`alias` attributes, function pointers). Those
symbols must be on the allow-list below; and the object may hold no load-time code
(`.init_array`, `.ctors`, `.preinit_array` and their `.fini` counterparts, IFUNC resolvers).
This is the check that reading the text cannot replace; kgen's own kernels pass it too.

The object is read with binutils (`readelf`; `objdump` locates a violation's source line).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kgen.errors import KgenUserError, ToolchainError

# ---- the allow-list of undefined symbols ------------------------------------------------------

# libm: the float/double math a kernel may call (CUDA's device math has the same names).
_MATH = """
exp exp2 exp10 expm1 log log2 log10 log1p pow sqrt cbrt hypot
sin cos tan sincos asin acos atan atan2 sinh cosh tanh asinh acosh atanh
erf erfc tgamma lgamma fma fmax fmin fabs fdim floor ceil trunc round lround llround
nearbyint rint lrint llrint fmod remainder remquo frexp ldexp scalbn scalbln modf
copysign nan nextafter ilogb logb
""".split()
LIBM = frozenset(name + suffix for name in _MATH for suffix in ("", "f"))
# Memory and string helpers (device memcpy/memset exist in CUDA too) and device printf,
# which writes to stdout only. GCC may turn printf into puts/putchar, and _FORTIFY_SOURCE
# builds into the __*_chk forms.
LIBC = frozenset("""
memcpy memmove memset memcmp strlen printf puts putchar
__memcpy_chk __memmove_chk __memset_chk __printf_chk
""".split())
# What kgen's CPU runtime (templates/simt/), inlined into the kernel's object, needs: formatting
# its error messages into a buffer, std::string's out-of-line members, and the fiber switch of
# its portable mode (KGEN_SIMT_UCONTEXT).
RUNTIME = frozenset("""
snprintf vsnprintf __snprintf_chk __vsnprintf_chk swapcontext _ZSt20__throw_length_errorPKc
""".split())
_RUNTIME_PREFIXES = ("_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE",)  # std::string members
# ELF and ABI plumbing every object may reference.
PLUMBING = frozenset("_GLOBAL_OFFSET_TABLE_ __tls_get_addr __stack_chk_fail".split())
# Sanitizer builds (`sanitize=True`) call the instrumentation runtimes.
_SANITIZER_PREFIXES = ("__asan_", "__ubsan_", "__sanitizer_", "__lsan_")
# Race-check builds (`race_check=True`) call the -fsanitize=thread callbacks, which the SIMT
# runtime itself defines (templates/simt/kgen_simt_tsan.h).
_TSAN_PREFIXES = ("__tsan_",)

ALLOWED_SUMMARY = ("libm math functions, memcpy/memmove/memset/memcmp, printf, "
                   "and kgen's CPU runtime")

# Calls a kernel must never make (process, file, environment, dynamic loading): named in
# messages; any other symbol off the allow-list is refused just the same.
HOST_ONLY_CALLS = frozenset("""
system popen pclose fork vfork clone daemon execl execle execlp execv execve execvp execvpe fexecve
posix_spawn posix_spawnp wait waitpid kill raise abort exit _exit _Exit quick_exit atexit at_quick_exit
fopen fopen64 freopen fdopen fclose fread fwrite fgets fputs fprintf fscanf scanf getline tmpfile tmpnam mkstemp
open open64 openat creat close read write pread pwrite lseek dup dup2 pipe mkfifo
remove rename unlink unlinkat rmdir mkdir chdir chmod chown symlink link truncate ftruncate opendir readdir
getenv secure_getenv setenv unsetenv putenv clearenv
dlopen dlsym dlclose syscall ioctl mmap munmap mprotect ptrace prctl signal sigaction
socket connect bind listen accept send recv sendto recvfrom gethostbyname getaddrinfo
""".split())

# Symbols that register code to run at exit: a static object with a destructor.
_AT_EXIT = frozenset("__cxa_atexit __cxa_thread_atexit __cxa_thread_atexit_impl atexit __dso_handle".split())
# Sections whose entries the loader runs (by name, GCC's .init_array.NNNNN priorities included,
# and by type).
_LOAD_TIME_SECTIONS = (".init_array", ".fini_array", ".preinit_array", ".ctors", ".dtors")
_LOAD_TIME_TYPES = frozenset({"INIT_ARRAY", "FINI_ARRAY", "PREINIT_ARRAY"})


def symbol_allowed(name: str, sanitize: bool = False, race_check: bool = False) -> bool:
    if name in LIBM or name in LIBC or name in RUNTIME or name in PLUMBING:
        return True
    if name.startswith(_RUNTIME_PREFIXES):
        return True
    return (sanitize and name.startswith(_SANITIZER_PREFIXES)) or (race_check and name.startswith(_TSAN_PREFIXES))


# ---- reading the object -------------------------------------------------------------------


def binutil(name: str) -> str:
    """Path of a binutils program; ToolchainError if it is not installed."""
    found = shutil.which(name)
    if not found:
        raise ToolchainError(f"'{name}' (GNU binutils) not found on PATH: the CPU backend checks each kernel's "
                             "object file with it before linking; install binutils")
    return found


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise ToolchainError(f"{cmd[0]} cannot run: {e}") from e
    if res.returncode != 0:
        raise ToolchainError(f"{Path(cmd[0]).name} failed on a kernel object: {res.stderr.strip()[:500]}")
    return res.stdout


@dataclass(frozen=True)
class Entry:
    """One entry of a load-time section: the function it runs."""

    function: str  # its symbol, or "section+offset" where no symbol names it
    local: bool
    references: frozenset[str]  # the symbols that function's code refers to


@dataclass(frozen=True)
class ObjectInfo:
    undefined: tuple[str, ...]
    ifuncs: tuple[str, ...]  # GNU indirect functions: their resolvers run at load time
    load_time: dict[str, tuple[Entry, ...]]  # load-time section -> its entries


# readelf -sW:  Num: Value Size Type Bind Vis Ndx Name
_SYM = re.compile(r"^\s*\d+:\s+([0-9a-f]+)\s+(\d+|0x[0-9a-f]+)\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s*(\S*)")
# readelf -SW:  [Nr] Name Type ...
_SEC = re.compile(r"^\s*\[\s*(\d+)\]\s+(\S+)\s+(\S+)")
# readelf -rW:  Offset Info Type Sym.Value Sym.Name + Addend
_REL_SECTION = re.compile(r"^Relocation section '(\S+)'")
_REL = re.compile(r"^([0-9a-f]+)\s+[0-9a-f]+\s+\S+\s+[0-9a-f]+\s+(\S+)(?:\s+([+-])\s+([0-9a-f]+))?")


def _is_load_time(name: str, typ: str) -> bool:
    return typ in _LOAD_TIME_TYPES or name.startswith(_LOAD_TIME_SECTIONS) or name in (".init", ".fini")


@dataclass(frozen=True)
class _Function:
    name: str
    section: str
    start: int
    size: int
    local: bool


def read_object(obj: Path) -> ObjectInfo:
    readelf = binutil("readelf")
    sections: dict[str, str] = {}  # index -> name
    load_time: list[str] = []
    for line in _run([readelf, "-SW", str(obj)]).splitlines():
        if m := _SEC.match(line):
            sections[m[1]] = m[2]
            if _is_load_time(m[2], m[3]):
                load_time.append(m[2])
    undefined, ifuncs, functions = [], [], []
    for line in _run([readelf, "-sW", str(obj)]).splitlines():
        m = _SYM.match(line)
        if not m:
            continue
        value, size, typ, bind, ndx, name = m.groups()
        if ndx == "UND" and name:
            undefined.append(name)
        if typ in ("IFUNC", "LOOS"):  # LOOS is how older readelfs print STT_GNU_IFUNC
            ifuncs.append(name)
        if typ == "FUNC" and ndx in sections:
            functions.append(_Function(name, sections[ndx], int(value, 16), int(size, 0), bind == "LOCAL"))
    relocs: dict[str, list[tuple[int, str, int]]] = {}  # section -> (offset, symbol, addend)
    current: list[tuple[int, str, int]] = []
    for line in _run([readelf, "-rW", str(obj)]).splitlines():
        if m := _REL_SECTION.match(line):
            current = relocs.setdefault(re.sub(r"^\.rela?(?=\.)", "", m[1]), [])
        elif m := _REL.match(line):
            off, sym, sign, addend = m.groups()
            current.append((int(off, 16), sym, int(addend, 16) * (-1 if sign == "-" else 1) if addend else 0))

    def entry(sym: str, addend: int) -> Entry:
        fn = next((f for f in functions if f.name == sym or (f.section == sym and f.start == addend)), None)
        if fn is None:
            return Entry(f"{sym}+{addend:#x}" if sym.startswith(".") else sym, False, frozenset())
        refs = frozenset(s for off, s, _ in relocs.get(fn.section, ()) if fn.start <= off < fn.start + fn.size)
        return Entry(fn.name, fn.local, refs)

    return ObjectInfo(tuple(sorted(set(undefined))), tuple(sorted(set(ifuncs))),
                      {sec: tuple(entry(sym, addend) for _, sym, addend in relocs.get(sec, ())) for sec in load_time})


def _sanitizer_entry(e: Entry, prefixes: tuple[str, ...] = _SANITIZER_PREFIXES) -> bool:
    """A sanitizer's own module constructor/destructor: GCC's local `_sub_I_00099_1` /
    `_sub_D_00099_0`, calling nothing but the sanitizer runtime (`prefixes`)."""
    return (e.local and re.fullmatch(r"_sub_[ID]_\d{5}_\d+", e.function) is not None
            and all(r.startswith(prefixes) or r.startswith(".") for r in e.references))


def demangle(names: list[str]) -> dict[str, str]:
    """{mangled: readable} (c++filt when installed, else the names as they are)."""
    found = shutil.which("c++filt")
    if not found or not names:
        return {n: n for n in names}
    try:
        res = subprocess.run([found], input="\n".join(names), capture_output=True, text=True, timeout=60)
        out = res.stdout.splitlines()
    except OSError:
        out = []
    return dict(zip(names, out, strict=False)) if len(out) == len(names) else {n: n for n in names}


# ---- the check ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    symbol: str  # the symbol (or section) that breaks a rule
    rule: str  # short rule name
    message: str  # what is wrong, for a person
    target: str = ""  # for a load-time section: the function its entry runs
    word: str = ""  # the name a source would spell it with (to find it in the text)


def _base_name(readable: str) -> str:
    """'std::system(char const*)' -> 'system'."""
    return re.sub(r"\(.*$", "", readable).split("::")[-1].strip()


def check_object(obj: Path, sanitize: bool = False, race_check: bool = False) -> list[Violation]:
    """Every rule the object breaks. `sanitize`/`race_check`: the object was built with kgen's
    instrumentation (ASan/UBSan, or -fsanitize=thread for the race detector), whose calls and
    module constructor kgen itself added."""
    info = read_object(obj)
    bad = [s for s in info.undefined if not symbol_allowed(s, sanitize, race_check)]
    readable = demangle(bad + list(info.ifuncs))
    out: list[Violation] = []
    at_exit = [s for s in bad if s in _AT_EXIT]
    if at_exit:
        out.append(Violation(at_exit[0], "static-object", "a static object with a destructor (it registers code to "
                             f"run at exit through '{at_exit[0]}') is not allowed in a kernel source"))
    for sym in bad:
        name = _base_name(readable[sym])
        if sym in _AT_EXIT:
            continue
        if name in HOST_ONLY_CALLS:
            out.append(Violation(sym, "host-only-call", f"host-only call '{name}' is not allowed in a kernel "
                                 f"source (allowed: {ALLOWED_SUMMARY})", word=name))
        else:
            out.append(Violation(sym, "outside-allow-list", f"call to '{readable[sym]}' is not allowed in a kernel "
                                 f"source: it is not on kgen's allow-list ({ALLOWED_SUMMARY})", word=name))
    for sym in info.ifuncs:
        out.append(Violation(sym, "load-time-code", f"indirect function '{readable[sym]}' (its resolver runs "
                             "when the library is loaded) is not allowed in a kernel source"))
    for sec, entries in info.load_time.items():
        flagged = [e for e in entries if not ((sanitize and _sanitizer_entry(e))
                                              or (race_check and _sanitizer_entry(e, _TSAN_PREFIXES)))]
        if entries and not flagged:
            continue
        for e in flagged or (Entry("", False, frozenset()),):
            out.append(Violation(sec, "load-time-code", "code that runs when the library is loaded or unloaded "
                                 "(a static initializer, a global object with dynamic initialization, or a "
                                 f"constructor/destructor function: section {sec}) is not allowed in a kernel source",
                                 e.function))
    return out


# ---- locating a violation in the source -------------------------------------------------------

_LINE = re.compile(r"^(?P<file>[^\s:][^:]*):(?P<line>\d+)(?: \(discriminator \d+\))?$")
_RELOC = re.compile(r"^\s+[0-9a-f]+: R_\w+\s+(?P<sym>[^\s+-]+)")
_FUNC = re.compile(r"^[0-9a-f]+ <(?P<sym>[^>]+)>:$")


def locate(obj: Path, violations: list[Violation]) -> list[tuple[str, int] | None]:
    """(file, line) of each violation: where its symbol is first used, read from the line table
    of `obj` (an object built with -g1); a load-time section at the first line of the function
    its entry runs. Best effort: None where no line is found."""
    objdump = shutil.which("objdump")
    if not objdump or not violations:
        return [None] * len(violations)
    try:
        text = subprocess.run([objdump, "-d", "-l", "-r", "--no-show-raw-insn", str(obj)],
                              capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return [None] * len(violations)
    first_use: dict[str, tuple[str, int]] = {}
    func_line: dict[str, tuple[str, int]] = {}  # a function's first line
    last_use: dict[str, tuple[str, int]] = {}  # a function's last relocation: a static initializer's store
    func, where = None, None
    for line in text.splitlines():
        if m := _FUNC.match(line):
            func, where = m["sym"], None
        elif m := _LINE.match(line):
            where = (m["file"], int(m["line"]))
            if func is not None:
                func_line.setdefault(func, where)
        elif (m := _RELOC.match(line)) and where is not None:
            first_use.setdefault(m["sym"], where)
            if func is not None:
                last_use[func] = where

    def place(v: Violation) -> tuple[str, int] | None:
        if not v.target:
            return first_use.get(v.symbol)
        if v.target.startswith("_GLOBAL__sub_I"):  # the dynamic initialization of a global
            return last_use.get(v.target) or func_line.get(v.target)
        return func_line.get(v.target)

    return [place(v) for v in violations]


class ObjectPolicyError(KgenUserError):
    """The kernel's object breaks the source policy; `.violations` lists every problem."""

    def __init__(self, messages: list[str], violations: list[Violation]):
        self.violations = violations
        super().__init__("\n".join(messages))
