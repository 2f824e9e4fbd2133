"""The CUDA lines (kgen/compile/cuda_line.py): which line the installed distributions make up, what a
driver of each CUDA version loads from each line's NVRTC, the refusal before a load that would fail,
the extras in pyproject.toml, and the real query on this machine (no GPU: "no driver")."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kgen.compile import cuda_line
from kgen.compile.cuda_headers import cuda_include_dir, cuda_include_dirs
from kgen.compile.cuda_line import (
    DEFAULT_LINE,
    LINES,
    choose_target,
    loadable_targets,
    mismatch,
    parse_driver_version,
    parse_version,
    resolve_line,
)
from kgen.errors import ToolchainError

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def full_set(name: str, nvrtc: str) -> dict[str, str]:
    """Every distribution of line `name` installed, its NVRTC at version `nvrtc`."""
    line = LINES[name]
    return {d: (nvrtc if d == line.nvrtc else "14.2.0" if d == line.cupy else nvrtc) for d in line.distributions}


# --- versions -------------------------------------------------------------------------------------

def test_driver_versions_decode_cuda_runtime_integers():
    # cudaDriverGetVersion: 1000 * major + 10 * minor; 0 where no driver is installed.
    assert parse_driver_version(12080) == (12, 8)
    assert parse_driver_version(13000) == (13, 0)
    assert parse_driver_version(12020) == (12, 2)
    assert parse_driver_version(0) is None
    with pytest.raises(ValueError, match="negative"):
        parse_driver_version(-1)


def test_distribution_versions_parse_to_major_minor():
    assert parse_version("13.0.88") == (13, 0)
    assert parse_version("12.9.86") == (12, 9)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        parse_version("thirteen")


# --- what a driver loads ------------------------------------------------------------------------------

# (NVRTC, driver, what the driver loads), from NVIDIA's rules: a cubin needs the driver's major >= NVRTC's
# (backward compatibility across majors, minor version compatibility within one); PTX needs the driver's
# whole version >= NVRTC's (the JIT takes only PTX ISA versions it knows).
LOADS = [
    # the cu12 line (NVRTC 12.9)
    ((12, 9), (12, 0), ("cubin",)),  # minor version compatibility: a 525 driver runs 12.9's cubins, not its PTX
    ((12, 9), (12, 8), ("cubin",)),
    ((12, 9), (12, 9), ("cubin", "ptx")),
    ((12, 9), (13, 0), ("cubin", "ptx")),  # a CUDA 13 driver loads and JITs CUDA 12 output
    ((12, 9), (11, 8), ()),
    # the cu13 line (NVRTC 13.0)
    ((13, 0), (13, 0), ("cubin", "ptx")),
    ((13, 0), (13, 2), ("cubin", "ptx")),
    ((13, 0), (12, 9), ()),  # a CUDA 12 driver loads nothing NVRTC 13 emits
    ((13, 0), (12, 2), ()),
    # no driver: nothing loads (compiling names its arch and needs none)
    ((13, 0), None, ()),
    ((12, 9), None, ()),
]


@pytest.mark.parametrize("nvrtc,driver,loads", LOADS)
def test_what_each_driver_loads_from_each_line(nvrtc, driver, loads):
    assert loadable_targets(nvrtc, driver) == loads
    # kgen emits a cubin wherever anything loads: never less loadable than PTX from the same NVRTC
    if loads:
        assert "cubin" in loads and choose_target(nvrtc, driver) == "cubin"


def test_cu13_on_a_cuda12_driver_is_refused_naming_both_versions_and_the_cu12_extra():
    with pytest.raises(ToolchainError) as e:
        choose_target((13, 0), (12, 8))
    message = str(e.value)
    assert "CUDA 12.8" in message and "NVRTC 13.0" in message
    assert "pip install 'kgen[cu12]'" in message


def test_a_driver_older_than_every_line_is_told_to_upgrade():
    message = mismatch((12, 9), (11, 8))
    assert message and "upgrade the driver" in message and "CUDA 11.8" in message
    assert "kgen[cu11]" not in message  # there is no such line


@pytest.mark.parametrize("name", sorted(LINES))
def test_each_line_loads_on_its_own_majors_oldest_driver(name):
    """Minor version compatibility: each line's pinned NVRTC runs on the x.0 driver of its major."""
    nvrtc = parse_version(_pin(EXTRAS[name], LINES[name].nvrtc))
    assert nvrtc[0] == LINES[name].major
    assert mismatch(nvrtc, (LINES[name].major, 0)) is None
    assert choose_target(nvrtc, None) == "cubin"  # no driver: compile only


