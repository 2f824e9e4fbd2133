"""Find the CUDA headers directory (cuda_fp16.h & co.) without a system CUDA."""

from __future__ import annotations

import functools
from pathlib import Path

from kgen import settings
from kgen.errors import ToolchainError


@functools.lru_cache(maxsize=4)
def _find(cuda_home: str | None) -> Path:
    if cuda_home:
        inc = Path(cuda_home) / "include"
        if (inc / "cuda_fp16.h").is_file():
            return inc
        raise ToolchainError(
            f"KGEN_CUDA_HOME={cuda_home!r}: {inc}/cuda_fp16.h not found; point it at a CUDA toolkit root "
            "(the directory holding include/), or unset it to use NVIDIA's pip wheels"
        )
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception as e:  # noqa: BLE001 - any failure means "not found"
        raise ToolchainError(
            f"CUDA headers not found ({e}); install nvidia-cuda-runtime (pip) or set KGEN_CUDA_HOME"
        ) from e
    if not found or not (Path(found) / "cuda_fp16.h").is_file():
        raise ToolchainError(
            "CUDA headers (cuda_fp16.h) not found: install the nvidia-cuda-runtime and nvidia-cuda-crt wheels "
            "(pip) or set KGEN_CUDA_HOME to a CUDA toolkit root"
        )
    return Path(found)


def cuda_include_dir() -> Path:
    """The directory holding cuda_fp16.h: $KGEN_CUDA_HOME/include when set, else NVIDIA's wheels."""
    return _find(settings.KGEN_CUDA_HOME.get())
