"""Disassembling cubins: finding cuobjdump (and the nvdisasm it runs) and reading a cubin's SASS.

The tools come from NVIDIA's pip wheels (`nvidia-cuda-cuobjdump`, `nvidia-cuda-nvdisasm`, both in
kgen's test extra) or from PATH. `kgen perf`, `kgen verify --source` and benchmarks/static_perf.py
use them; nothing here needs a GPU.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from kgen.errors import ToolchainError
from kgen.settings import child_environment

INSTALL = "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"


def wheel_binary(dist: str, name: str) -> str | None:
    """A binary an NVIDIA pip wheel installed (None when the wheel is absent)."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if f.name == name]
    return str(found[0]) if found else None


def find_cuobjdump() -> str | None:
    return wheel_binary("nvidia-cuda-cuobjdump", "cuobjdump") or shutil.which("cuobjdump")


def cuobjdump_env(cuobjdump: str) -> dict:
    """cuobjdump -sass runs nvdisasm: point it at the nvidia-cuda-nvdisasm wheel's when there is one."""
    env = child_environment()
    nvdisasm = wheel_binary("nvidia-cuda-nvdisasm", "nvdisasm")
    if nvdisasm:
        env["PATH"] = str(Path(nvdisasm).parent) + os.pathsep + env.get("PATH", "")
    return env


def sass_text(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        run = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True,
                             env=cuobjdump_env(cuobjdump))
    if run.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass failed: {run.stderr.strip() or run.stdout.strip()}")
    return run.stdout


@lru_cache(maxsize=1)
def usable_cuobjdump() -> str | None:
    """cuobjdump when it can disassemble here (it needs nvdisasm beside it or on PATH), else None."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probe_file = Path(tmp, "empty.cubin")
        probe_file.write_bytes(b"")
        probe = subprocess.run([tool, "-sass", str(probe_file)], capture_output=True, text=True,
                               env=cuobjdump_env(tool))
    return None if "nvdisasm" in probe.stderr else tool


def require_cuobjdump() -> str:
    """The usable cuobjdump, or a ToolchainError (exit 2) saying how to install it."""
    tool = usable_cuobjdump()
    if tool is None:
        missing = "cuobjdump" if find_cuobjdump() is None else "nvdisasm (cuobjdump -sass runs it)"
        raise ToolchainError(f"{missing} not found: the static performance model reads the SASS. Install the "
                             f"tools with `{INSTALL}` (both are in kgen's test extra)")
    return tool
