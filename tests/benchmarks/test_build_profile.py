"""benchmarks/build_profile.py: the self-contained text it times against the thin source is the same
program (NVRTC makes the same PTX of both), and the NVRTC timing compiles what it is given."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.build_profile import nvrtc_cpu_seconds, pasted
from kgen.compile import nvrtc
from kgen.compile.cuda_headers import cuda_include_dirs
from kgen.compile.provided import kgen_headers
from kgen.render import render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_pasting_resolves_every_provided_include_once_and_keeps_cudas():
    headers = {"kgen/a.cuh": '#pragma once\n#include "kgen/b.cuh"\nint a;\n', "kgen/b.cuh": "#pragma once\nint b;\n"}
    text = pasted('#include <cuda_fp16.h>\n#include "kgen/a.cuh"\n#include "kgen/b.cuh"\nint c;\n', headers)
    assert [line for line in text.splitlines() if line] == ["#include <cuda_fp16.h>", "int b;", "int a;", "int c;"]


def test_the_pasted_source_is_the_same_program():
    source = render(load_spec(ROOT / "specs" / "llama3_8b_decode.yaml"), None, "sm_90").source
    headers = kgen_headers()
    flat = pasted(source, headers)
    included = re.compile(r'^\s*#\s*include\s+"kgen/', re.M)
    assert included.search(source) and not included.search(flat)
    options = ["-arch=compute_90", "--std=c++17", "-default-device", *(f"-I{d}" for d in cuda_include_dirs())]
    assert nvrtc._compile(flat, "kernel.cu", options, ptx=True)[0] == nvrtc._compile(source, "kernel.cu", options,
                                                                                       ptx=True)[0]
    assert nvrtc_cpu_seconds(flat, {}, "compute_90") > 0
