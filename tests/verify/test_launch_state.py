"""The source policy's rules against memory of past launches (kgen/verify/untrusted/launch_state.py):
a hand-written kernel that could keep state from one launch to the next, or read the time, is
refused naming the file, the line and the rule (exit 2 from `kgen verify --source`); its cubins
are checked for what the text rules could miss; kgen's own sources, in every config, pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kgen
from kgen.compile.cubin_state import cubin_state
from kgen.compile.nvrtc import compile_cubin
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.render import render
from kgen.tune.search import expand_space
from kgen.verify.untrusted.handwritten import kernel_from_source
from kgen.verify.untrusted.launch_state import (
    HEAP_RULE,
    STATE_RULE,
    TIME_RULE,
    check_cubins,
)
from kgen.verify.untrusted.source_policy import SourcePolicyError, prepare_source

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"
HEAD = "#include <cuda_fp16.h>\n"
KERNEL = 'extern "C" __global__ void llama3_8b_decode(float* out) { out[0] = 1.0f; }\n'


def refused(text: str) -> str:
    with pytest.raises(SourcePolicyError) as ei:
        prepare_source(text, "mykernel.cu")
    return str(ei.value)


# (snippet at line 2, the line refused, what the message names)
STATE = [
    ("__device__ unsigned launches;\n", 2, "'launches'"),
    ("__device__ unsigned launches = 0;\n", 2, "'launches'"),
    ("static __device__ int seen[4];\n", 2, "'seen'"),
    ("__managed__ int calls = 0;\n", 2, "'calls'"),
    ("namespace a {\nnamespace {\n__device__ int count;\n}\n}\n", 4, "'count'"),
    ("int plain;  // NVRTC makes it a device global\n", 2, "'plain'"),
    ("const float table[2] = {1.0f, 2.0f};  // storage, writable through a cast\n", 2, "'table'"),
    ("__device__ int braced{5};\n", 2, "'braced'"),
    ("__device__ int parens(5);\n", 2, "'parens'"),
    ("__device__ struct { int n; } anonymous;\n", 2, "'anonymous'"),
    ("template <class T> __device__ T per_type;\n", 2, "'per_type'"),
    ("extern __device__ int elsewhere;\n", 2, "'elsewhere'"),
    ("struct S { static int shared_by_all; };\n", 2, "'shared_by_all'"),
    ("__constant__ float not_const[2] = {1.0f, 2.0f};  // the CPU build compiles __constant__ away\n", 2,
     "'not_const'"),
    ("__constant__ const float* moving = nullptr;  // pointer to const: the pointer is writable\n", 2, "'moving'"),
    ("struct C { mutable int n; };\n__constant__ const C c{};\n", 2, "'n'"),
    ("__device__ unsigned (*hidden_ptr)(unsigned);\n", 2, "'hidden_ptr'"),
    ("#define COUNTER(n) __device__ unsigned n\nCOUNTER(hidden);\n", 3, "'hidden'"),
    ("__device__ int f() {\n  static int n = 0;\n  return ++n;\n}\n", 3, "'n'"),
    ("__device__ void f(unsigned* o) {\n  static unsigned n;\n  *o = atomicAdd(&n, 1u);\n}\n", 3, "'n'"),
    ("__device__ int f() {\n  thread_local int n;\n  return ++n;\n}\n", 3, "'n'"),
]


@pytest.mark.parametrize("snippet, line, name", STATE, ids=[s[2].strip("'") + str(k) for k, s in enumerate(STATE)])
def test_storage_that_outlives_a_launch_is_refused_at_its_line(snippet, line, name):
    msg = refused(HEAD + snippet + KERNEL)
    assert f"mykernel.cu:{line}: global {name} {STATE_RULE}" in msg


@pytest.mark.parametrize("snippet, what", [
    ("__device__ long long f() { return clock64(); }\n", "'clock64'"),
    ("__device__ long long f() { return clock(); }\n", "'clock'"),
    ("__device__ void f() { __nanosleep(100); }\n", "'__nanosleep'"),
    ("#define NOW() clock ## 64()\n__device__ long long f() { return NOW(); }\n", "'clock64'"),
])
def test_reading_the_clock_is_refused(snippet, what):
    line = snippet.count("\n") + 1
    assert f"mykernel.cu:{line}: {what} {TIME_RULE}" in refused(HEAD + snippet + KERNEL)


@pytest.mark.parametrize("register", ["globaltimer", "globaltimer_lo", "globaltimer_hi", "clock", "clock64", "smid"])
def test_asm_reading_a_special_register_names_it(register):
    snippet = f'__device__ unsigned long long f() {{ unsigned long long t; asm volatile("mov.u64 %0, %%{register};" ' \
              ': "=l"(t)); return t; }\n'
    msg = refused(HEAD + snippet + KERNEL)
    assert f"mykernel.cu:2: inline asm reading %{register} {TIME_RULE}" in msg


@pytest.mark.parametrize("snippet, what", [
    ("__device__ int* f() { return (int*)malloc(16); }\n", "'malloc'"),
    ("__device__ void f(void* p) { free(p); }\n", "'free'"),
    ("__device__ int* f() { return new int[4]; }\n", "'new'"),
    ("__device__ void f(int* p) { delete[] p; }\n", "'delete'"),
])
def test_the_device_heap_is_refused(snippet, what):
    assert f"mykernel.cu:2: {what} uses the {HEAP_RULE}" in refused(HEAD + snippet + KERNEL)


def test_read_only_and_per_block_storage_passes():
    text = HEAD + """constexpr int kN = 4;
