"""kgen.build: spec → a rendered source per target arch (its best body, kgen/bodies.py) → compiled
artifacts → one Kernel running the body of the device's arch (→ verified, on the CPU backend every
body)."""

from __future__ import annotations

import warnings
from typing import Any

from kgen.bodies import cpu_arch as cpu_body_arch
from kgen.bodies import groups, spec_for_arch
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


def compile_cubins(spec, rendered: Rendered | dict[str, Rendered], archs: list[str] | None = None,
                   cache: ArtifactCache | None = None) -> dict[str, Any]:
    """NVRTC cubins for the spec's targets (or `archs`): {arch: CubinArtifact}, each of its arch's
    body: `rendered` is each arch's ({arch: Rendered}), one source for every arch (a hand-written
    kernel: Rendered.arch None), or one arch's body, the others rendered with its config."""
    origin = f"spec {spec.name}" + (f" ({spec.source_path})" if spec.source_path else "")

    def body(arch: str) -> Rendered:
        if isinstance(rendered, dict):
            return rendered[arch]
        if rendered.arch is None or rendered.arch == arch:
            return rendered
        return render(spec, rendered.config, arch)

    return {arch: compile_cubin(body(arch).source, arch, origin=origin, cache=cache)
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


def render_bodies(spec, config: Config | None, archs: list[str]) -> dict[str, Rendered]:
    """Each arch's body: the spec rendered once per arch (a config one arch cannot take is a
    KgenUserError naming it)."""
    return {arch: render(spec, config, arch) for arch in archs}


def build(spec, backend: str = "auto", verify: bool = True, config: Config | None = None,
          archs: list[str] | None = None, sanitize: bool = False, seed: int | None = None,
          cache: ArtifactCache | None = None, race_check: bool = False, debug: bool | None = None,
          device_budget: int | None = None, body_arch: str | None = None) -> Kernel:
    """Render each arch's body (`archs`, default the spec's targets; `archs=[]` compiles no cubin
    and renders the targets' bodies), compile a cubin per arch, load the body of `body_arch` (CUDA:
    default the device's arch, a GPU arch not built getting its own body compiled now; an older
    arch's portable body is compiled for the device; CPU: default the newest arch's), and verify (`race_check`: on the CPU backend, with shared-memory race
    detection): on the CPU backend every distinct body, each case named by its archs and body when
    there are several. `debug`: the kernel's value checks (Kernel.debug). `device_budget`:
    verification's largest cases run on the host (kgen.verify.runner.verify). With torch imported,
    the kernel becomes torch.ops.kgen.<name> unless it failed verification (docs/interop.md)."""
    chosen = select_backend(backend)  # a bad backend or KGEN_BACKEND is refused before any work
    body_archs = list(archs) if archs else list(spec.targets)
    bodies = render_bodies(spec, config, body_archs)
    cubins = compile_cubins(spec, bodies, archs, cache)
    for arch, art in cubins.items():
        check_register_splits(spec_for_arch(spec, arch), bodies[arch].config, {arch: art})
    device = device_arch() if chosen == "cuda" else None
    run_arch = body_arch or (device or cpu_body_arch(body_archs))
    rendered = bodies.get(run_arch) or render(spec, config, run_arch)
    # another arch's body on this GPU: its source compiled for the device, not that arch's cubin
    kernel = _kernel(spec, chosen, rendered, cubins, sanitize, cache, race_check, load=device in (None, run_arch))
    kernel.artifacts["bodies"] = bodies
    kernel.debug = debug
    kernel.notes = [line for r in bodies.values() for line in r.notes]
    if verify:
        def host_twin() -> Kernel:  # where verification runs the cases past device_budget: the same body
            twin = build(spec, backend="cpu", verify=False, config=rendered.config, cache=cache, archs=[],
                         body_arch=run_arch)
            twin.debug = debug
            return twin

        kernel.report = run_verify(kernel, seed=seed, device_budget=device_budget, host_twin=host_twin)
        others = [g for g in groups({a: r.source for a, r in bodies.items()}) if rendered.source != bodies[g[0]].source]
        if chosen == "cpu" and others:  # every body a build produces runs on some GPU: verify each here
            primary = [a for a in body_archs if bodies[a].source == rendered.source] or [run_arch]
            _label_cases(kernel.report, _body_label(primary, rendered))
            for group in others:
                twin = _kernel(spec, "cpu", bodies[group[0]], {}, sanitize, cache, race_check)
                twin.debug = debug
                report = run_verify(twin, seed=kernel.report.seed)
                _label_cases(report, _body_label(group, bodies[group[0]]))
                kernel.report.cases += report.cases
                kernel.report.seconds += report.seconds
        elif others:
            kernel.notes += [f"{_body_label(g, bodies[g[0]])}: not run on this {device} GPU (verify it with "
                             "--backend cpu, which runs every body)" for g in others]
    if kernel.report is None or kernel.report.passed:
        register_if_imported(kernel)
    return kernel


def body_lines(kernel) -> list[str]:
    """Which body each arch of a build got, and why ("sm_90: wgmma (Hopper body: ...)"); none for a
    family with one body (kgen build and the manifest show them)."""
    return [f"{arch}: {r.body} ({r.why})" for arch, r in kernel.artifacts.get("bodies", {}).items() if r.body]


def _kernel(spec, backend: str, rendered: Rendered, cubins: dict[str, Any], sanitize: bool,
            cache: ArtifactCache | None, race_check: bool, load: bool = True) -> Kernel:
    """A Kernel running `rendered` (one arch's body) on `backend` (`load`: from its cubin among `cubins`)."""
    module = load_module(backend, rendered, cubins if load else {}, sanitize=sanitize, cache=cache,
                         race_check=race_check)
    return Kernel(spec, rendered.source, rendered.config, module, rendered.kernel_names,
                  resources={arch: resources_as_dict(a.resources) for arch, a in cubins.items()},
                  artifacts={"cubins": cubins}, arch=rendered.arch)


def _body_label(archs: list[str], rendered: Rendered) -> str:
    return "/".join(archs) + (f" {rendered.body}" if rendered.body else "")


def _label_cases(report, label: str) -> None:
    """Name each case by the body it ran (a build verifying several bodies reports them in one report)."""
    for case in report.cases:
        case.name = f"[{label}] {case.name}"
        if case.first_failure:
            case.first_failure["case"] = case.name
