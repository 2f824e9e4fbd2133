"""Every cubin `kgen build` writes reads under NVIDIA's cuobjdump (from the nvidia-cuda-cuobjdump wheel
of the test extra), with the register counts the manifest reports."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(p.name for p in (ROOT / "specs").glob("*.yaml"))


def _cuobjdump() -> str | None:
    """The cuobjdump binary the wheel installed (None when the wheel is absent)."""
    try:
        files = importlib.metadata.distribution("nvidia-cuda-cuobjdump").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if f.name == "cuobjdump"]
    return str(found[0]) if found else None


CUOBJDUMP = _cuobjdump()
pytestmark = pytest.mark.skipif(CUOBJDUMP is None, reason="the nvidia-cuda-cuobjdump wheel (test extra) is not "
                                                          "installed: pip install -e '.[test]'")


# One spec of each kind in the default tier (a decode, a prefill, an MLA decode and both cache kernels):
# the cubin reading and the manifest's register figures do not depend on which spec of a kind it is.
DEFAULT_TIER = {"llama3_8b_decode.yaml", "llama3_8b_prefill.yaml", "deepseek_v3_mla_decode.yaml",
                "cache_write_fp8_e4m3.yaml", "copy_blocks_fp16.yaml"}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("generated")


def kgen_build(out_root: Path, spec: str) -> Path:
    """`kgen build` of one bundled spec on the CPU backend (its cubins are built for every target arch),
    in the session's compile cache (tests/conftest.py), so cubins other tests compiled are not compiled again."""
    run = subprocess.run([sys.executable, "-m", "kgen.cli", "build", f"specs/{spec}", "--backend", "cpu",
                          "-o", str(out_root)], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return out_root / Path(spec).stem


def _registers(listing: str) -> dict[str, int]:
    """{kernel: REG} from `cuobjdump -res-usage`."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"Function (\w+):\s*\n\s*REG:(\d+)", listing)}


@pytest.mark.parametrize("spec", [s if s in DEFAULT_TIER else pytest.param(s, marks=pytest.mark.full) for s in SPECS])
def test_every_cubin_reads_under_cuobjdump(out_root, spec):
    directory = kgen_build(out_root, spec)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["cubins"], "the spec has target archs, so the build wrote cubins"
    for arch, entry in manifest["cubins"].items():
        run = subprocess.run([CUOBJDUMP, "-res-usage", str(directory / entry["file"])],
                             capture_output=True, text=True)
        assert run.returncode == 0, f"{entry['file']}: {run.stderr.strip()}"
        registers = _registers(run.stdout)
        assert set(registers) == set(manifest["kernel_names"]), run.stdout
        reported = {name: r["registers"] for name, r in entry["resources"].items()}
        assert registers == reported, f"{arch}: cuobjdump {registers}, manifest {reported}"
