"""A kernel's static figures and estimated speed over the batch x context grid (ESTIMATES, no GPU).

`kernel_subject` compiles kgen's kernel for a spec (or a hand-written source with the spec's ABI) for
one arch, reads ptxas's resources and the SASS (kgen/perf/sass.py, kgen/perf/model.py), and plans
its launches with kgen's call-time planner; `Subject.estimate(batch, context)` gives the model's time
with the binding term. Used by `kgen perf`, `kgen verify --source` and benchmarks/static_perf.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kgen.bodies import spec_for_arch
from kgen.build import build
from kgen.compile.nvrtc import compile_cubin, resources_as_dict
from kgen.families.base import PerfModel, resolve_config
from kgen.families.pool import pool_of
from kgen.families.registry import family_for
from kgen.kernel import Kernel
from kgen.perf import model as pm
from kgen.perf.sass import sass_text
from kgen.render import Rendered, render
from kgen.spec.models import load_spec
from kgen.verify.untrusted.source_policy import prepare_source


def perf_model(spec) -> PerfModel:
    """Which static model reads the spec's kernel: its family's answer (kgen/families/base.py)."""
    return family_for(spec).perf_model


def packed_rows(spec) -> bool:
    """Query rows packed by sequence (q_indptr, prefill's): a plan then takes each sequence's chunk."""
    rows = family_for(spec).rows
    return rows is not None and rows.packed


def kv_bytes_per_token(spec) -> int:
    """KV bytes one decoded token reads: its pool format's (kgen/families/pool.py: K and V rows of every KV
    head plus per-token scales; nvfp4: its e4m3 block scales, a byte per 16 elements)."""
    return pool_of(spec).bytes_per_token()


@dataclass
class Figures:
    """ptxas and SASS figures of one kernel function."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int
    ldl: int
    stl: int
    in_flight: float                  # bytes per thread in flight in the streaming loops (estimate)
    loops: list[pm.LoopMLP]
    bulk: int                         # TMA copies: outside the in-flight model
    work: pm.Work                     # warp-instructions, smem wavefronts, tensor FLOP per stream byte


def figures(fn: pm.SassFunction, res, dev: pm.Device = pm.H200, hint: pm.TileHint | None = None) -> Figures:
    ipt, mlps = pm.thread_in_flight(fn, dev, hint)
    ldl, stl = pm.local_memory_instructions(fn)
    return Figures(res.registers, res.spill_stores, res.spill_loads, res.stack_frame, res.static_smem,
                   ldl, stl, ipt, mlps, pm.bulk_copies(fn), pm.kernel_work(fn, hint))


@dataclass
class Plan:
    launches: list[pm.Launch]
    main: int = 0                     # the launch that streams the KV cache
    partial_bytes: float = 0.0        # split-KV partial results, written and read back


@dataclass
class Subject:
    label: str
    kernels: dict[str, Figures]       # by the kernel names its launches use
    plan: Callable[[int, int], Plan]  # (batch, context) -> launches
    kv_bytes: Callable[[int, int], float]
    grid_source: str
    dedupe: int = 1                   # blocks reading the same KV (vLLM: one block per query head)
    spec: object = None
    notes: list[str] = field(default_factory=list)
    path: str = ""                    # the decode path (kgen: "CUDA cores" / "tensor cores" by mma_min_group)
    dev: pm.Device = pm.H200

    def estimate(self, batch: int, context: int) -> tuple[pm.Estimate | None, pm.Occupancy]:
        plan = self.plan(batch, context)
        main = plan.launches[plan.main]
        fig = self.kernels[main.kernel]
        occ = pm.occupancy(main.threads, fig.registers, fig.static_smem + main.smem, self.dev)
        if fig.in_flight <= 0 or occ.blocks == 0:
            return None, occ
        est = pm.estimate_seconds(self.kv_bytes(batch, context), main.blocks, main.threads, fig.in_flight,
                                  occ.blocks, extra_launches=len(plan.launches) - 1,
                                  partial_bytes=plan.partial_bytes, dedupe=self.dedupe, dev=self.dev, work=fig.work)
        return est, occ


def _prod(x) -> int:
    return int(np.prod(x)) if isinstance(x, (tuple, list)) else int(x)


def planning_kernel(spec, rendered, arch: str = "sm_90", dev: pm.Device = pm.H200) -> Kernel:
    """A Kernel to plan with: one without a module (planning launches nothing), or, where the planner
    wants more of it, one built for the CPU backend (a g++ build, cached)."""
    try:  # with the arch's ptxas figures, so the plan fills the SMs by the kernel's own occupancy
        figs = resources_as_dict(compile_cubin(rendered.source, arch).resources)
        kern = Kernel(spec, rendered.source, rendered.config, None, rendered.kernel_names, resources={arch: figs})
        first = {"q_indptr": np.array([0, 1], dtype=np.int32)} if packed_rows(spec) else {}
        kern.plan(np.full(1, spec.kv_cache.block_size, dtype=np.int32), num_sms=dev.sms, **first)
        return kern
    except Exception:  # a genuine planner error surfaces again from the built kernel's plan
        return build(spec, backend="cpu", verify=False, archs=[arch], config=dict(rendered.config))


