"""CUDA backend on a real GPU: verification, CPU-vs-GPU agreement, CuPy and torch arrays (moved through
DLPack), aliasing refused on the device. Skipped without a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kgen.arrays import args_to_backend, as_array_arg, to_numpy
from kgen.build import build
from kgen.errors import ArgumentError
from kgen.families.attention.decode_cases import make_decode_case
from kgen.formats.dtypes import BY_NUMPY
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
    args["seq_lens"] = args["seq_lens"].get()
    with pytest.raises(ArgumentError, match="seq_lens"):
        gpu(**args)
    assert as_array_arg("q", args["q"]).device == "cuda"


def _torch_cuda(arr: np.ndarray):
    """A torch CUDA tensor with `arr`'s bits and dtype (the test's own move, independent of kgen's)."""
    import torch

    d = BY_NUMPY[arr.dtype]
    bits = {1: np.uint8, 2: np.int16, 4: np.int32}[d.itemsize]
    return torch.from_numpy(np.ascontiguousarray(arr).view(bits)).cuda().view(getattr(torch, d.torch_name))


def test_torch_cuda_tensors_in_and_out(spec):
    torch = pytest.importorskip("torch")
    cpu = build(spec, backend="cpu", verify=False)
    gpu = build(spec, backend="cuda", verify=False)
    args = make_decode_case(spec, [3, 40, 129], np.random.default_rng(2))
    out = gpu(**{k: _torch_cuda(v) for k, v in args.items()})
    assert isinstance(out, torch.Tensor) and out.is_cuda
    want = cpu(**args).astype(np.float64)
    tol = 4 * float(np.abs(want).max()) * 2.0 ** -10
    assert float(np.abs(to_numpy(out).astype(np.float64) - want).max()) <= tol


def test_out_overlapping_q_is_refused_on_the_device(spec):
    gpu = build(spec, backend="cuda", verify=False)
    args = args_to_backend(make_decode_case(spec, [7, 9], np.random.default_rng(4)), "cuda")
    if args["out"].dtype != args["q"].dtype:
        pytest.skip("out and q differ in dtype for this spec")
    with pytest.raises(ArgumentError, match="out overlaps q in memory"):
        gpu(**(args | {"out": args["q"]}))


def test_cuda_path_needs_no_torch(tmp_path):
    """Every kgen dtype moves to the GPU and back bit-exactly, and a CUDA build verifies, with torch unimportable."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        import kgen
        from kgen.arrays import to_backend, to_numpy
        from kgen.cache import ArtifactCache
        from kgen.formats.dtypes import BY_NAME
        rng = np.random.default_rng(0)
        for d in BY_NAME.values():
            bits = rng.integers(0, 256, (5, 7, d.itemsize), dtype=np.uint8)
            host = bits.view(d.numpy).reshape(5, 7)
            dev = to_backend(host, "cuda")
            assert type(dev).__module__.startswith("cupy"), type(dev)
            back = to_numpy(dev)
            assert back.dtype == host.dtype and back.tobytes() == host.tobytes(), d.name
        spec = kgen.load_spec({str(ROOT / "specs" / "decode_fp8_e4m3_per_head.yaml")!r})
        kernel = kgen.build(spec, backend="cuda", seed=3, cache=ArtifactCache({str(tmp_path)!r}))
        assert kernel.report.passed, kernel.report.summary()
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
