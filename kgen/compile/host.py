"""Compile generated CUDA source for the CPU backend: g++ + the SIMT runtime header.

`compile_host(source, kernel_names)` builds a shared library holding the kernels and a
launch shim that exports (C ABI):

    int kgen_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz,
                    unsigned bx, unsigned by, unsigned bz, size_t smem,
                    void** args, char* err, size_t errlen);
        // args: cuLaunchKernel-style, args[i] points at parameter i's value.
        // 0 = ok; nonzero = error, message in err.
    const char* kgen_signature(const char* kernel);   // "p,i4,f4": parameter type codes, NULL if unknown
    void kgen_set_options(unsigned workers, size_t stack_bytes);  // 0 = default
    void kgen_set_schedule(int schedule, unsigned long long seed);  // thread order in a block; 0 = default

With `race_check=True` the kernels are instrumented for shared-memory race detection
(templates/simt/kgen_simt_race.h): the source is compiled with g++'s -fsanitize=thread and
line tables, the SIMT runtime as a second, uninstrumented object linked first (it provides
the instrumentation callbacks: no TSan runtime, which fibers would break).

Artifacts are cached (kgen.cache) under the key of everything that shapes the library.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kgen.cache import ArtifactCache, content_key
from kgen.compile.cuda_headers import cuda_include_dir, headers_fingerprint
from kgen.errors import CompileError, ToolchainError
from kgen.paths import simt_dir
from kgen.settings import KGEN_CXX

NAMESPACE = "host"
SOURCE_NAME = "kernel.cu"
SHIM_NAME = "shim.cpp"
LIB_NAME = "kernel.so"
BASE_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread",
              "-fstack-clash-protection")  # big frames probe page by page: overflows hit the guard page
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")
RACE_FLAGS = ("-DKGEN_SIMT_RACECHECK", "-g1")
# The kernel's object only; linking with -fsanitize=thread would pull in libtsan.
RACE_KERNEL_FLAGS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0")
RACE_LINK_FLAGS = ("-Wl,-z,defs",)  # a compiler callback the runtime lacks fails the build, not the load
RUNTIME_NAME = "runtime.cpp"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class HostArtifact:
    library: Path  # the shared library
    source_path: Path  # the compiled source, as the library's debug info names it
    kernel_names: tuple[str, ...]
    sanitize: bool
    key: str
    cache_hit: bool
    build_seconds: float  # 0.0 on a cache hit
    extra_flags: tuple[str, ...] = ()
    cache_root: Path | None = None  # the ArtifactCache holding it (for rebuild_host)
    race_check: bool = False  # shared-memory race detection compiled in


def compiler() -> str:
    """Absolute path of the C++ compiler (KGEN_CXX or g++); ToolchainError if missing."""
    name = KGEN_CXX.value()
    found = shutil.which(name)
    if not found:
        raise ToolchainError(
            f"C++ compiler {name!r} not found"
            + (" (from KGEN_CXX)" if KGEN_CXX.source() == "environment" else " on PATH")
            + "; the CPU backend needs g++ >= 9: install it or set KGEN_CXX to its path"
        )
    return found


@functools.lru_cache(maxsize=8)
def _compiler_version(path: str, _mtime: float) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise ToolchainError(f"C++ compiler {path!r} (KGEN_CXX) cannot run: {e}") from e
    if out.returncode != 0:
        raise ToolchainError(f"C++ compiler {path!r} (KGEN_CXX) failed on --version: {out.stderr.strip()[:500]}")
    return out.stdout


def compiler_version(path: str) -> str:
    return _compiler_version(path, os.path.getmtime(path))


def simt_headers() -> list[Path]:
    return sorted(p for p in simt_dir().iterdir() if p.suffix == ".h")


def _shim(kernel_names: Sequence[str]) -> str:
    lines = [
        f'#include "{SOURCE_NAME}"',
        "#include <cstring>",
        "#include <string>",
        '#define SHIM_EXPORT extern "C" __attribute__((visibility("default")))',
        "SHIM_EXPORT int kgen_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,",
        "                            unsigned by, unsigned bz, size_t smem, void** args, char* err, size_t errlen) {",
        "  dim3 g(gx, gy, gz), b(bx, by, bz);",
    ]
    for name in kernel_names:
        lines.append(
            f'  if (std::strcmp(kernel, "{name}") == 0) '
            f'return ::kgen_simt::launch_kernel("{name}", &::{name}, g, b, smem, args, err, errlen);'
        )
    lines += [
        '  return ::kgen_simt::write_err(err, errlen, std::string("unknown kernel \'") + kernel + "\'");',
        "}",
        "SHIM_EXPORT const char* kgen_signature(const char* kernel) {",
    ]
    for name in kernel_names:
        lines.append(
            f'  if (std::strcmp(kernel, "{name}") == 0) {{ static const std::string s = '
            f"::kgen_simt::signature(&::{name}); return s.c_str(); }}"
        )
    lines += [
        "  return nullptr;",
        "}",
        "SHIM_EXPORT void kgen_set_options(unsigned workers, size_t stack_bytes) {",
        "  ::kgen_simt::g_options.workers = workers;",
        "  ::kgen_simt::g_options.stack_size = stack_bytes;",
        "}",
        "SHIM_EXPORT void kgen_set_schedule(int schedule, unsigned long long seed) {",
        "  ::kgen_simt::g_options.schedule = schedule;",
        "  ::kgen_simt::g_options.seed = seed;",
        "}",
        "",
    ]
    return "\n".join(lines)


_DIAG = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|fatal error): (?P<msg>.*)$")


def _compile_error(stderr: str, source: str, max_errors: int = 5) -> CompileError:
    src_lines = source.splitlines()
    shown: list[str] = []
    n_errors = 0
    for line in stderr.splitlines():
        m = _DIAG.match(line)
        if not m:
            continue
        n_errors += 1
        if len(shown) >= max_errors * 2:
            continue
        shown.append(line)
        if m["file"] == SOURCE_NAME:
            ln = int(m["line"])
            if 1 <= ln <= len(src_lines):
                shown.append(f"  {ln:5d} | {src_lines[ln - 1]}")
    if not shown:  # no parsable diagnostic (linker error, crash): show the raw tail
        shown = stderr.strip().splitlines()[-20:]
    head = f"g++ failed to compile the generated source ({n_errors} error(s)); first errors:"
    return CompileError("\n".join([head, *shown]))


def _run_compiler(cxx: str, commands: list[list[str]], cwd: Path, source: str) -> None:
    """Run the commands side by side; CompileError (the source's diagnostics) if one fails."""
    try:
        procs = [subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for c in commands]
    except OSError as e:
        raise ToolchainError(f"C++ compiler {cxx!r} (KGEN_CXX) cannot run: {e}") from e
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        if p.returncode != 0:
            raise _compile_error(err, source)


def compile_host(
    source: str,
    kernel_names: Sequence[str],
    *,
    sanitize: bool = False,
    race_check: bool = False,
    extra_flags: Sequence[str] = (),
    cache: ArtifactCache | None = None,
) -> HostArtifact:
    """Build (or fetch from the cache) the CPU shared library for `source`'s kernels
    (`race_check`: with shared-memory race detection, see the module docstring)."""
    names = tuple(kernel_names)
    if not names:
        raise ValueError("compile_host: kernel_names is empty")
    for n in names:
        if not _IDENT.match(n):
            raise ValueError(f"compile_host: kernel name {n!r} is not a C identifier")
    if len(set(names)) != len(names):
        raise ValueError(f"compile_host: duplicate kernel names in {names}")
    if sanitize and race_check:
        raise ValueError("compile_host: sanitize (ASan) and race_check (TSan instrumentation) cannot be combined")
    cxx = compiler()
    version = compiler_version(cxx)
    inc = cuda_include_dir()
    sdir = simt_dir()
    flags = [*BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else ()), *(RACE_FLAGS if race_check else ()), *extra_flags]
    headers = simt_headers()
    key = content_key(
        "host-v1",
        source,
        "\0".join(names),
        *(p.name + "\0" + p.read_text() for p in headers),
        "\0".join(flags),
        version,
        headers_fingerprint(inc),
        f"sanitize={int(sanitize)}",
        f"race_check={int(race_check)}",
    )
    build_time = [0.0]

    def build(tmp: Path) -> None:
        (tmp / SOURCE_NAME).write_text(source)
        (tmp / SHIM_NAME).write_text(_shim(names))
        head = [cxx, *flags, "-include", str(sdir / "kgen_simt.h"), "-I", str(sdir), "-I", str(inc), "-x", "c++"]
        t0 = time.perf_counter()
        if not race_check:
            _run_compiler(cxx, [[*head, SHIM_NAME, "-o", LIB_NAME]], tmp, source)
        else:  # two objects (instrumented kernel, plain runtime first), linked without the TSan runtime
            (tmp / RUNTIME_NAME).write_text("// the SIMT runtime, uninstrumented (kgen_simt_tsan.h)\n")
            _run_compiler(cxx, [[*head, *RACE_KERNEL_FLAGS, "-c", SHIM_NAME, "-o", "kernel.o"],
                                [*head, "-DKGEN_SIMT_RUNTIME_TU", "-c", RUNTIME_NAME, "-o", "runtime.o"]], tmp, source)
            _run_compiler(cxx, [[cxx, *BASE_FLAGS, *RACE_LINK_FLAGS, *extra_flags, "runtime.o", "kernel.o",
                                 "-o", LIB_NAME]], tmp, source)
            for name in ("kernel.o", "runtime.o"):
                (tmp / name).unlink()
        build_time[0] = time.perf_counter() - t0

    cache = cache or ArtifactCache()
    entry, hit = cache.get_or_build(NAMESPACE, key, build)
    return HostArtifact(
        library=entry / LIB_NAME,
        source_path=entry / SOURCE_NAME,
        kernel_names=names,
        sanitize=sanitize,
        race_check=race_check,
        key=key,
        cache_hit=hit,
        build_seconds=build_time[0],
        extra_flags=tuple(extra_flags),
        cache_root=cache.root,
    )


def rebuild_host(artifact: HostArtifact) -> HostArtifact:
    """Drop `artifact`'s cache entry and build it again (for a cached library that passed its hash
    check but does not load, e.g. one built on another machine sharing the cache)."""
    source = artifact.source_path.read_text()
    cache = ArtifactCache(artifact.cache_root)
    cache.discard(NAMESPACE, artifact.key)
    return compile_host(source, artifact.kernel_names, sanitize=artifact.sanitize, race_check=artifact.race_check,
                        extra_flags=artifact.extra_flags, cache=cache)
