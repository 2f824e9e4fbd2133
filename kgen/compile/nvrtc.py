"""Compile generated CUDA source to a cubin per arch with NVRTC (through CuPy's bindings).

The arch is always named (`-arch=sm_XX`), so compiling needs no GPU. ptxas runs
inside NVRTC with `-v`; its report is parsed into per-kernel resources.
Cubins are cached by content (see kgen/cache.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from kgen.cache import ArtifactCache, content_key
from kgen.compile.cuda_headers import cuda_include_dir, headers_fingerprint
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


@dataclass
class CubinArtifact:
    arch: str
    cubin: bytes
    resources: dict[str, KernelResources]
    log: str
    cache_hit: bool


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except Exception as e:  # ImportError, or CuPy failing to find libnvrtc
        raise ToolchainError(
            f"NVRTC is not available through CuPy ({e}); install kgen's dependencies "
            "(cupy-cuda13x and nvidia-cuda-nvrtc)"
        ) from e
    return nvrtc


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    try:
        major, minor = _nvrtc().getVersion()
    except Exception as e:
        raise ToolchainError(f"could not load NVRTC: {e}") from e
    return f"{major}.{minor}"


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per-kernel resources from ptxas -v output."""
    out: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), KernelResources())
        elif current is not None and (m := _FRAME.search(line)):
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
            current.static_smem = int(m.group(2) or 0)
    return out


def format_compile_error(source: str, log: str, origin: str, context: int = 2) -> str:
    """The compiler's errors, each followed by the generated source lines around it."""
    lines = source.splitlines()
    parts = [f"NVRTC failed to compile the kernel generated from {origin}:"]
    for m in re.finditer(r"^.*\((\d+)\): (?:catastrophic )?error.*$", log, re.M):
        parts.append(m.group(0))
        n = int(m.group(1))
        for i in range(max(1, n - context), min(len(lines), n + context) + 1):
            parts.append(f"  {'>' if i == n else ' '} {i:5d} | {lines[i - 1]}")
    if len(parts) == 1:
        parts.append(log.strip())
    return "\n".join(parts)


def compile_cubin(source: str, arch: str, *, origin: str = "<source>", name: str = "kernel.cu",
                  cache: ArtifactCache | None = None) -> CubinArtifact:
    """Compile `source` for `arch` (e.g. "sm_90"); cached by content."""
    include = cuda_include_dir()
    options = (f"-arch={arch}", *BASE_OPTIONS)
    key = content_key("nvrtc", source, json.dumps(options), nvrtc_version(), headers_fingerprint(include))
    cache = cache or ArtifactCache()

    def build(tmp: Path) -> None:
        nvrtc = _nvrtc()
        prog = nvrtc.createProgram(source, name, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, [*options, f"-I{include}"])
            except Exception as e:
                log = nvrtc.getProgramLog(prog)
                raise CompileError(format_compile_error(source, log or str(e), origin)) from None
            log = nvrtc.getProgramLog(prog)
            (tmp / "kernel.cubin").write_bytes(nvrtc.getCUBIN(prog))
            (tmp / "ptxas.log").write_text(log)
        finally:
            nvrtc.destroyProgram(prog)

    entry, hit = cache.get_or_build("cubin", key, build)
    log = (entry / "ptxas.log").read_text()
    return CubinArtifact(arch, (entry / "kernel.cubin").read_bytes(), parse_ptxas_report(log), log, hit)


def resources_as_dict(resources: dict[str, KernelResources]) -> dict[str, dict[str, int]]:
    return {k: asdict(v) for k, v in resources.items()}
