"""The source policy of `kgen verify --source`: a submission is kernel code only, and NVRTC and
g++ compile one preprocessed text. Hostile sources are refused (exit 2, naming the rule, the
file and the line) before anything of theirs runs; kgen's own kernels, and kernels written
from ABI-1 `kgen show` output, pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kgen
from kgen.compile.object_check import ObjectPolicyError
from kgen.errors import CompileError
from kgen.render import render
from kgen.verify.untrusted.handwritten import kernel_from_source
from kgen.verify.untrusted.source_policy import SourcePolicyError, prepare_source

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"
ABI1_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama3_8b_decode_abi1.cu"
KERNEL = 'extern "C" __global__ void llama3_8b_decode(float* out) { out[0] = 1.0f; }\n'


def run_kgen(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "kgen.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def verify_source(tmp_path: Path, text: str, name: str = "mykernel.cu") -> subprocess.CompletedProcess:
    cu = tmp_path / name
    cu.write_text(text)
    return run_kgen("verify", str(LLAMA), "--source", str(cu), "--backend", "cpu", cwd=tmp_path)


def refused(text: str, name: str = "mykernel.cu") -> str:
    with pytest.raises(SourcePolicyError) as ei:
        prepare_source(text, name)
    return str(ei.value)


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


# ---- hostile sources: refused before anything of theirs runs -----------------------------------


@pytest.mark.parametrize("include", ["", "#include <cstdlib>\n"], ids=["declared-by-runtime", "cstdlib"])
def test_static_initializer_calling_system_under_cudacc_rtc_is_refused_and_runs_nothing(tmp_path, include):
    marker = tmp_path / "MARKER"
    text = ("#include <cuda_fp16.h>\n#ifndef __CUDACC_RTC__\n" + include
            + f'static int pwned = system("touch {marker}");\n#endif\n' + KERNEL)
    r = verify_source(tmp_path, text)
    assert r.returncode == 2, r.stderr
    assert "mykernel.cu:2: '__CUDACC_RTC__' tells which compiler is reading" in r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()


def test_constructor_attribute_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    text = ("#include <cuda_fp16.h>\n__device__ int run(const char*);\n"
            f'__attribute__((constructor)) __device__ void boom() {{ run("touch {marker}"); }}\n' + KERNEL)
    r = verify_source(tmp_path, text)
    assert r.returncode == 2
    assert "mykernel.cu:3: attribute 'constructor'" in r.stderr
    assert not marker.exists()
    assert "attribute 'destructor'" in refused("[[gnu::destructor]] __device__ void f() {}\n" + KERNEL)


@pytest.mark.parametrize("snippet, what", [
    ("int helper(int x) { return x + 1; }\n", "host function 'helper'"),
    ("template <class T> T twice(T x) { return 2 * x; }\n", "host function 'twice'"),
    ("struct S { __device__ int ok() { return 1; } int bad() { return 2; } };\n", "host function 'bad'"),
    ("struct S { S() : a{1} {} int a; };\n", "host function 'S'"),
    ("__host__ void h() {}\n", "host function 'h'"),
    ("__forceinline__ float sq(float x) { return x * x; }\n", "host function 'sq'"),
    ("auto lam = [](int x) { return x; };\n", "host lambda"),
    ("struct Op { int v; bool operator<(const Op& o) const { return v < o.v; } };\n", "host operator"),
])
def test_host_code_is_refused(snippet, what):
    text = "#include <cuda_fp16.h>\n" + snippet + KERNEL
    msg = refused(text)
    assert f"mykernel.cu:2: {what} is not allowed in a kernel source" in msg
    assert "__device__ or __global__" in msg


def test_device_code_of_every_shape_passes():
    text = r"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "kgen/platform.cuh"
#define UNROLL 4
namespace {
struct Acc {
  float v[2];
  __device__ Acc() : v{0.0f, 0.0f} {}
  __device__ explicit Acc(float x) : v{x, x} {}
  __device__ Acc& operator+=(const Acc& o) { v[0] += o.v[0]; return *this; }
  __device__ ~Acc() {}
};
template <class T, int N = 2> struct Vec { T x[N]; };
template <> struct Vec<float, 1> { float x; };
enum class Mode : int { A = 1, B = 2 };
constexpr int kWarps = 4;
__device__ __constant__ const float kTable[2] = {1.0f, 2.0f};
}  // namespace
template <class T> __device__ __forceinline__ T twice(T x) { return x + x; }
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
constexpr int warps_for(int threads) { return threads / 32; }  // compile-time helper: no __device__ needed
static_assert(warps_for(128) == kWarps, "four warps");
extern "C" {
__global__ void __launch_bounds__(128) llama3_8b_decode(float* __restrict__ out) {
  __shared__ float smem[kWarps];
  auto sq = [](float x) { return x * x; };
  Acc acc(1.0f);
  float s = 0.0f;
#pragma unroll UNROLL
  for (int i = 0; i < 4; ++i) s += sq(twice(kTable[i & 1]));
  smem[threadIdx.x % kWarps] = s + acc.v[0] + (float)cdiv(7, 2) + (int)Mode::A;
  __syncthreads();
  if (threadIdx.x == 0) { printf("%f\n", smem[0]); memcpy(out, smem, sizeof(float)); }
}
}
"""
    prepared = prepare_source(text, "mykernel.cu")
    assert "#pragma unroll 4" in prepared.text  # a macro operand is expanded once, for both compilers
    assert '#include "kgen/platform.cuh"' in prepared.text and "UNROLL" not in prepared.text
    assert prepared.text.startswith('#line 1 "mykernel.cu"\n')


