"""Compile generated CUDA source to a cubin per arch with NVRTC.

NVRTC is the installed CUDA line's wheel (kgen/compile/cuda_line.py; else what cuda-pathfinder
finds), called through
ctypes: CuPy's `nvrtc.getCUBIN` treats the cubin as a C string and drops its last byte,
which leaves an ELF that cuobjdump cannot read and a driver may refuse to load.
The arch is always named (`-arch=sm_XX`), so compiling needs no GPU. ptxas runs
inside NVRTC with `-v` (`--ptxas-options=-v`: its output is the program log); its report is parsed
into per-kernel resources, its performance advisories included (kgen/compile/advisories.py).
Cubins are cached by content (see kgen/cache.py).
"""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from cuda.pathfinder import load_nvidia_dynamic_lib

from kgen.cache import ArtifactCache, content_key
from kgen.compile import cuda_line
from kgen.compile.advisories import Advisory, numbered_advisories, resource_advisories
from kgen.compile.cuda_headers import (
    cuda_include_dir,
    cuda_include_dirs,
    headers_fingerprint,
)
from kgen.compile.line_map import display_name, source_line
from kgen.compile.provided import kgen_headers, kgen_headers_digest
from kgen.errors import CompileError, ToolchainError

# No --use_fast_math: it flushes denormals and approximates division, which the CPU backend would
# not reproduce; the kernels ask for fast intrinsics (__expf) explicitly where they want them.
BASE_OPTIONS = ("--std=c++17", "--ptxas-options=-v", "-default-device")


@dataclass
class KernelResources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    static_smem: int = 0
    local_bytes: int = 0
    advisories: list[Advisory] = field(default_factory=list)  # ptxas's, and local-memory use


@dataclass
class CubinArtifact:
    arch: str
    cubin: bytes
    resources: dict[str, KernelResources]
    log: str
    cache_hit: bool


_NVRTC_SUCCESS = 0
_Program = ctypes.c_void_p
# The cache namespace of cubins: "cubin" entries were written one byte short (CuPy's getCUBIN), so
# they are never looked up again.
CACHE_NAMESPACE = "cubin-v2"
PTX_NAMESPACE = "ptx"


