"""Compile generated CUDA source for the CPU backend: g++ + the SIMT runtime header.

`compile_host(source, kernel_names)` builds a shared library holding the kernels and a
launch shim. The kernel source is compiled as its own translation unit (with per-kernel glue,
templates/simt/kgen_simt_glue.h) and the object is checked (kgen/compile/object_check.py:
allow-listed calls only, no load-time code) before it is linked with the shim (the SIMT runtime,
the same cached object for every kernel) and a small dispatch from kernel names to the glue. The
library exports (C ABI):

    int kgen_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz,
                    unsigned bx, unsigned by, unsigned bz, size_t smem,
                    void** args, char* err, size_t errlen);
        // args: cuLaunchKernel-style, args[i] points at parameter i's value.
        // 0 = ok; nonzero = error, message in err.
    const char* kgen_signature(const char* kernel);   // "p,i4,f4": parameter type codes, NULL if unknown
    void kgen_set_options(unsigned workers, size_t stack_bytes);  // 0 = default
    void kgen_set_schedule(int schedule, unsigned long long seed);  // thread order in a block; 0 = default
    size_t kgen_keep_stacks(int keep);  // fiber stacks between launches: keep (1), unmap (0), as they
                                        // are (-1); returns the memory maps they hold now

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
from kgen.compile.cuda_headers import cuda_include_dirs, headers_fingerprint
from kgen.compile.line_map import display_name, find_word, source_line
from kgen.compile.object_check import ObjectPolicyError, binutil, check_object, locate
from kgen.compile.provided import kgen_headers_digest, write_kgen_headers
from kgen.errors import CompileError, ToolchainError
from kgen.paths import simt_dir
from kgen.settings import KGEN_CXX

NAMESPACE = "host"
SOURCE_NAME = "kernel.cu"
SHIM_NAME = "shim.cpp"
DISPATCH_NAME = "dispatch.cpp"
LIB_NAME = "kernel.so"
GLUE_HEADER = "kgen_simt_glue.h"
RACE_FLAGS = ("-DKGEN_SIMT_RACECHECK", "-g1")
# The kernel's object only; linking with -fsanitize=thread would pull in libtsan.
RACE_KERNEL_FLAGS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0")
RACE_LINK_FLAGS = ("-Wl,-z,defs",)  # a compiler callback the runtime lacks fails the build, not the load
BASE_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread",
              "-fstack-clash-protection",  # big frames probe page by page: overflows hit the guard page
              "-fno-aggressive-loop-optimizations")  # a loop that runs past an array runs (no UB-based trimming)
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")
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


_GLUE_MARK = '\n#line 1 "<kgen glue>"'


def _glue(kernel_names: Sequence[str]) -> str:
    """What host.py appends to the kernel's translation unit: per kernel, a type-erased body and
    its parameter type codes (the shim, compiled apart, cannot see the parameter types)."""
    lines = [_GLUE_MARK, f'#include "{GLUE_HEADER}"']
    for name in kernel_names:
        lines.append(f'extern "C" void kgen_glue_run_{name}(void* args) {{ ::kgen_glue::run(&::{name}, args); }}')
        lines.append(f'extern "C" const char* kgen_glue_sig_{name}() {{ return ::kgen_glue::signature(&::{name}); }}')
    return "\n".join(lines) + "\n"


# The shim: the SIMT runtime and the options, the same object for every kernel (compiled once per
# flags, headers and compiler, and cached); `_dispatch` maps kernel names onto it in a small
# translation unit without includes, compiled with each library.
_SHIM = """\
#include <cstring>
#include <string>
#define SHIM_EXPORT extern "C" __attribute__((visibility("default")))
extern "C" int kgen_shim_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, size_t smem, void (*body)(void*), void** args,
                                char* err, size_t errlen) {
  if (body == nullptr)
    return ::kgen_simt::write_err(err, errlen, std::string("unknown kernel '") + kernel + "'");
  dim3 g(gx, gy, gz), b(bx, by, bz);
  return ::kgen_simt::launch(kernel, g, b, smem, body, args, err, errlen);
}
SHIM_EXPORT void kgen_set_options(unsigned workers, size_t stack_bytes) {
  ::kgen_simt::g_options.workers = workers;
  ::kgen_simt::g_options.stack_size = stack_bytes;
}
SHIM_EXPORT void kgen_set_schedule(int schedule, unsigned long long seed) {
  ::kgen_simt::g_options.schedule = schedule;
  ::kgen_simt::g_options.seed = seed;
}
SHIM_EXPORT size_t kgen_keep_stacks(int keep) { return ::kgen_simt::keep_stacks(keep); }
"""


def _dispatch(kernel_names: Sequence[str]) -> str:
    """kgen_launch and kgen_signature for these kernels: names to glue entry points."""
    lines = [
        "typedef __SIZE_TYPE__ kgen_size_t;",
        '#define SHIM_EXPORT extern "C" __attribute__((visibility("default")))',
        'extern "C" int kgen_shim_launch(const char*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,',
        "                                kgen_size_t, void (*)(void*), void**, char*, kgen_size_t);",
    ]
    for name in kernel_names:
        lines.append(f'extern "C" void kgen_glue_run_{name}(void*);')
        lines.append(f'extern "C" const char* kgen_glue_sig_{name}();')
    lines += [
        "SHIM_EXPORT int kgen_launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,",
        "                            unsigned by, unsigned bz, kgen_size_t smem, void** args, char* err,",
        "                            kgen_size_t errlen) {",
        "  void (*body)(void*) = nullptr;",
    ]
    for name in kernel_names:
        lines.append(f'  if (__builtin_strcmp(kernel, "{name}") == 0) body = &kgen_glue_run_{name};')
    lines += [
        "  return kgen_shim_launch(kernel, gx, gy, gz, bx, by, bz, smem, body, args, err, errlen);",
        "}",
        "SHIM_EXPORT const char* kgen_signature(const char* kernel) {",
    ]
    for name in kernel_names:
        lines.append(f'  if (__builtin_strcmp(kernel, "{name}") == 0) return kgen_glue_sig_{name}();')
    lines += ["  return nullptr;", "}", ""]
    return "\n".join(lines)


_DIAG = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|fatal error): (?P<msg>.*)$")


def _compile_error(stderr: str, source: str, max_errors: int = 5) -> CompileError:
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
        text = source_line(source, m["file"], int(m["line"]), SOURCE_NAME)  # follows #line to the user's file
        if text is not None:
            shown.append(f"  {int(m['line']):5d} | {text}")
    if not shown:  # no parsable diagnostic (linker error, crash): show the raw tail
        shown = stderr.strip().splitlines()[-20:]
    what = display_name(source) or "the generated source"
    head = f"g++ failed to compile {what} ({n_errors} error(s)); first errors:"
    return CompileError("\n".join([head, *shown]))


_SCRATCH = "build"  # objects and kgen's headers, removed once the library is linked
_OBJECT_FLAGS = ("-c", "-fno-diagnostics-show-caret", "-fdiagnostics-color=never")


def _run_compilers(cmds: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Run the commands side by side (the kernel and the shim compile independently)."""
    try:
        procs = [subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for c in cmds]
    except OSError as e:
        raise ToolchainError(f"C++ compiler {cmds[0][0]!r} (KGEN_CXX) cannot run: {e}") from e
    results = []
    for c, p in zip(cmds, procs, strict=True):
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    return results