@pytest.mark.parametrize("call", ['FILE* f = fopen("/etc/passwd", "r");', 'const char* h = getenv("HOME");',
                                  'std::system("id");', 'int pid = fork();', 'int r = ::unlink("x");'])
def test_host_only_calls_are_refused(call):
    name = call.split("(")[0].split()[-1].split("::")[-1].lstrip("*")
    text = "#include <cuda_fp16.h>\n__device__ void leak() {\n  " + call + "\n}\n" + KERNEL
    assert f"mykernel.cu:3: host-only call '{name}' is not allowed in a kernel source" in refused(text)


def test_member_and_own_functions_named_like_host_calls_pass():
    text = ("#include <cuda_fp16.h>\nstruct F { __device__ int open(int x) { return x; } };\n"
            "__device__ int read(int x) { return x + 1; }\n"
            'extern "C" __global__ void llama3_8b_decode(float* out) { F f; out[0] = f.open(1) + read(2); }\n')
    prepare_source(text, "mykernel.cu")


def test_token_pasted_call_is_refused_after_expansion(tmp_path):
    marker = tmp_path / "MARKER"
    text = ("#include <cuda_fp16.h>\n#define CALL(a, b) a##b\n"
            f'__device__ void f() {{ CALL(sys, tem)("touch {marker}"); }}\n' + KERNEL)
    assert "mykernel.cu:3: host-only call 'system'" in refused(text)


def test_inline_asm_is_refused():
    text = '#include <cuda_fp16.h>\n__device__ void f() { asm volatile("nop"); }\n' + KERNEL
    assert "mykernel.cu:2: inline asm is not allowed" in refused(text)
    text = '#include <cuda_fp16.h>\n#define A(x) __asm__(x)\n__device__ void f() { A("nop"); }\n' + KERNEL
    assert "mykernel.cu:3: inline asm is not allowed" in refused(text)


def test_include_of_a_path_is_refused_and_its_content_never_shown(tmp_path):
    secret = tmp_path / "secret.h"
    secret.write_text("KGEN_SECRET_CONTENT_4711\n")
    (tmp_path / "sub").mkdir()
    text = (f'#include "{secret}"\n#include "../secret.h"\n#include <stdio.h>\n#define H "{secret}"\n#include H\n'
            '#include "/etc/hostname"\n' + KERNEL)
    r = verify_source(tmp_path / "sub", text)
    assert r.returncode == 2
    for line in (1, 2, 3, 5, 6):
        assert f"mykernel.cu:{line}: #include" in r.stderr
    assert "KGEN_SECRET_CONTENT_4711" not in r.stderr + r.stdout
    hostname = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").is_file() else ""
    if hostname:
        assert hostname not in r.stderr.replace("/etc/hostname", "")


def test_file_probes_and_pragmas_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block: the checks below would hang if g++ opened it
    probes = [f'#if __has_include("{fifo}")\n#endif\n',
              f'#define C(a, b) a##b\n#if C(__has_, include)("{fifo}")\n#endif\n',
              f'#define C(a, b) a##b\nC(_Pra, gma)("GCC dependency \\"{fifo}\\"")\n',
              f'#pragma GCC dependency "{fifo}"\n',
              '#include_next <cuda_fp16.h>\n', '#line 10 "other.cu"\n', "#define __device__\n",
              "__device__ void f() {\n__kgen_pragma_unroll__(4)\n}\n"]
    for probe in probes:
        msg = refused(probe + KERNEL)
        assert "is not allowed in a kernel source" in msg and "mykernel.cu:" in msg, probe


@pytest.mark.parametrize("text, line, ident", [
    ("#ifdef __CUDACC_RTC__\nint x;\n#endif\n", 1, "__CUDACC_RTC__"),
    ("#ifndef __GNUC__\nint x;\n#endif\n", 1, "__GNUC__"),
    ("#if defined(KGEN_SIMT)\nint x;\n#endif\n", 1, "KGEN_SIMT"),
    ("#if __CUDA_ARCH__ >= 800\nint x;\n#endif\n", 1, "__CUDA_ARCH__"),
    ("#if __clang__\nint x;\n#endif\n", 1, "__clang__"),
    ("#define IS_GCC __GNUC__\n#if IS_GCC\nint x;\n#endif\n", 1, "__GNUC__"),
    ("#define RTC defined(__CUDACC_RTC__)\n#if RTC\nint x;\n#endif\n", 1, "__CUDACC_RTC__"),
    ("#define CAT(a, b) a##b\n#if CAT(__GN, UC__)\nint x;\n#endif\n", 2, "__GNUC__"),
    ("#define CAT(a, b) a##b\n#if CAT(KGEN_, SIMT)\nint x;\n#endif\n", 2, "KGEN_SIMT"),
    ("__device__ int arch() { return __x86_64__; }\n", 1, "__x86_64__"),
])
def test_branching_on_the_compiler_is_refused(text, line, ident):
    msg = refused(text + KERNEL)
    assert f"mykernel.cu:{line}: '{ident}' tells which compiler is reading" in msg