def kgen_planner(spec, rendered, arch: str = "sm_90",
                 dev: pm.Device = pm.H200) -> tuple[Callable[[int, int], list[pm.Launch]], str]:
    """kgen's launches for `batch` sequences of `context` tokens: kern.plan when kgen has it, else the
    family's fixed launch geometry (grid names resolved for a block table just wide enough)."""
    if hasattr(Kernel, "plan"):
        kern = planning_kernel(spec, rendered, arch, dev)

        def planned(batch: int, context: int) -> list[pm.Launch]:
            lengths = {}
            if packed_rows(spec):  # each sequence prefilled whole: q_len = context
                lengths["q_indptr"] = np.arange(batch + 1, dtype=np.int32) * context
            plan = kern.plan(np.full(batch, context, dtype=np.int32), num_sms=dev.sms, **lengths)
            return [pm.Launch(ln.kernel, _prod(ln.grid), _prod(ln.block), int(ln.smem_bytes)) for ln in plan.launches]

        return planned, f"kern.plan(seq_lens, num_sms={dev.sms})"
    decls = family_for(spec).kernels(spec, rendered.config)
    block, part = spec.kv_cache.block_size, rendered.config.get("partition_size", 0)

    def fixed(batch: int, context: int) -> list[pm.Launch]:
        width = -(-context // block)
        sizes = {"num_seqs": batch, "max_partitions": -(-width * block // part) if part else 1}
        return [pm.Launch(d.name, _prod([sizes[g] if isinstance(g, str) else g for g in d.grid]), _prod(d.block),
                          d.smem) for d in decls]

    return fixed, f"fixed grid (config {rendered.config}; kgen has no kern.plan)"


def tile_hint(spec, config) -> pm.TileHint | None:
    """What kgen's decode geometry says about its kernel's nested loops (kgen/perf/model.py, TileHint):
    the K/V bytes a thread copies per tile, and the CUDA-core body's batch loop trips per tile. None for
    kernels the streaming model does not read (and for hand-written sources, whose loops kgen's geometry
    does not describe)."""
    family = family_for(spec)
    if family.perf_model is not PerfModel.STREAMING:
        return None
    # a streaming family's context carries geo and tensor_cores
    ctx = family.template_context(spec, config, family.kernels(spec, config))
    geo = ctx["geo"]
    tile_bytes = geo.tile_tokens * kv_bytes_per_token(spec) / spec.attention.num_kv_heads / geo.threads
    return pm.TileHint(tile_bytes, 1 if ctx["tensor_cores"] else geo.tokens_per_thread // geo.batch_tokens)


def kernel_subject(spec, rendered: Rendered, cuobjdump: str, arch: str = "sm_90", cache=None, origin: str = "",
                   label: str | None = None, path_name: str = "", hint: pm.TileHint | None = None) -> Subject:
    """The Subject of `rendered` (kgen's source for `spec`, or a hand-written one with its ABI config)
    compiled for `arch` on that arch's device preset (pm.DEVICES); `hint`: kgen's geometry (tile_hint)."""
    dev = pm.DEVICES.get(arch, pm.H200)
    art = compile_cubin(rendered.source, arch, origin=origin or spec.name, cache=cache)
    funcs = pm.parse_sass(sass_text(art.cubin, cuobjdump))
    kernels = {name: figures(funcs[name], art.resources[name], dev, hint if name == spec.name else None)
               for name in rendered.kernel_names}
    launches, source = kgen_planner(spec, rendered, arch, dev)
    a = spec.attention
    window = a.sliding_window or 0
    per_token = kv_bytes_per_token(spec)

    def plan(batch: int, context: int) -> Plan:
        lns = launches(batch, context)
        # the KV-streaming launch: the one named after the spec, else the one keeping most bytes in flight
        main = next((i for i, ln in enumerate(lns) if ln.kernel == spec.name),
                    max(range(len(lns)), key=lambda i: getattr(kernels.get(lns[i].kernel), "in_flight", 0)))
        partial = 0.0
        if len(lns) > 1:  # fp32 partial output and (m, l) per (sequence, query head, partition)
            parts = lns[main].blocks / (batch * a.num_kv_heads)
            partial = 2 * batch * a.num_q_heads * parts * (spec.v_head_dim_value + 2) * 4
        return Plan(lns, main, partial)

    def kv_bytes(batch: int, context: int) -> float:
        return float(batch * (min(context, window) if window else context) * per_token)

    return Subject(label or f"kgen {spec.name}", kernels, plan, kv_bytes, source, spec=spec, path=path_name, dev=dev)


def kgen_subject(path: Path, cuobjdump: str, cache, spec=None, config: dict | None = None,
                 label: str | None = None, arch: str = "sm_90", hinted: bool = True) -> Subject:
    """kgen's kernel for the spec at `path` (or `spec`, a variant of it) with `config` over the defaults.
    `hinted`: read its nested loops with kgen's geometry (tile_hint); False reads the SASS alone, as a
    hand-written source is read, for a like-for-like comparison."""
    spec = spec_for_arch(spec or load_spec(path), arch)  # the body `arch` gets, with its geometry
    rendered = render(spec, config, arch)
    path_name = ""
    if config and "mma_min_group" in config:
        path_name = "tensor cores" if config["mma_min_group"] else "CUDA cores"
    return kernel_subject(spec, rendered, cuobjdump, arch, cache, origin=str(path), label=label, path_name=path_name,
                          hint=tile_hint(spec, rendered.config) if hinted else None)


def source_subject(spec, source: str, cuobjdump: str, arch: str = "sm_90", origin: str = "<source>",
                   label: str | None = None) -> Subject:
    """A hand-written kernel (the ABI of `kgen abi SPEC`, launched with the family's ABI config), checked
    by the same source policy as `kgen verify --source` before it is compiled."""
    prepared = prepare_source(source, origin)
    family = family_for(spec)
    config = resolve_config(family, spec, family.abi_config(spec))
    rendered = Rendered(prepared.text, family.kernel_names(spec, config), config)
    return kernel_subject(spec, rendered, cuobjdump, arch, origin=origin, label=label or f"{Path(origin).name}")