SHIM_NAMESPACE = "host-shim"
SHIM_OBJECT = "shim.o"


class _ShimFailed(Exception):
    def __init__(self, result: subprocess.CompletedProcess):
        super().__init__("g++ refused the shim")
        self.result = result


def _shim_object(cxx: str, shim_cmd: list[str], key_parts: Sequence[str],
                 cache: ArtifactCache) -> tuple[Path | None, subprocess.CompletedProcess | None]:
    """The shim's object (the SIMT runtime: half of every build's g++ time), compiled once per
    (flags, headers, compiler) and cached; (None, the failed run) when g++ refuses it. Every input
    that shapes the object is in `key_parts` or the command."""

    def build(tmp: Path) -> None:
        (tmp / SHIM_NAME).write_text(_SHIM)
        (res,) = _run_compilers([[*shim_cmd[:-1], SHIM_OBJECT]], tmp)
        (tmp / SHIM_NAME).unlink()
        if res.returncode != 0:
            raise _ShimFailed(res)  # nothing is cached; the caller reports g++'s own message

    key = content_key("host-shim-v2", _SHIM, "\0".join(shim_cmd[:-1]), *key_parts)
    try:
        entry, _ = cache.get_or_build(SHIM_NAMESPACE, key, build)
    except _ShimFailed as e:
        return None, e.result
    return entry / SHIM_OBJECT, None


