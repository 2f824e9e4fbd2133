"""kgen.load_source: a hand-written kernel verified in the sandbox, then served in-process as an
ordinary Kernel (kgen/verify/untrusted/handwritten.py), and the config a source implements."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, write_spec

import kgen
from kgen.families.attention.decode_cases import make_decode_case
from kgen.render import render
from kgen.runtime.cpu import CpuModule
from kgen.runtime.isolated import IsolatedCpuModule
from kgen.verify.untrusted.handwritten import (
    declared_parameter_count,
    kernel_from_source,
    source_config,
)

CORPUS = Path(__file__).parent / "corpus"

TINY = textwrap.dedent("""\
    kgen: 1
    name: tiny_hand
    kind: paged_decode
    attention: {num_q_heads: 4, num_kv_heads: 2, head_dim: 32}
    kv_cache: {block_size: 8, layout: separate, order: NHD, dtype: fp16}
    dtype: {q: fp16}
    tail_masking: true
    targets: [sm_90]
    tuning:
      params: {partition_size: [0, 32]}
      defaults: {partition_size: 32}
""")


def call(kern, args):
    given = {k: v for k, v in args.items() if k != "out"}
    return kern(**given)


def test_corpus_kernel_loads_verified_and_matches_kgens(tmp_path):
    spec = kgen.load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")
    kern = kgen.load_source(spec, CORPUS / "llama3_8b_decode" / "original.cu", backend="cpu", seed=5)
    assert isinstance(kern, kgen.Kernel)
    assert kern.report.passed and kern.report.seed == 5
    assert type(kern.module) is CpuModule  # served in-process once verified, not through the sandbox's child
    assert kern.config["partition_size"] == 0  # the corpus kernel implements the ABI 1 launch
    ours = kgen.build(spec, backend="cpu", verify=False)
    args = make_decode_case(spec, [1, 17, 300], np.random.default_rng(3))
    got, want = call(kern, args), call(ours, args)
    assert np.isfinite(got.astype(np.float32)).all()
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-3, rtol=2e-3)
    plan = kern.plan(args["seq_lens"])  # the Kernel's own API, as kgen.build's
    assert [launch.kernel for launch in plan.launches] == ["llama3_8b_decode"]


def test_broken_source_raises_verification_error(tmp_path):
    spec = kgen.load_spec(write_spec(tmp_path, TINY))
    source = render(spec, {"partition_size": 0}).source.replace("TAIL_MASK = true", "TAIL_MASK = false")
    path = tmp_path / "broken.cu"
    path.write_text(source)
    with pytest.raises(kgen.VerificationError) as info:
        kgen.load_source(spec, path, backend="cpu", seed=2)
    report = info.value.report
    assert not report.passed and report.seed == 2
    assert "len_B-1" in {c.name for c in report.failed_cases}
    assert "broken.cu" in str(info.value) and "case '" in str(info.value)


def test_unreadable_source_is_a_user_error(tmp_path):
    spec = kgen.load_spec(write_spec(tmp_path, TINY))
    with pytest.raises(kgen.KgenUserError, match="cannot read the kernel source"):
        kgen.load_source(spec, tmp_path / "missing.cu", backend="cpu")


def test_kgen_show_signature_selects_the_default_config(tmp_path):
    """`kgen show SPEC` prints the default (split-KV) config's kernels: a source with that
    signature is held to that config; the ABI 1 signature to the single-pass one."""
    spec = kgen.load_spec(write_spec(tmp_path, TINY))
    default, single = render(spec), render(spec, {"partition_size": 0})
    assert declared_parameter_count(default.source, "tiny_hand") == declared_parameter_count(
        single.source, "tiny_hand") + 1
    assert source_config(spec, default.source)["partition_size"] == 32
    assert source_config(spec, single.source)["partition_size"] == 0
    kern = kernel_from_source(spec, default.source, backend="cpu", archs=[])
    assert isinstance(kern.module, IsolatedCpuModule) and kern.kernel_names == ["tiny_hand", "tiny_hand_merge"]
    report = kgen.verify(kern, seed=4)
    kern.module.close()
    assert report.passed, report.summary()
    assert "len_P+1" in {c.name for c in report.cases}  # the split config's partition cases ran


def test_declared_parameter_count_reads_the_global_definition():
    text = ('#include "kgen/platform.cuh"\n__device__ void tiny(int a, int b);\n'
            'extern "C" __global__ void __launch_bounds__(64) tiny(float* out, const int* x,\n'
            '    long long s, int n) {}\n')
    assert declared_parameter_count(text, "tiny") == 4
    assert declared_parameter_count('extern "C" __global__ void k(void) {}', "k") == 0
    assert declared_parameter_count("__device__ void k(int a) {}", "k") is None