# --- which line is installed ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,nvrtc", [("cu13", "13.0.88"), ("cu12", "12.9.86")])
def test_a_complete_line_resolves_to_itself(name, nvrtc):
    res = resolve_line(full_set(name, nvrtc))
    assert res.line is LINES[name] and res.consistent
    assert res.nvrtc == parse_version(nvrtc)


def test_cupy_decides_when_torch_brings_the_other_majors_nvrtc():
    installed = {**full_set("cu13", "13.0.88"), "nvidia-cuda-nvrtc-cu12": "12.9.86"}
    res = resolve_line(installed)
    assert res.line is LINES["cu13"] and res.consistent and res.nvrtc == (13, 0)
    installed = {**full_set("cu12", "12.9.86"), "nvidia-cuda-nvrtc": "13.0.88"}
    res = resolve_line(installed)
    assert res.line is LINES["cu12"] and res.consistent and res.nvrtc == (12, 9)


def test_cupy_for_12_beside_the_13_toolchain_is_an_incomplete_cu12_line():
    installed = {**{d: "13.0.88" for d in LINES["cu13"].distributions if d != "cupy-cuda13x"},
                 "cupy-cuda12x": "14.2.0"}
    res = resolve_line(installed)
    assert res.line is LINES["cu12"] and not res.consistent
    (problem,) = res.problems
    assert "nvidia-cuda-nvrtc-cu12" in problem and "pip install 'kgen[cu12]'" in problem


def test_both_cupy_builds_installed_is_a_problem_naming_both():
    installed = {**full_set("cu13", "13.0.88"), **full_set("cu12", "12.9.86")}
    res = resolve_line(installed)
    assert not res.consistent
    assert any("cupy-cuda12x" in p and "cupy-cuda13x" in p and "uninstall both" in p for p in res.problems)


def test_nothing_installed_names_both_extras():
    res = resolve_line({})
    assert res.line is None and res.nvrtc is None
    (problem,) = res.problems
    assert "kgen[cu13]" in problem and "kgen[cu12]" in problem


def test_an_nvrtc_of_the_wrong_major_is_a_problem():
    res = resolve_line({**full_set("cu12", "12.9.86"), "nvidia-cuda-nvrtc-cu12": "13.0.1"})
    assert any("not CUDA 12's NVRTC" in p for p in res.problems)


def test_without_cupy_the_default_line_is_chosen_among_installed_nvrtcs():
    both = {"nvidia-cuda-nvrtc": "13.0.88", "nvidia-cuda-nvrtc-cu12": "12.9.86"}
    assert resolve_line(both).line is LINES[DEFAULT_LINE]
    assert resolve_line({"nvidia-cuda-nvrtc-cu12": "12.9.86"}).line is LINES["cu12"]


# --- the extras -------------------------------------------------------------------------------------------

def _pin(requirements: list[str], name: str) -> str:
    (req,) = [Requirement(r) for r in requirements if Requirement(r).name == name]
    (spec,) = req.specifier
    return spec.version.rstrip(".*")


@pytest.mark.parametrize("name", sorted(LINES))
def test_each_extra_installs_exactly_its_lines_distributions(name):
    names = {Requirement(r).name for r in EXTRAS[name]}
    assert names == set(LINES[name].distributions)
    for dist in LINES[name].distributions:
        if dist != LINES[name].cupy:
            assert _pin(EXTRAS[name], dist).split(".")[0] == str(LINES[name].major), dist


def test_the_base_install_pulls_no_line_and_test_and_vllm_pull_the_default():
    """The lines exclude each other (one `cupy` package), so the base dependencies name none of them;
    the README's commands install the default line through these extras."""
    line_dists = {d for line in LINES.values() for d in line.distributions}
    assert not {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]} & line_dists
    for extra in ("test", "vllm"):
        assert f"kgen[{DEFAULT_LINE}]" in EXTRAS[extra], extra
    readme = (ROOT / "README.md").read_text()
    assert f"pip install -e '.[{DEFAULT_LINE}]'" in readme


# --- this machine -------------------------------------------------------------------------------------------

