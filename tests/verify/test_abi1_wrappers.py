"""ABI 1's wrappers (templates/abi1/, provided as kgen/abi1/*.cuh and ABI 1's kgen/paged_prefill*.cuh): a
hand-written source that calls kgen's bodies positionally, as ABI 1's `kgen show` printed them, runs
kgen's internal body (which takes `const Params&`) and computes what kgen's own kernel computes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_decode

from kgen.compile.nvrtc import compile_cubin
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.perf.sass import sass_text, usable_cuobjdump
from kgen.render import render
from kgen.verify.untrusted.handwritten import kernel_from_source
from kgen.verify.untrusted.source_policy import prepare_source

ROOT = Path(__file__).resolve().parents[2]
ABI1_PREFILL = ROOT / "tests" / "verify" / "corpus" / "llama3_8b_prefill" / "original.cu"


def abi1_source(spec, config) -> str:
    """kgen's source of `config` rewritten as an ABI 1 source: ABI 1's headers, and the body called with
    the kernel's parameters in order, `sinks` moved last after a 0 for partition_tokens (ABI 1's shim)."""
    src = render(spec, config).source.replace('#include "kgen/bodies/', '#include "kgen/abi1/')
    main = family_for(spec).kernels(spec, config)[0]
    names = [a.name for a in main.params]
    if "sinks" in names:
        names = [n for n in names if n != "sinks"] + ["0", "sinks"]
    src, n = re.subn(r"  const Params p = \{[^\n]*\n.*?\n  \};\n  kgen::(\w+)<Cfg>\(p\);",
                     lambda m: f"  kgen::{m.group(1)}<Cfg>({', '.join(names)});", src, count=1, flags=re.S)
    assert n == 1 and "Params" not in src.split("extern")[-1]
    return src


@pytest.mark.parametrize("overrides,config", [
    pytest.param({"attention.sinks": True}, {"mma_min_group": 0}, id="sinks"),  # CUDA cores; sinks after ABI 1's pad
    # ~16 s of CPU builds each: the sinks case is the default tier's (the same wrapper, its shim too)
    pytest.param({}, {"mma_min_group": 0}, id="cuda_cores", marks=pytest.mark.full),
    pytest.param({}, {"mma_min_group": 2}, id="tensor_cores", marks=pytest.mark.full),  # kgen/abi1/paged_decode_mma.cuh
])
def test_an_abi1_decode_source_computes_what_kgen_computes(overrides, config):
    spec = tiny_decode(**overrides)
    family = family_for(spec)
    config = resolve_config(family, spec, {**family.abi_config(spec), **config})
    ours = kernel_from_source(spec, render(spec, config).source, backend="cpu", config=config, archs=[])
    theirs = kernel_from_source(spec, abi1_source(spec, config), backend="cpu", config=config, archs=[])
    args = make_decode_case(spec, [1, 17, 40], np.random.default_rng(3))
    if spec.attention.sinks:
        args["sinks"] = np.linspace(-1.0, 2.0, spec.attention.num_q_heads, dtype=np.float32)
    (out_a, lse_a), (out_b, lse_b) = ours(**args, return_lse=True), theirs(**args, return_lse=True)
    np.testing.assert_array_equal(out_b, out_a)  # the same body, bit for bit
    np.testing.assert_array_equal(lse_b, lse_a)


@pytest.mark.skipif(usable_cuobjdump() is None, reason="cuobjdump -sass is not installed (test extra)")
def test_an_abi1_prefill_cfg_without_m_tiles_or_v_head_dim_gets_abi1_values():
    """ABI 1's shim: a Cfg written before M_TILES and V_HEAD_DIM compiles to the same machine code as
    one that spells ABI 1's values (1 row tile a warp, V_HEAD_DIM = HEAD_DIM)."""
    text = ABI1_PREFILL.read_text()
    old = [line for line in text.splitlines(keepends=True) if re.match(r"  static constexpr int (M_TILES|V_HEAD_DIM) =", line)]
    assert [line.split("=")[1].split(";")[0].strip() for line in old] == ["128", "1"]
    older = text
    for line in old:
        older = older.replace(line, "")
    tool = usable_cuobjdump()
    sass = [sass_text(compile_cubin(prepare_source(t, "mine.cu").text, "sm_80").cubin, tool) for t in (text, older)]
    assert sass[0] == sass[1]
