"""Every environment variable kgen reads, declared once (name, meaning, default)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        return value if value else None


KGEN_CACHE_DIR = EnvVar("KGEN_CACHE_DIR", "directory of the compiled-artifact cache (default: user cache)")
KGEN_CUDA_HOME = EnvVar(
    "KGEN_CUDA_HOME",
    "use this CUDA toolkit's headers instead of NVIDIA's pip wheels (a system CUDA is used only when set)",
)
KGEN_CXX = EnvVar("KGEN_CXX", "C++ compiler for the CPU backend (default: g++)")
KGEN_BACKEND = EnvVar("KGEN_BACKEND", "force the backend that backend='auto' picks: cuda or cpu")

ALL = [KGEN_CACHE_DIR, KGEN_CUDA_HOME, KGEN_CXX, KGEN_BACKEND]


def cache_dir() -> Path:
    override = KGEN_CACHE_DIR.get()
    return Path(override) if override else Path(platformdirs.user_cache_dir("kgen"))
