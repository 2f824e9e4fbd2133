"""kgen.compile.host: g++ build of generated source + launch shim, cached."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kgen.cache import ArtifactCache
from kgen.compile.cuda_headers import cuda_include_dir
from kgen.compile.host import compile_host
from kgen.errors import CompileError, ToolchainError
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

ROOT = Path(__file__).resolve().parents[2]

SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void __launch_bounds__(64) axpy(float* y, const float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
extern "C" __global__ void sig(const __half* a, unsigned b, long long c, double d, unsigned long long e) {}
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _axpy(art):
    mod = CpuModule(art)
    y = np.ones(100, np.float32)
    x = np.arange(100, dtype=np.float32)
    mod.launch(Launch("axpy", (2, 1, 1), (64, 1, 1), 0, [y, x, np.float32(2.0), np.int32(100)]))
    np.testing.assert_array_equal(y, 1 + 2 * x)
    return mod


def test_the_shim_is_compiled_once_for_every_kernel_of_the_same_flags(cache_dir):
    """The shim (the SIMT runtime) depends on the flags only: another kernel source, of other kernel
    names, links the cached object, each library launches its own kernels by name and refuses others."""
    _axpy(compile_host(SRC, ["axpy", "sig"]))
    other = SRC.replace("a * x[i]", "a * x[i] + 0.0f").replace("void sig(", "void sig2(")
    mod = _axpy(compile_host(other, ["axpy", "sig2"]))
    shims = list((cache_dir / "host-shim").glob("*/*/shim.o"))
    assert len(shims) == 1, shims
    with pytest.raises(Exception, match="unknown kernel 'sig'"):
        mod.launch(Launch("sig", (1, 1, 1), (1, 1, 1), 0, []))
    compile_host(SRC, ["axpy", "sig"], extra_flags=["-DKGEN_TEST_FLAG=2"])  # other flags: another shim
    assert len(list((cache_dir / "host-shim").glob("*/*/shim.o"))) == 2


def test_second_compile_is_a_cache_hit_and_corrupt_entry_is_rebuilt(cache_dir):
    a1 = compile_host(SRC, ["axpy", "sig"])
    assert not a1.cache_hit and a1.library.is_file() and a1.build_seconds > 0
    assert str(a1.library).startswith(str(cache_dir))
    a2 = compile_host(SRC, ["axpy", "sig"])
    assert a2.cache_hit and a2.library == a1.library and a2.key == a1.key
    # a different flag set or sanitize flag is a different artifact
    assert compile_host(SRC, ["axpy", "sig"], extra_flags=["-DKGEN_TEST_FLAG=1"]).key != a1.key
    # corrupt the cached library: detected by the entry's hashes, rebuilt, and it works
    a1.library.write_bytes(b"\x7fELF garbage")
    a3 = compile_host(SRC, ["axpy", "sig"])
    assert not a3.cache_hit and a3.library == a1.library
    _axpy(a3)


def test_signature_codes():
    mod = _axpy(compile_host(SRC, ["axpy", "sig"]))
    assert mod.signature("axpy") == ("p", "p", "f4", "i4")
    assert mod.signature("sig") == ("p", "u4", "i8", "f8", "u8")


def test_missing_compiler_is_a_toolchain_error(monkeypatch, cache_dir):
    monkeypatch.setenv("KGEN_CXX", "/nonexistent/bin/g++-42")
    with pytest.raises(ToolchainError) as ei:
        compile_host(SRC + "// fresh\n", ["axpy"])
    assert "g++-42" in str(ei.value) and "KGEN_CXX" in str(ei.value)


def test_compile_error_shows_first_errors_with_source_lines(cache_dir):
    bad = SRC + "\nextern \"C\" __global__ void broken(float* y) {\n  y[0] = undefined_thing + 1;\n}\n"
    line = bad.splitlines().index("  y[0] = undefined_thing + 1;") + 1
    with pytest.raises(CompileError) as ei:
        compile_host(bad, ["axpy", "broken"])
    msg = str(ei.value)
    assert f"kernel.cu:{line}:" in msg and "undefined_thing" in msg
    assert f"{line:5d} |   y[0] = undefined_thing + 1;" in msg
    assert not list(cache_dir.glob("host/*/*/kernel.so"))  # nothing cached for a failed build


def test_unknown_kernel_name_is_a_compile_error(cache_dir):
    with pytest.raises(CompileError, match="no_such_kernel"):
        compile_host(SRC, ["axpy", "no_such_kernel"])


def test_bad_kernel_names_rejected():
    with pytest.raises(ValueError):
        compile_host(SRC, ["axpy; system(\"rm\")"])
    with pytest.raises(ValueError):
        compile_host(SRC, [])


def test_cuda_include_dir_honours_kgen_cuda_home(monkeypatch, tmp_path):
    assert (cuda_include_dir() / "cuda_fp16.h").is_file()
    monkeypatch.setenv("KGEN_CUDA_HOME", str(tmp_path))
    with pytest.raises(ToolchainError, match="KGEN_CUDA_HOME"):
        cuda_include_dir()


def test_explicit_cache_object(tmp_path):
    art = compile_host(SRC, ["axpy"], cache=ArtifactCache(tmp_path))
    assert str(art.library).startswith(str(tmp_path))


# ---- a cached library that does not load: rebuilt; a fresh one that does not load: a clear error

def _rewrite_index(entry: Path) -> None:
    """Make the entry's hashes match its (corrupted) files, as a library built on another machine
    sharing the cache would: the hash check passes, only loading it can tell."""
    index = json.loads((entry / "entry.json").read_text())
    index["files"] = {n: hashlib.sha256((entry / n).read_bytes()).hexdigest() for n in index["files"]}
    (entry / "entry.json").write_text(json.dumps(index))


def test_cached_library_that_does_not_load_is_rebuilt(tmp_path):
    src = SRC + f"// {tmp_path.name}: a library no test has loaded yet\n"
    cache = ArtifactCache(tmp_path / "cache")
    art = compile_host(src, ["axpy"], cache=cache)
    art.library.write_bytes(b"\x7fELF but not a shared library")
    _rewrite_index(art.library.parent)
    cached = compile_host(src, ["axpy"], cache=cache)
    assert cached.cache_hit  # the hash check cannot see the problem
    mod = _axpy(cached)  # loads after a rebuild
    assert not mod.artifact.cache_hit and mod.artifact.library == art.library


FAKE_CXX = """#!/bin/sh
# A "compiler" whose libraries do not load: objects are real (g++'s, so the object check passes),
# the linked library is garbage.
if [ "$1" = "--version" ]; then echo "fake-g++ 1.0"; exit 0; fi
out=""; prev=""
for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done
case "$out" in *.so) printf 'garbage' > "$out"; exit 0;; esac
exec g++ "$@"
"""


def _fake_cxx(tmp_path: Path) -> Path:
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    return cxx


def test_fresh_library_that_does_not_load_is_a_toolchain_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CXX", str(_fake_cxx(tmp_path)))
    art = compile_host(SRC + f"// {tmp_path.name}\n", ["axpy"], cache=ArtifactCache(tmp_path / "cache"))
    with pytest.raises(ToolchainError) as e:
        CpuModule(art)
    text = str(e.value)
    assert str(art.library) in text and "does not load" in text and "KGEN_CXX" in text


def test_library_that_does_not_load_exits_2_without_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), KGEN_CACHE_DIR=str(tmp_path / "cache"),
               KGEN_CXX=str(_fake_cxx(tmp_path)))
    res = subprocess.run([sys.executable, "-m", "kgen.cli", "build", str(ROOT / "specs" / "llama3_8b_decode.yaml"),
                          "-o", str(tmp_path / "gen"), "--backend", "cpu"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "does not load" in res.stderr and "kernel.so" in res.stderr
