"""CUDA backend on a real GPU: verification and CPU-vs-GPU agreement. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kgen.arrays import args_to_backend, as_array_arg, to_numpy
from kgen.build import build
from kgen.errors import ArgumentError
from kgen.families.decode_cases import make_decode_case
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["llama3_8b_decode.yaml", "decode_fp8_e4m3_per_head.yaml",
                                        "decode_split_kv_long.yaml"])
def spec(request):
    return load_spec(ROOT / "specs" / request.param)


def test_cuda_kernel_passes_the_matrix(spec):
    kernel = build(spec, backend="cuda", seed=5)
    assert kernel.backend == "cuda"
    assert kernel.report.passed, kernel.report.summary()


def test_cpu_and_gpu_agree_on_identical_inputs(spec):
    cpu = build(spec, backend="cpu", verify=False)
    gpu = build(spec, backend="cuda", verify=False)
    args = make_decode_case(spec, [1, 17, 300, 1000], np.random.default_rng(0))
    out_cpu = cpu(**args).astype(np.float64)
    out_gpu = to_numpy(gpu(**args_to_backend(args, "cuda"))).astype(np.float64)
    tol = 4 * float(np.abs(out_cpu).max()) * 2.0 ** -10  # a few fp16/bf16 ulps at the output's scale
    assert np.isfinite(out_gpu).all()
    assert float(np.abs(out_cpu - out_gpu).max()) <= tol


def test_host_arrays_are_refused_on_cuda(spec):
    gpu = build(spec, backend="cuda", verify=False)
    args = args_to_backend(make_decode_case(spec, [5], np.random.default_rng(1)), "cuda")
    args["seq_lens"] = args["seq_lens"].cpu()
    with pytest.raises(ArgumentError, match="seq_lens"):
        gpu(**args)
    assert as_array_arg("q", args["q"]).device == "cuda"