def _build_library(cxx: str, flags: list[str], tmp: Path, source: str, sdir: Path, incs: Sequence[Path],
                   sanitize: bool, race_check: bool, object_policy: bool, cache: ArtifactCache,
                   key_parts: Sequence[str]) -> None:
    """kernel.cu -> kernel.o (checked), linked with the shim's object (cached apart: it depends on
    the flags only) and the names' dispatch into kernel.so (shim first). With `race_check` only the kernel's
    object is instrumented; the shim carries the runtime, uninstrumented, and the instrumentation
    callbacks (KGEN_SIMT_RUNTIME_TU)."""
    scratch = tmp / _SCRATCH
    include = write_kgen_headers(scratch / "include")
    obj_flags = [f for f in flags if f != "-shared"]
    cuda = [arg for d in incs for arg in ("-I", str(d))]
    common = ["-include", str(sdir / "kgen_simt.h"), "-I", str(sdir), *cuda, "-I", str(include)]
    kernel_o = scratch / "kernel.o"
    race_kernel = list(RACE_KERNEL_FLAGS) if race_check else []
    race_shim = ["-DKGEN_SIMT_RUNTIME_TU"] if race_check else []
    kernel_cmd = [cxx, *obj_flags, *race_kernel, *_OBJECT_FLAGS, *common, "-x", "c++", SOURCE_NAME, "-o", str(kernel_o)]
    # The shim's command without tmp's paths (kgen's headers are in key_parts), so that its key is stable.
    shim_cmd = [cxx, *obj_flags, *race_shim, *_OBJECT_FLAGS, "-include", str(sdir / "kgen_simt.h"), "-I", str(sdir),
                *cuda, "-x", "c++", SHIM_NAME, "-o", SHIM_OBJECT]
    dispatch_o = scratch / "dispatch.o"
    dispatch_cmd = [cxx, *obj_flags, *_OBJECT_FLAGS, "-x", "c++", DISPATCH_NAME, "-o", str(dispatch_o)]
    kernel_res, dispatch_res = _run_compilers([kernel_cmd, dispatch_cmd], tmp)
    if kernel_res.returncode != 0:
        raise _compile_error(kernel_res.stderr, source)
    violations = check_object(kernel_o, sanitize=sanitize, race_check=race_check) if object_policy else []
    if violations:
        raise _object_policy_error(kernel_cmd, kernel_o, violations, source, tmp)
    shim_o, shim_failed = _shim_object(cxx, shim_cmd, key_parts, cache)
    for failed in (shim_failed, dispatch_res if dispatch_res.returncode != 0 else None):
        if failed is not None:
            raise _compile_error(failed.stderr, source)
    link_flags = list(RACE_LINK_FLAGS) if race_check else []
    (link,) = _run_compilers([[cxx, *flags, *link_flags, str(shim_o), str(dispatch_o), str(kernel_o), "-o", LIB_NAME]], tmp)
    if link.returncode != 0:
        raise _compile_error(link.stderr, source)


def _object_policy_error(kernel_cmd: list[str], kernel_o: Path, violations, source: str,
                         tmp: Path) -> ObjectPolicyError:
    """The violations, each at its source line: from the line table of a -g1 rebuild of the object
    (DWARF 4: binutils 2.40 misnames #line files in DWARF 5), else where the text names the symbol."""
    debug_o = kernel_o.with_suffix(".g.o")
    cmd = [kernel_cmd[0], "-g1", "-gdwarf-4", *kernel_cmd[1:-1], str(debug_o)]
    ok = _run_compilers([cmd], tmp)[0].returncode == 0
    where = locate(debug_o, violations) if ok else [None] * len(violations)
    name = display_name(source) or SOURCE_NAME
    messages = []
    for v, at in zip(violations, where, strict=True):
        at = at or find_word(source, v.word, SOURCE_NAME)
        messages.append(f"{Path(at[0]).name}:{at[1]}: {v.message}" if at else f"{name}: {v.message}")
    return ObjectPolicyError(messages, violations)


def compile_host(
    source: str,
    kernel_names: Sequence[str],
    *,
    sanitize: bool = False,
    race_check: bool = False,
    extra_flags: Sequence[str] = (),
    cache: ArtifactCache | None = None,
    object_policy: bool = True,
) -> HostArtifact:
    """Build (or fetch from the cache) the CPU shared library for `source`'s kernels
    (`race_check`: with shared-memory race detection, see the module docstring). `object_policy`
    False skips the object check: only for tests of the isolation behind it (a library built
    so is cached under its own key and never served to a checked build)."""
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
    binutil("readelf")  # the object check needs it: say so before compiling
    incs = cuda_include_dirs()  # the first holds cuda_fp16.h
    sdir = simt_dir()
    flags = [*BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else ()), *(RACE_FLAGS if race_check else ()), *extra_flags]
    headers = simt_headers()
    key = content_key(
        "host-v2",
        source,
        _SHIM,
        "\0".join(names),
        *(p.name + "\0" + p.read_text() for p in headers),
        kgen_headers_digest(),
        "\0".join(flags),
        version,
        headers_fingerprint(incs[0]),
        f"sanitize={int(sanitize)}",
        f"race_check={int(race_check)}",
        *(() if object_policy else ("object_policy=0",)),
    )
    build_time = [0.0]
    cache = cache or ArtifactCache()
    shim_key_parts = (*(p.name + "\0" + p.read_text() for p in headers), version, headers_fingerprint(incs[0]))

    def build(tmp: Path) -> None:
        (tmp / SOURCE_NAME).write_text(source + _glue(names))
        (tmp / DISPATCH_NAME).write_text(_dispatch(names))
        t0 = time.perf_counter()
        try:
            _build_library(cxx, flags, tmp, source, sdir, incs, sanitize, race_check, object_policy, cache,
                           shim_key_parts)
        finally:
            build_time[0] = time.perf_counter() - t0
            shutil.rmtree(tmp / _SCRATCH, ignore_errors=True)

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
    source = source[: source.rfind(_GLUE_MARK)] if _GLUE_MARK in source else source  # compile_host adds it again
    cache = ArtifactCache(artifact.cache_root)
    cache.discard(NAMESPACE, artifact.key)
    return compile_host(source, artifact.kernel_names, sanitize=artifact.sanitize,
                        extra_flags=artifact.extra_flags, cache=cache, race_check=artifact.race_check)