constexpr float kTable[2] = {1.0f, 2.0f};
__constant__ const float kScales[2] = {0.5f, 2.0f};
__device__ __constant__ const float kMore[2] = {1.0f, 3.0f};
__constant__ const float* const kPtr = nullptr;
enum class Mode : int { A = 1 };
using F = float;
struct Tile {
  static constexpr int N = 3;
  int clock;  // a member of that name is not the clock
  static __device__ int one() { return 1; }
  __device__ Tile() = default;
  Tile(const Tile&) = delete;
};
static __device__ float twice(float x) { return x + x; }
__device__ float helper(float x);
__device__ float helper(float x) { return x; }
extern "C" __global__ void llama3_8b_decode(float* out) {
  __shared__ float s[kN];
  static __shared__ int t;
  static constexpr int kLocal = 2;
  auto sq = [] __device__ (float x) { return x * x; };
  Tile tile;
  s[threadIdx.x % kN] = sq(twice(kTable[threadIdx.x & 1])) * kScales[0] * kMore[1] + tile.clock + kLocal;
  t = 1;
  __syncthreads();
  out[0] = helper(s[0]) + t + Tile::one();
}
"""
    prepare_source(text, "mykernel.cu")


def test_the_cli_refuses_a_launch_counter_with_exit_2_naming_line_and_rule(tmp_path):
    cu = tmp_path / "counter.cu"
    cu.write_text(HEAD + "__device__ unsigned launches;\n"
                  'extern "C" __global__ void llama3_8b_decode(float* out) { out[0] = atomicAdd(&launches, 1u); }\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "kgen.cli", "verify", str(LLAMA), "--source", str(cu), "--backend",
                        "cpu"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 2, r.stderr
    assert f"counter.cu:2: global 'launches' {STATE_RULE}" in r.stderr and "Traceback" not in r.stderr


# ---- the cubin check: what the text rules could miss -------------------------------------------


def test_the_cubin_check_refuses_a_global_the_text_takes_for_a_function_declaration():
    # `T x(name);` reads as a function declaration to the text rules (a parameter of type `name`)
    text = HEAD + ("constexpr unsigned kZero = 0;\n__device__ unsigned hidden(kZero);\n"
                   'extern "C" __global__ void llama3_8b_decode(float* out) { out[0] = atomicAdd(&hidden, 1u); }\n')
    prepare_source(text, "mykernel.cu")
    with pytest.raises(SourcePolicyError) as ei:
        kernel_from_source(kgen.load_spec(LLAMA), text, backend="cpu", archs=["sm_90"], origin="mykernel.cu")
    assert f"mykernel.cu:3: global 'hidden' {STATE_RULE}: the sm_90 cubin holds it" in str(ei.value)


def test_cubin_state_reads_globals_and_heap_calls():
    text = ("__device__ int f() { static int n = 0; return ++n; }\n"
            "namespace q { __device__ unsigned count; }\n"
            "__constant__ float k[2] = {1.0f, 2.0f};\n"
            'extern "C" __global__ void g(int* o) { int* p = new int[2]; p[0] = f() + (int)k[0] + q::count++;'
            " o[0] = p[0]; delete[] p; __shared__ int s; s = 1; o[1] = s; }\n")
    state = cubin_state(compile_cubin(text, "sm_90").cubin)
    assert set(state.globals) == {"f()::n", "q::count"}  # not the __constant__, not the __shared__
    assert set(state.heap_calls) == {"malloc", "free"}


# ---- kgen's own sources pass ---------------------------------------------------------------------


def _configs(spec, every: bool) -> list[dict]:
    family = family_for(spec)
    configs = [resolve_config(family, spec, None), resolve_config(family, spec, family.abi_config(spec))]
    if every and spec.tuning and spec.tuning.params:
        configs += expand_space(spec).configs
    return list({tuple(sorted(c.items())): c for c in configs}.values())


def _check_own_sources(every: bool) -> int:
    count = 0
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = kgen.load_spec(path)
        for config in _configs(spec, every):
            prepare_source(render(spec, config).source, f"{spec.name}.cu")  # `kgen show SPEC --config ...`
            count += 1
    return count


def _check_own_cubins(names: list[str]) -> None:
    for name in names:
        spec = kgen.load_spec(ROOT / "specs" / f"{name}.yaml")
        source = render(spec).source  # the default config: what `kgen show SPEC` prints
        cubin = compile_cubin(source, "sm_90")
        assert check_cubins({"sm_90": cubin}, prepare_source(source, f"{name}.cu").text, f"{name}.cu") == [], name


def test_kgen_own_sources_pass_default_and_abi_configs():
    assert _check_own_sources(every=False) >= 18  # ~8 s
    _check_own_cubins(["llama3_8b_decode"])  # its odr-used static constexpr members; every spec's: full tier


@pytest.mark.full  # ~50 s + ~35 s: every config of every bundled spec's tuning space (225 today), every cubin
def test_kgen_own_sources_pass_in_every_tuning_config():
    assert _check_own_sources(every=True) > 200
    _check_own_cubins(sorted(p.stem for p in (ROOT / "specs").glob("*.yaml")))