def _preload_builtins(lib: Path) -> None:
    """Load libnvrtc-builtins from beside `lib` first: the 13.0 wheel's libnvrtc does not find its
    sibling by itself ("failed to open libnvrtc-builtins.so.13.0" at the first compile)."""
    for builtins in sorted(lib.parent.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """libnvrtc with the signatures kgen calls."""
    try:
        # The installed CUDA line's own NVRTC (torch may bring another major's, which cuda-pathfinder
        # could find first); without a line's wheel, wherever cuda-pathfinder finds one.
        line_lib = cuda_line.nvrtc_library()
        if line_lib:
            _preload_builtins(line_lib)
        path = str(line_lib) if line_lib else load_nvidia_dynamic_lib("nvrtc").abs_path
        if not path:
            raise OSError("cuda-pathfinder found no file for it")
        lib = ctypes.CDLL(path)
    except Exception as e:  # cuda.pathfinder's not-found errors, or the loader's OSError
        raise ToolchainError(f"could not load NVRTC ({e}); install a CUDA line: {cuda_line.install_hint()}") from e
    size_p, prog_p = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_Program)
    strings = ctypes.POINTER(ctypes.c_char_p)
    for name, args in {
        "nvrtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
        "nvrtcCreateProgram": [prog_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, strings, strings],
        "nvrtcCompileProgram": [_Program, ctypes.c_int, strings],
        "nvrtcGetProgramLogSize": [_Program, size_p],
        "nvrtcGetProgramLog": [_Program, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [_Program, size_p],
        "nvrtcGetCUBIN": [_Program, ctypes.c_char_p],
        "nvrtcGetPTXSize": [_Program, size_p],
        "nvrtcGetPTX": [_Program, ctypes.c_char_p],
        "nvrtcDestroyProgram": [prog_p],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    return lib


def _check(status: int, what: str) -> None:
    if status != _NVRTC_SUCCESS:
        reason = _library().nvrtcGetErrorString(status) or b"unknown error"
        raise ToolchainError(f"NVRTC {what} failed: {reason.decode()} ({status})")


def _read(prog: ctypes.c_void_p, size_fn, data_fn, what: str) -> bytes:
    """All `size` bytes NVRTC reports (a cubin is binary: no terminator to strip)."""
    size = ctypes.c_size_t()
    _check(size_fn(prog, ctypes.byref(size)), f"{what} size")
    buf = ctypes.create_string_buffer(size.value)
    if size.value:
        _check(data_fn(prog, buf), what)
    return buf.raw


def _program_log(prog: ctypes.c_void_p) -> str:
    lib = _library()
    return _read(prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, "log").rstrip(b"\0").decode(
        errors="replace")


def _compile(source: str, name: str, options: list[str], ptx: bool = False) -> tuple[bytes | None, str]:
    """(cubin, program log) of one NVRTC program; the cubin is None when compiling failed. With `ptx`,
    the PTX NVRTC generated on the way (text) instead of the cubin."""
    lib = _library()
    prog = _Program()
    provided = kgen_headers()  # "kgen/platform.cuh": NVRTC resolves kgen's headers from this list
    texts = (ctypes.c_char_p * len(provided))(*(v.encode() for v in provided.values()))
    names = (ctypes.c_char_p * len(provided))(*(k.encode() for k in provided))
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(provided), texts, names),
           "createProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        log = _program_log(prog)
        if status != _NVRTC_SUCCESS:
            return None, log or (lib.nvrtcGetErrorString(status) or b"").decode()
        if ptx:
            return _read(prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX, "getPTX").rstrip(b"\0"), log
        return _read(prog, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN, "getCUBIN"), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return f"{major.value}.{minor.value}"


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_LMEM = re.compile(r"(\d+) bytes lmem")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per-kernel resources from ptxas -v output, each with its advisories: the numbered ones ptxas
    printed about it, then the local memory its resource report shows."""
    out: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    name: str | None = None
    numbered = dict(numbered_advisories(log))
    for i, line in enumerate(log.splitlines()):
        if i in numbered:
            adv = numbered[i]
            kernel = adv.kernel or name or ""
            out.setdefault(kernel, KernelResources()).advisories.append(Advisory(adv.code, adv.message, kernel))
        elif m := _ENTRY.search(line):
            name = m.group(1)
            current = out.setdefault(name, KernelResources())
        elif current is not None and (m := _FRAME.search(line)):
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
            current.static_smem = int(m.group(2) or 0)
            if lm := _LMEM.search(line):
                current.local_bytes = int(lm.group(1))
    for kernel, res in out.items():
        res.advisories += resource_advisories(kernel, res.stack_frame, res.spill_stores, res.spill_loads,
                                              res.local_bytes)
    return out


def format_compile_error(source: str, log: str, origin: str, context: int = 2, name: str = "kernel.cu") -> str:
    """The compiler's errors, each followed by the source lines around it (`#line` directives
    followed: a hand-written kernel's errors name its own file and line)."""
    shown = display_name(source)
    parts = [f"NVRTC failed to compile {shown}:" if shown else
             f"NVRTC failed to compile the kernel generated from {origin}:"]
    for m in re.finditer(r"^(.*)\((\d+)\): (?:catastrophic )?error.*$", log, re.M):
        parts.append(m.group(0))
        n = int(m.group(2))
        for i in range(max(1, n - context), n + context + 1):
            text = source_line(source, m.group(1), i, name)
            if text is not None:
                parts.append(f"  {'>' if i == n else ' '} {i:5d} | {text}")
    if len(parts) == 1:
        parts.append(log.strip())
    return "\n".join(parts)


# A source whose first lines carry this comment uses sm_90a-only instructions (wgmma): its sm_90
# cubin is compiled for the arch-specific target sm_90a, which runs on sm_90 GPUs only.
SM90A_MARKER = "// kgen: arch-specific sm_90a"


def compile_arch(source: str, arch: str) -> str:
    """The -arch a target takes for `source`: sm_90 becomes sm_90a where the source asks for it."""
    return "sm_90a" if arch == "sm_90" and SM90A_MARKER in source[:2048] else arch


def compile_cubin(source: str, arch: str, *, origin: str = "<source>", name: str = "kernel.cu",
                  cache: ArtifactCache | None = None) -> CubinArtifact:
    """Compile `source` for `arch` (e.g. "sm_90"; sm_90a for a source marked SM90A_MARKER); cached
    by content."""
    arch = compile_arch(source, arch)
    include = cuda_include_dir()
    options = (f"-arch={arch}", *BASE_OPTIONS)
    key = content_key("nvrtc", source, json.dumps(options), nvrtc_version(), headers_fingerprint(include),
                      kgen_headers_digest())
    cache = cache or ArtifactCache()

    def build(tmp: Path) -> None:
        cubin, log = _compile(source, name, [*options, *(f"-I{d}" for d in cuda_include_dirs())])
        if cubin is None:
            raise CompileError(format_compile_error(source, log, origin, name=name))
        (tmp / "kernel.cubin").write_bytes(cubin)
        (tmp / "ptxas.log").write_text(log)
        (tmp / "kernel.cu").write_text(source)  # what the cubin and the log's line numbers come from

    entry, hit = cache.get_or_build(CACHE_NAMESPACE, key, build)
    log = (entry / "ptxas.log").read_text()
    return CubinArtifact(arch, (entry / "kernel.cubin").read_bytes(), parse_ptxas_report(log), log, hit)


def compile_ptx(source: str, arch: str, *, origin: str = "<source>", name: str = "kernel.cu",
                cache: ArtifactCache | None = None) -> str:
    """The PTX NVRTC generates for `source` on the way to compile_cubin's cubin (same options, sm_90a
    where the source asks for it): what the wgmma ordering check reads (kgen/compile/wgmma_order.py)."""
    arch = compile_arch(source, arch)
    include = cuda_include_dir()
    options = (f"-arch={arch}", *BASE_OPTIONS)
    key = content_key("nvrtc-ptx", source, json.dumps(options), nvrtc_version(), headers_fingerprint(include),
                      kgen_headers_digest())

    def build(tmp: Path) -> None:
        text, log = _compile(source, name, [*options, *(f"-I{d}" for d in cuda_include_dirs())], ptx=True)
        if text is None:
            raise CompileError(format_compile_error(source, log, origin, name=name))
        (tmp / "kernel.ptx").write_bytes(text)

    entry, _ = (cache or ArtifactCache()).get_or_build(PTX_NAMESPACE, key, build)
    return (entry / "kernel.ptx").read_text()


def resources_as_dict(resources: dict[str, KernelResources]) -> dict[str, dict[str, int]]:
    return {k: asdict(v) for k, v in resources.items()}
