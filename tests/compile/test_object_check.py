"""kgen.compile.object_check: the CPU object of every kernel is checked before it is linked (only
allow-listed undefined symbols, no load-time code), whatever its text looked like. These sources
go to compile_host directly, past the text rules, as a source that fooled them would."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kgen.compile.host import compile_host
from kgen.compile.object_check import ObjectPolicyError, binutil, symbol_allowed
from kgen.errors import ToolchainError
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

KERNEL = 'extern "C" __global__ void k(float* out) { out[threadIdx.x] = 1.0f; }\n'


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def refused(source: str, sanitize: bool = False) -> str:
    with pytest.raises(ObjectPolicyError) as ei:
        compile_host(source, ["k"], sanitize=sanitize)
    return str(ei.value)


def test_token_pasted_system_call_is_refused_at_its_line(tmp_path):
    marker = tmp_path / "MARKER"
    src = f'#define CALL(a, b) a##b\n__device__ void f() {{ CALL(sys, tem)("touch {marker}"); }}\n' + KERNEL
    msg = refused(src)
    assert "kernel.cu:2: host-only call 'system' is not allowed in a kernel source" in msg
    assert not marker.exists()


def test_hidden_host_calls_are_refused():
    assert "'getenv'" in refused('__device__ char* (*p)(const char*) = &getenv;\n' + KERNEL)
    msg = refused('static FILE* o(const char*, const char*) __attribute__((weakref("fopen")));\n'
                  '__device__ void* f() { return o("/etc/passwd", "r"); }\n' + KERNEL)
    assert "host-only call 'fopen'" in msg
    assert "not on kgen's allow-list" in refused('__device__ void* f(size_t n) { return malloc(n); }\n' + KERNEL)


@pytest.mark.parametrize("src, line", [
    ('__attribute__((constructor)) static void boom() { system("touch MARKER"); }\n', 1),
    ("volatile int sink;\n__attribute__((destructor)) void bye() { sink = 1; }\n", 2),
    ("int seed();\nint value = seed();\n", 2),
    ("static void boom() {}\n__attribute__((section(\".init_array\"), used)) static void (*p)() = &boom;\n", 1),
])
def test_load_time_code_is_refused(src, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = refused(src + KERNEL)
    assert f"kernel.cu:{line}: code that runs when the library is loaded or unloaded" in msg
    assert not (tmp_path / "MARKER").exists()


def test_static_object_with_destructor_and_ifunc_are_refused():
    msg = refused("struct H { ~H() {} int v; };\nH holder;\n" + KERNEL)
    assert "kernel.cu:2: a static object with a destructor" in msg
    msg = refused('extern "C" void impl() {}\nextern "C" void (*resolve())() { return impl; }\n'
                  'extern "C" void picked() __attribute__((ifunc("resolve")));\n' + KERNEL)
    assert "indirect function 'picked'" in msg


def test_sanitizer_builds_allow_only_the_sanitizers_own_constructor():
    mod = CpuModule(compile_host(KERNEL, ["k"], sanitize=True))
    assert mod.artifact.sanitize
    msg = refused("volatile int sink;\n__attribute__((constructor(99))) static void early() { sink = 1; }\n" + KERNEL,
                  sanitize=True)
    assert "code that runs when the library is loaded" in msg


def test_a_clean_kernel_builds_and_runs():
    mod = CpuModule(compile_host('#include <cuda_fp16.h>\n__device__ float sq(float x) { return sqrtf(x) * expf(0.f); }\n'
                                 'extern "C" __global__ void k(float* out) {\n'
                                 '  out[threadIdx.x] = sq((float)threadIdx.x); printf("");\n}\n', ["k"]))
    out = np.zeros(32, np.float32)
    mod.launch(Launch("k", (1, 1, 1), (32, 1, 1), 0, [out]))
    np.testing.assert_allclose(out, np.sqrt(np.arange(32, dtype=np.float32)))


def test_allow_list():
    for name in ("expf", "sqrt", "memcpy", "memset", "printf", "_GLOBAL_OFFSET_TABLE_", "__tls_get_addr"):
        assert symbol_allowed(name), name
    for name in ("system", "fopen", "getenv", "dlopen", "__cxa_atexit", "malloc", "__asan_report_load4"):
        assert not symbol_allowed(name), name
    assert symbol_allowed("__asan_report_load4", sanitize=True)


def test_missing_binutils_is_a_toolchain_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KGEN_CXX", shutil.which("g++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolchainError, match="binutils"):
        binutil("readelf")
    with pytest.raises(ToolchainError, match="readelf"):
        compile_host(KERNEL + "// fresh\n", ["k"])
