"""nvcc for the static benchmarks: FlashInfer's, vLLM's and FlashMLA's kernels are built with it (kgen's go
through NVRTC as always), cached by content in kgen's cache directory."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from kgen.cache import ArtifactCache, content_key

ARCH = "sm_90"
CACHE_NS = "static-perf"


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = Path(home, "bin", "nvcc") if home else None
    return str(cand) if cand and cand.exists() else shutil.which("nvcc")


def nvcc_cubin(source: str, flags: list[str], nvcc: str, cache: ArtifactCache) -> tuple[bytes, str]:
    """(cubin, ptxas -v log) of `source` built with nvcc for sm_90, cached by content."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = content_key("static-perf-nvcc", source, "\0".join(flags), version)

    def build(tmp: Path) -> None:
        (tmp / "k.cu").write_text(source)
        run = subprocess.run([nvcc, "-cubin", f"-arch={ARCH}", "-Xptxas", "-v", *flags, "-o",
                              str(tmp / "k.cubin"), str(tmp / "k.cu")], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{run.stderr[-3000:]}")
        (tmp / "ptxas.log").write_text(run.stderr + run.stdout)

    entry, _ = cache.get_or_build(CACHE_NS, key, build)
    return (entry / "k.cubin").read_bytes(), (entry / "ptxas.log").read_text()