def test_this_machine_reports_its_line_and_driver():
    """The real query. The `test` extra installs the default line (a cu12 environment passes too);
    there is no GPU here, so the driver is "no driver" (on a GPU machine its version is reported and
    the cubin target follows the rules above)."""
    info = cuda_line.describe()
    line = LINES[info["line"]]
    assert info["extra"] == line.extra and set(info["distributions"]) == set(line.distributions)
    from kgen.compile.nvrtc import (
        nvrtc_version,  # the library actually loaded agrees with its wheel
    )

    assert info["nvrtc"] == nvrtc_version() and parse_version(info["nvrtc"])[0] == line.major
    if info["driver"] is None:
        assert info["driver_source"].startswith("no driver") and info["loadable"] == [] and info["target"] is None
        assert info["problems"] == []  # a complete line, and no driver to mismatch
    else:  # a GPU machine
        driver = parse_version(info["driver"])
        assert info["loadable"] == list(loadable_targets(parse_version(info["nvrtc"]), driver))


def test_nvrtc_and_headers_come_from_the_lines_own_wheels():
    line = LINES[cuda_line.current().line.name]
    lib = cuda_line.nvrtc_library()
    assert lib is not None and lib.name.startswith("libnvrtc") and str(line.major) in lib.name
    assert lib.parent.as_posix().endswith(line.nvrtc_dir)
    dirs = cuda_line.include_dirs()
    assert dirs and cuda_include_dirs() == dirs and cuda_include_dir() == dirs[0]
    assert (dirs[0] / "cuda_fp16.h").is_file()
    assert any((d / "crt" / "host_defines.h").is_file() for d in dirs)  # g++ needs crt/ (the CPU backend)
    assert any((d / "nv" / "target").is_file() for d in dirs)  # and CCCL's <nv/target>


def test_cuda_module_refuses_a_driver_older_than_the_line(strict_cuda, monkeypatch):
    """On the strict driver model reporting a driver one CUDA major older than the installed line's
    NVRTC, loading its cubin is refused before the load, with both versions and the way out."""
    import cupy  # the model (strict_cuda installed it)

    from kgen.cache import ArtifactCache
    from kgen.compile.nvrtc import compile_cubin, nvrtc_version
    from kgen.runtime.cuda import CudaModule, loaded_cubin

    source = 'extern "C" __global__ void noop() {}'
    art = compile_cubin(source, "sm_90")
    path = loaded_cubin(ArtifactCache(), art.cubin, source)
    major = parse_version(nvrtc_version())[0]
    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: major * 1000)
    assert CudaModule(path, ["noop"]).arch == "sm_90"  # a driver of the line's own major x.0 loads it
    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: (major - 1) * 1000 + 80)
    with pytest.raises(ToolchainError) as e:
        CudaModule(path, ["noop"])
    message = str(e.value)
    assert f"CUDA {major - 1}.8" in message and f"NVRTC {nvrtc_version()}" in message
    older = [line for line in LINES.values() if line.major == major - 1]
    assert (f"pip install '{older[0].extra}'" if older else "upgrade the driver") in message


def test_cupy_that_cannot_start_on_an_older_driver_is_explained_not_silently_skipped(strict_cuda, monkeypatch):
    """CuPy built for the line's major does not start on an older major's driver (the strict model set
    to what CuPy reports then): backend 'auto' still runs on the CPU, but warns with the line to
    install, and the GPU diagnosis names it too."""
    import cupy
    from strict_cuda import CUDARuntimeError

    from kgen.build import select_backend
    from kgen.compile.nvrtc import nvrtc_version
    from kgen.runtime import cuda as kgen_cuda

    major = parse_version(nvrtc_version())[0]

    def insufficient_driver():
        raise CUDARuntimeError("cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime")

    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: (major - 1) * 1000 + 20)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", insufficient_driver)
    kgen_cuda._gpu_problem.cache_clear()
    with pytest.warns(cuda_line.LineWarning, match=rf"CUDA {major - 1}\.2.*NVRTC"):
        assert select_backend("auto") == "cpu"
    diagnosis = kgen_cuda.gpu_diagnosis()
    assert "cudaErrorInsufficientDriver" in diagnosis and f"CUDA {major - 1}.2" in diagnosis
    older = [line for line in LINES.values() if line.major == major - 1]
    assert (older[0].extra if older else "upgrade the driver") in diagnosis