def test_branching_on_the_compiler_exits_2_from_the_cli(tmp_path):
    text = "#include <cuda_fp16.h>\n#define X __GNUC__\n#if X\n#define SCALE 1.0f\n#else\n#define SCALE 2.0f\n#endif\n"
    r = verify_source(tmp_path, text + KERNEL.replace("1.0f", "SCALE"))
    assert r.returncode == 2
    assert "mykernel.cu:2: '__GNUC__' tells which compiler is reading" in r.stderr


# ---- the object check: what the text cannot show ------------------------------------------------


@pytest.mark.parametrize("snippet", [
    'static int run(const char*) __attribute__((weakref("system")));\n'
    '__device__ int f(const char* c) { return run(c); }\n',
    '__constant__ int (*const volatile g_fn)(const char*) = &system;\n',
])
def test_object_check_refuses_a_call_the_text_does_not_show(snippet):
    spec = kgen.load_spec(LLAMA)
    text = "#include <cuda_fp16.h>\n" + snippet + KERNEL
    prepare_source(text, "mykernel.cu")  # the text rules see no call to system(): a string, a pointer
    with pytest.raises(ObjectPolicyError) as ei:
        kernel_from_source(spec, text, backend="cpu", archs=[], origin="mykernel.cu")
    assert "host-only call 'system' is not allowed in a kernel source" in str(ei.value)
    assert str(ei.value).startswith(("mykernel.cu:2:", "mykernel.cu:3:"))


def test_dynamic_initialization_of_a_global_is_refused_at_its_line():
    spec = kgen.load_spec(LLAMA)
    text = ("#include <cuda_fp16.h>\n__device__ __attribute__((noinline)) int g(const volatile int* x) { return *x * 3; }\n"
            "__constant__ const volatile int seed = 3;\n__constant__ const int value = g(&seed);\n" + KERNEL)
    # (__constant__: the text rules allow it, plain globals they refuse; g++ sees an ordinary global)
    with pytest.raises(ObjectPolicyError) as ei:
        kernel_from_source(spec, text, backend="cpu", archs=[], origin="mykernel.cu")
    assert "mykernel.cu:4: code that runs when the library is loaded" in str(ei.value)


# ---- kgen's own kernels, and kernels written from ABI-1 `kgen show` ---------------------------


@pytest.mark.full  # ~25 s; `kgen show` output verifies by default in tests/verify/test_load_source.py
def test_abi1_kgen_show_output_with_inlined_platform_block_still_verifies(tmp_path):
    text = ABI1_FIXTURE.read_text()
    assert "#ifndef KGEN_SIMT" in text  # the ABI-1 inlined block, as `kgen show` printed it
    assert prepare_source(text, "mykernel.cu").platform_block_replaced
    r = verify_source(tmp_path, text)
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout


def test_an_edited_platform_block_is_not_recognised():
    text = ABI1_FIXTURE.read_text().replace("one 16-byte aligned buffer", "one 16-byte-aligned buffer")
    msg = refused(text)
    assert "'KGEN_SIMT' tells which compiler is reading" in msg and '#include "kgen/platform.cuh"' in msg


def test_every_bundled_spec_renders_a_source_that_passes_the_policy():
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = kgen.load_spec(path)
        rendered = render(spec)
        assert '#include "kgen/platform.cuh"' in rendered.source
        prepared = prepare_source(rendered.source, f"{spec.name}.cu")
        assert not prepared.platform_block_replaced


# ---- compile errors name the user's file and line ------------------------------------------------


def test_compile_errors_name_the_users_file_and_line():
    spec = kgen.load_spec(LLAMA)
    text = ("#include <cuda_fp16.h>\n#define TWICE(x) ((x) + (x))\n\n__device__ float f(float x) {\n"
            "  return TWICE(undefined_thing);\n}\n" + KERNEL)
    with pytest.raises(CompileError) as ei:  # g++ (the CPU backend)
        kernel_from_source(spec, text, backend="cpu", archs=[], origin="/some/dir/mykernel.cu")
    msg = str(ei.value)
    assert "g++ failed to compile mykernel.cu" in msg and "mykernel.cu:5:" in msg and "undefined_thing" in msg
    with pytest.raises(CompileError) as ei:  # NVRTC
        kernel_from_source(spec, text, backend="cpu", archs=["sm_90"], origin="mykernel.cu")
    msg = str(ei.value)
    assert "NVRTC failed to compile mykernel.cu" in msg and "mykernel.cu(5)" in msg
    assert ">     5 |   return ((undefined_thing) + (undefined_thing));" in msg
