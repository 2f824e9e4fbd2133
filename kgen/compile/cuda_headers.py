"""Find the CUDA headers directory (cuda_fp16.h & co.) without a system CUDA, and fingerprint it."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from cuda import pathfinder

from kgen.compile import cuda_line
from kgen.errors import ToolchainError
from kgen.settings import KGEN_CUDA_HOME

# The number-format headers every generated kernel compiles against (on both backends): their
# content, not their path, goes into each compiled artifact's cache key.
FORMAT_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp8.h", "cuda_fp8.hpp",
                  "vector_types.h")


@functools.lru_cache(maxsize=4)
def _find(cuda_home: Path | None) -> tuple[Path, ...]:
    if cuda_home:
        inc = cuda_home / "include"
        if (inc / "cuda_fp16.h").is_file():
            # CUDA 13 toolkits keep CCCL (<nv/target>, which g++ needs) in include/cccl
            return (inc, *((inc / "cccl",) if (inc / "cccl" / "nv" / "target").is_file() else ()))
        raise ToolchainError(
            f"KGEN_CUDA_HOME={str(cuda_home)!r}: {inc}/cuda_fp16.h not found; point it at a CUDA toolkit root "
            "(the directory holding include/), or unset it to use NVIDIA's pip wheels"
        )
    # The installed CUDA line's headers (the runtime's first: it holds cuda_fp16.h).
    line_dirs = cuda_line.include_dirs()
    if line_dirs and (line_dirs[0] / "cuda_fp16.h").is_file():
        return line_dirs
    try:
        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception as e:  # noqa: BLE001 - any failure means "not found"
        raise ToolchainError(
            f"CUDA headers not found ({e}); install a CUDA line ({cuda_line.install_hint()}) or set KGEN_CUDA_HOME"
        ) from e
    if not found or not (Path(found) / "cuda_fp16.h").is_file():
        raise ToolchainError(
            f"CUDA headers (cuda_fp16.h) not found: install a CUDA line ({cuda_line.install_hint()}) "
            "or set KGEN_CUDA_HOME to a CUDA toolkit root"
        )
    return (Path(found),)


def cuda_include_dirs() -> tuple[Path, ...]:
    """Every CUDA header directory a kernel compiles against, in -I order: $KGEN_CUDA_HOME/include when
    set, else the installed CUDA line's wheels (one directory for CUDA 13; the runtime's, nvcc's crt/
    and CCCL's for CUDA 12)."""
    return _find(KGEN_CUDA_HOME.value())


def cuda_include_dir() -> Path:
    """The directory holding cuda_fp16.h (the first of cuda_include_dirs())."""
    return cuda_include_dirs()[0]


@functools.lru_cache(maxsize=8)
def _fingerprint(inc: Path, _stamps: tuple[float, ...]) -> str:
    h = hashlib.sha256()
    for name in FORMAT_HEADERS:
        path = inc / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"-")
    return h.hexdigest()


def headers_fingerprint(inc: Path) -> str:
    """sha256 of the number-format headers in `inc` (re-read when a file's mtime changes)."""
    stamps = tuple((inc / n).stat().st_mtime if (inc / n).is_file() else 0.0 for n in FORMAT_HEADERS)
    return _fingerprint(Path(inc), stamps)
