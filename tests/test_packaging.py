"""The wheel carries the templates (kgen/_templates), the bundled specs (kgen/_specs: `kgen selftest`
builds them) and the console script; the benchmarks package stays in the repository."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("kgen-*.whl")
    return whl


def test_wheel_contains_every_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = [p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*") if p.is_file()]
    assert templates, "no templates found in the checkout"
    missing = [t for t in templates if f"kgen/_templates/{t}" not in names]
    assert missing == []
    assert "kgen/_templates/simt/kgen_simt.h" in names
    assert "kgen/_templates/paged_decode.cu.j2" in names


def test_wheel_contains_every_bundled_spec(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    specs = sorted(p.name for p in (ROOT / "specs").glob("*.yaml"))
    assert specs and [s for s in specs if f"kgen/_specs/{s}" not in names] == []


def test_wheel_ships_kgen_and_not_the_benchmarks(wheel):
    """benchmarks/ (the scripts and what only they use: FlashInfer's and vLLM's restated geometry, nvcc,
    the tables) stays in the repository; kgen/perf (the SASS reader, the device table, kgen's models) ships."""
    names = zipfile.ZipFile(wheel).namelist()
    assert (ROOT / "benchmarks" / "__init__.py").is_file() and (ROOT / "benchmarks" / "flashinfer_geometry.py").is_file()
    assert not [n for n in names if n.startswith("benchmarks/") or "/benchmarks/" in n]
    assert {"kgen/perf/sass.py", "kgen/perf/model.py", "kgen/perf/report.py"} <= set(names)
    shipped = "".join(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.startswith("kgen/perf/"))
    assert "def flashinfer_" not in shipped and "def vllm_" not in shipped


def test_wheel_declares_console_script_and_deps(wheel):
    z = zipfile.ZipFile(wheel)
    entry = next(n for n in z.namelist() if n.endswith("entry_points.txt"))
    assert "kgen = kgen.cli.main:main" in z.read(entry).decode()
    meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    for dep in ("cuda-pathfinder", "jinja2", "pydantic"):
        assert f"Requires-Dist: {dep}" in meta, dep
    # the CUDA lines are extras (kgen/compile/cuda_line.py), one CuPy and NVRTC each
    for extra, deps in {"cu13": ("cupy-cuda13x", "nvidia-cuda-nvrtc=="), "cu12": ("cupy-cuda12x", "nvidia-cuda-nvrtc-cu12")}.items():
        assert f"Provides-Extra: {extra}" in meta, extra
        for dep in deps:
            assert any(dep in line and f"extra == '{extra}'" in line.replace('"', "'")
                       for line in meta.splitlines() if line.startswith("Requires-Dist:")), (extra, dep)
