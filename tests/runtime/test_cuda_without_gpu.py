"""The CUDA backend asked for where no GPU is usable: a message and exit 2, never CuPy's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kgen
from kgen.cache import ArtifactCache
from kgen.runtime.cuda import gpu_available

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(gpu_available(), reason="checks the message given where no GPU is usable")


@pytest.mark.parametrize("command", [
    ["build", "specs/llama3_8b_decode.yaml", "-o", "{out}"],
    ["verify", "specs/copy_blocks_fp16.yaml"],
    ["tune", "specs/decode_split_kv_long.yaml"],
], ids=lambda c: c[0])
def test_cli_backend_cuda_is_refused_with_a_message(tmp_path, command):
    env = dict(os.environ, KGEN_CACHE_DIR=str(tmp_path / "cache"))
    args = [a.format(out=tmp_path / "out") for a in command]
    run = subprocess.run([sys.executable, "-m", "kgen.cli", *args, "--backend", "cuda"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "--backend cuda: no usable CUDA GPU (CuPy reports: " in run.stderr
    assert "use --backend cpu or auto" in run.stderr
    assert not (tmp_path / "out" / "llama3_8b_decode").exists()


def test_build_api_raises_a_user_error(tmp_path):
    spec = kgen.load_spec(ROOT / "specs" / "copy_blocks_fp16.yaml")
    with pytest.raises(kgen.KgenUserError, match="no usable CUDA GPU"):
        kgen.build(spec, backend="cuda", verify=False, cache=ArtifactCache(tmp_path))
