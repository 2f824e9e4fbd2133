"""One fingerprint of the CUDA number-format headers, in the cache key of both compilers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kgen.cache import ArtifactCache
from kgen.compile.cuda_headers import (
    FORMAT_HEADERS,
    cuda_include_dir,
    cuda_include_dirs,
    headers_fingerprint,
)
from kgen.compile.host import compile_host
from kgen.compile.nvrtc import compile_cubin

SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void half_copy(__half* y, const __half* x) { y[threadIdx.x] = x[threadIdx.x]; }
"""


def test_fingerprint_follows_the_content_of_each_header(tmp_path):
    real = cuda_include_dir()
    for name in FORMAT_HEADERS:
        shutil.copy(real / name, tmp_path / name)
    base = headers_fingerprint(tmp_path)
    assert base == headers_fingerprint(real)  # content, not path
    seen = {base}
    for name in FORMAT_HEADERS:
        with open(tmp_path / name, "a") as f:
            f.write(f"\n// edited by {__name__}\n")
        seen.add(headers_fingerprint(tmp_path))
    assert len(seen) == len(FORMAT_HEADERS) + 1


def _cuda_home_with_edited(tmp_path: Path, name: str) -> Path:
    """A CUDA root whose include/ is the real one (symlinks) except `name`, edited harmlessly."""
    real = cuda_include_dir()
    inc = tmp_path / "cuda" / "include"
    inc.mkdir(parents=True)
    for entry in real.iterdir():
        (inc / entry.name).symlink_to(entry)
    (inc / name).unlink()
    (inc / name).write_text((real / name).read_text() + "\n// edited\n")
    return tmp_path / "cuda"


@pytest.mark.parametrize("header", ["cuda_fp16.h", "vector_types.h"])
def test_both_compilers_rebuild_when_a_format_header_changes(tmp_path, monkeypatch, header):
    cache = ArtifactCache(tmp_path / "cache")
    host = compile_host(SRC, ["half_copy"], cache=cache)
    compile_cubin(SRC, "sm_90", cache=cache)
    monkeypatch.setenv("KGEN_CUDA_HOME", str(_cuda_home_with_edited(tmp_path, header)))
    assert compile_host(SRC, ["half_copy"], cache=cache).key != host.key
    assert not compile_cubin(SRC, "sm_90", cache=cache).cache_hit


def test_a_cuda13_toolkit_root_adds_its_cccl_directory(monkeypatch, tmp_path):
    """KGEN_CUDA_HOME: include/ alone (a CUDA 12 toolkit keeps <nv/target> there), plus include/cccl where a
    CUDA 13 toolkit keeps it (g++, the CPU backend, needs it; NVRTC provides its own)."""
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "cuda_fp16.h").write_text("")
    monkeypatch.setenv("KGEN_CUDA_HOME", str(tmp_path))
    assert cuda_include_dirs() == (inc,)
    other = tmp_path / "cuda13"
    (other / "include" / "cccl" / "nv").mkdir(parents=True)
    (other / "include" / "cuda_fp16.h").write_text("")
    (other / "include" / "cccl" / "nv" / "target").write_text("")
    monkeypatch.setenv("KGEN_CUDA_HOME", str(other))
    assert cuda_include_dirs() == (other / "include", other / "include" / "cccl")
