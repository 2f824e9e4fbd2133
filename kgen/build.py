"""kgen.build: spec → rendered source → compiled artifacts → Kernel (→ verified)."""

from __future__ import annotations

import warnings
from typing import Any

from kgen.cache import ArtifactCache
from kgen.compile import cuda_line
from kgen.compile.host import compile_host
from kgen.compile.nvrtc import compile_cubin, resources_as_dict
from kgen.errors import CompileError, KgenUserError
from kgen.families.base import Config
from kgen.families.registry import family_for
from kgen.kernel import Kernel
from kgen.plan.arch import launch_problems
from kgen.render import Rendered, render
from kgen.runtime.cpu import CpuModule
from kgen.runtime.cuda import (
    CudaModule,
    IsolatedCudaModule,
    device_arch,
    gpu_available,
    loaded_cubin,
)
from kgen.runtime.isolated import IsolatedCpuModule
from kgen.settings import KGEN_BACKEND
from kgen.torch_ops import register_if_imported
from kgen.verify.runner import verify as run_verify

BACKENDS = ("auto", "cuda", "cpu")


def select_backend(backend: str) -> str:
    """'auto' is CUDA when a GPU is visible, else CPU (KGEN_BACKEND overrides auto)."""
    if backend not in BACKENDS:
        raise KgenUserError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    if backend == "auto":
        forced = KGEN_BACKEND.value()
        if forced != "auto":
            return forced
        if gpu_available():
            return "cuda"
        if problem := cuda_line.driver_mismatch():  # a GPU kgen's line cannot use: say so, not silently
            warnings.warn(f"backend 'auto' runs on the CPU: {problem}", cuda_line.LineWarning, stacklevel=2)
        return "cpu"
    return backend


def compile_cubins(spec, rendered: Rendered, archs: list[str] | None = None,
                   cache: ArtifactCache | None = None) -> dict[str, Any]:
    """NVRTC cubins for the spec's targets (or `archs`): {arch: CubinArtifact}."""
    origin = f"spec {spec.name}" + (f" ({spec.source_path})" if spec.source_path else "")
    return {arch: compile_cubin(rendered.source, arch, origin=origin, cache=cache)
            for arch in (archs if archs is not None else spec.targets)}


def check_register_splits(spec, config: Config, cubins: dict[str, Any]) -> None:
    """A kernel whose warpgroups trade registers (setmaxnreg; KernelDecl.launch_registers) must have
    been allocated exactly that many at launch in every cubin: with fewer, setmaxnreg.inc would wait
    forever on the GPU. A CompileError naming the kernel and arch otherwise, before anything runs."""
    problems = [p for decl in family_for(spec).kernels(spec, config) if decl.launch_registers
                for arch, art in cubins.items() if decl.name in art.resources
                for p in launch_problems(arch, decl.name, decl.block, art.resources[decl.name].registers, 0, 0,
                                         decl.launch_registers)]
    if problems:
        raise CompileError(f"spec {spec.name}: " + "; ".join(problems) + " (a config with `path: 1`, the "
                           "mma.sync body, has no register split)")


def load_module(backend: str, rendered: Rendered, cubins: dict[str, Any] | None = None,
                sanitize: bool = False, cache: ArtifactCache | None = None, race_check: bool = False,
                isolated: bool = False):
    """A runnable module for `backend` from the rendered source (CPU) or a cubin for this GPU (CUDA).
    `race_check` (CPU only): shared-memory race detection and varied thread schedules; with
    `isolated`, every launch runs in a child process with limits (kgen.runtime.isolated)."""
    if backend == "cpu":
        artifact = compile_host(rendered.source, rendered.kernel_names, sanitize=sanitize, cache=cache,
                                race_check=race_check)
        return IsolatedCpuModule(artifact) if isolated and not sanitize else CpuModule(artifact)
    arch = device_arch()
    art = (cubins or {}).get(arch) or compile_cubin(rendered.source, arch, cache=cache)
    cubin = loaded_cubin(cache or ArtifactCache(), art.cubin, rendered.source)
    return IsolatedCudaModule(cubin, rendered.kernel_names) if isolated else CudaModule(cubin, rendered.kernel_names)


def build(spec, backend: str = "auto", verify: bool = True, config: Config | None = None,
          archs: list[str] | None = None, sanitize: bool = False, seed: int | None = None,
          cache: ArtifactCache | None = None, race_check: bool = False, debug: bool | None = None,
          device_budget: int | None = None) -> Kernel:
    """Render, compile (cubins for every target arch + the runnable backend), and verify
    (`race_check`: on the CPU backend, with shared-memory race detection). `debug`: the kernel's
    value checks (Kernel.debug). `device_budget`: verification's largest cases run on the host
    (kgen.verify.runner.verify). With torch imported, the kernel becomes torch.ops.kgen.<name>
    unless it failed verification (docs/interop.md)."""
    chosen = select_backend(backend)  # a bad backend or KGEN_BACKEND is refused before any work
    rendered = render(spec, config)
    cubins = compile_cubins(spec, rendered, archs, cache)
    check_register_splits(spec, rendered.config, cubins)
    module = load_module(chosen, rendered, cubins, sanitize=sanitize, cache=cache, race_check=race_check)
    kernel = Kernel(spec, rendered.source, rendered.config, module, rendered.kernel_names,
                    resources={arch: resources_as_dict(a.resources) for arch, a in cubins.items()},
                    artifacts={"cubins": cubins})
    kernel.debug = debug
    kernel.notes = list(rendered.notes)  # e.g. which prefill body was built, or why not the Hopper one
    if verify:
        def host_twin() -> Kernel:  # where verification runs the cases past device_budget
            twin = build(spec, backend="cpu", verify=False, config=rendered.config, cache=cache)
            twin.debug = debug
            return twin

        kernel.report = run_verify(kernel, seed=seed, device_budget=device_budget, host_twin=host_twin)
    if kernel.report is None or kernel.report.passed:
        register_if_imported(kernel)
    return kernel
