"""`kgen perf`: a kernel's static figures and estimated speed, without a GPU (docs/performance.md).

Registers, spills, shared memory, occupancy and bytes in flight from ptxas and the SASS; for decode
specs the model's estimated fraction of copy bandwidth over the batch x context grid (pm.SHAPES),
with the term that binds (kgen/perf/model.py). Every number is an ESTIMATE.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from kgen.bodies import spec_for_arch
from kgen.cli.common import guard, load_specs, out
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import KgenUserError
from kgen.families.base import PerfModel
from kgen.families.registry import family_for
from kgen.perf import model as pm
from kgen.perf.mla_model import decode_table
from kgen.perf.report import (
    Subject,
    kgen_subject,
    packed_rows,
    perf_model,
    source_subject,
)
from kgen.perf.sass import require_cuobjdump, usable_cuobjdump
from kgen.render import render

PERF_ARCHS = tuple(pm.DEVICES)
PREFILL_NOTE = ("the speed model covers decode only: prefill's tensor-core model is not there yet (issue 22); "
                "resources only")


def subjects_for(spec, source_file: str | None, arch: str) -> list[Subject]:
    """kgen's kernel for the spec, then the hand-written one when there is a source."""
    if perf_model(spec) not in (PerfModel.STREAMING, PerfModel.TILES):
        raise no_model(spec)
    cuobjdump = require_cuobjdump()
    if source_file is None:
        return [kgen_subject(spec.source_path, cuobjdump, None, spec=spec, arch=arch)]
    try:
        text = Path(source_file).read_text()
    except OSError as e:
        raise KgenUserError(f"{source_file}: cannot read the kernel source ({e.strerror})") from None
    # Like for like first: kgen's kernel with the launch a hand-written kernel implements (ABI 1: the family's
    # abi_config, single pass), then the source, then kgen's kernel as kgen launches it (its default config).
    abi = family_for(spec).abi_config(spec)
    # (the ABI row reads kgen's SASS alone, as the source's is read: no geometry hint for either)
    return [kgen_subject(spec.source_path, cuobjdump, None, spec=spec, arch=arch, config=abi, hinted=False,
                         label=f"kgen {spec.name} (ABI launch: {', '.join(f'{k}={v}' for k, v in abi.items())})"),
            source_subject(spec, text, cuobjdump, arch, origin=str(source_file)),
            kgen_subject(spec.source_path, cuobjdump, None, spec=spec, arch=arch,
                         label=f"kgen {spec.name} (its default config)")]


def no_model(spec) -> KgenUserError:
    return KgenUserError(f"{spec.source_path or spec.name}: kgen perf has no static model of this kernel (kind "
                         f"{spec.kind}, kv_cache.layout {spec.kv_cache.layout}); modeled are paged_decode and "
                         "paged_prefill on the paged layouts and kgen's own paged_decode on the mla layout")


def resources(s: Subject, batch: int = 64, context: int = 4096) -> list[dict]:
    """Per launch of the plan for batch x context: ptxas/SASS figures, occupancy, bytes in flight."""
    dev, rows = s.dev, []
    plan = s.plan(batch, context)
    for i, ln in enumerate(plan.launches):
        f = s.kernels[ln.kernel]
        occ = pm.occupancy(ln.threads, f.registers, f.static_smem + ln.smem, dev)
        rows.append({"kernel": ln.kernel, "streams_kv": i == plan.main, "registers": f.registers,
                     "spill_stores": f.spill_stores, "spill_loads": f.spill_loads, "stack": f.stack,
                     "ldl": f.ldl, "stl": f.stl, "static_smem": f.static_smem, "dynamic_smem": ln.smem,
                     "threads": ln.threads, "blocks_per_sm": occ.blocks, "occupancy_limit": occ.limiter,
                     "warps_per_sm": occ.warps, "in_flight_per_thread": round(f.in_flight, 1),
                     "in_flight_per_sm": round(occ.blocks * ln.threads * f.in_flight),
                     "loop_instrs": f.work.loop_instrs, "instrs_per_byte": round(f.work.instrs_per_byte, 4)})
    return rows


def grid(s: Subject) -> list[dict]:
    cells = []
    for b, c in pm.SHAPES:
        e, _ = s.estimate(b, c)
        cells.append({"batch": b, "context": c, "fraction": None if e is None else e.fraction,
                      "bound": None if e is None else e.bound, "seconds": None if e is None else e.seconds,
                      "blocks": None if e is None else e.blocks})
    return cells


def subject_dict(s: Subject, decode: bool) -> dict:
    return {"label": s.label, "grid_source": s.grid_source, "resources": resources(s),
            "grid": grid(s) if decode else None}


def slower_cells(kgen: list[dict], mine: list[dict], margin: float) -> list[str]:
    """The grid cells where `mine`'s estimated fraction is below kgen's by more than `margin` (relative)."""
    bad = []
    for k, m in zip(kgen, mine, strict=True):
        if k["fraction"] is None:
            continue
        got = m["fraction"] or 0.0
        if got < k["fraction"] * (1.0 - margin):
            bad.append(f"{k['batch']}x{k['context']}: {100 * got:.1f}% vs kgen's {100 * k['fraction']:.1f}%")
    return bad


def perf_report(spec, source_file: str | None, arch: str) -> dict:
    dev = pm.DEVICES[arch]
    decode = perf_model(spec) is PerfModel.STREAMING  # the speed grid: the streaming model's
    subjects = subjects_for(spec, source_file, arch)
    return {"spec": spec.name, "kind": spec.kind, "prefill": packed_rows(spec), "arch": arch,
            "device": {"name": dev.name, "sms": dev.sms, "copy_bw": dev.copy_bw, "peak_bw": dev.peak_bw,
                       "clock_hz": dev.clock_hz, "latency_s": dev.latency_s},
            "estimate": "static ESTIMATE from ptxas, SASS and launch geometry (docs/performance.md), not a measurement",
            "note": None if decode else PREFILL_NOTE,
            "subjects": [subject_dict(s, decode) for s in subjects]}


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def md_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


RESOURCE_HEAD = ["kernel", "regs", "spill st/ld B", "stack B", "LDL/STL", "smem static+dyn B", "threads",
                 "blocks/SM (limit)", "warps/SM", "B in flight/thread", "KB in flight/SM"]


def print_report(rep: dict) -> None:
    dev = rep["device"]
    say = lambda text: out.print(text, markup=False)  # noqa: E731
    say(f"{rep['spec']} ({rep['kind']}) on {dev['name']}: {dev['sms']} SMs, {dev['clock_hz'] / 1e9:.2f} GHz, "
        f"copy bandwidth {dev['copy_bw'] / 1e12:.2f} TB/s (datasheet {dev['peak_bw'] / 1e12:.2f}); "
        "every figure below is a static ESTIMATE, not a measurement")
    rows = []
    for s in rep["subjects"]:
        for r in s["resources"]:
            rows.append([s["label"] if r["streams_kv"] else f"  + {r['kernel']}", r["registers"],
                         f"{r['spill_stores']}/{r['spill_loads']}", r["stack"], f"{r['ldl']}/{r['stl']}",
                         f"{r['static_smem']}+{r['dynamic_smem']}", r["threads"],
                         f"{r['blocks_per_sm']} ({r['occupancy_limit']})", r["warps_per_sm"],
                         f"{r['in_flight_per_thread']:.0f}", f"{r['in_flight_per_sm'] / 1024:.0f}"])
    whole = " (prefill: each sequence's 4096 tokens prefilled in one chunk)" if rep["prefill"] else ""
    say(f"\nResources on {rep['arch']} (the launches for batch 64 x context 4096{whole})\n")
    say(md_table(RESOURCE_HEAD, rows))
    if rep["note"]:
        say(f"\nnote: {rep['note']}")
        return
    subjects = rep["subjects"]
    head = ["batch x context", *(s["label"] for s in subjects)]
    if len(subjects) > 1:
        head.insert(3, "time ratio kgen (ABI launch) / source")
    rows = []
    for i, (b, c) in enumerate(pm.SHAPES):
        cells = [s["grid"][i] for s in subjects]
        row = [f"{b}x{c}", *(f"{_pct(x['fraction'])} ({x['bound']})" if x["fraction"] is not None else "n/a"
                             for x in cells)]
        if len(subjects) > 1:
            k, m = cells[:2]
            row.insert(3, f"{k['seconds'] / m['seconds']:.2f}x" if k["seconds"] and m["seconds"] else "n/a")
        rows.append(row)
    say("\nEstimated fraction of copy bandwidth (binding term)\n")
    say(md_table(head, rows))
    for s in subjects:
        say(f"grid of {s['label']}: {s['grid_source']}")


def check_arch(arch: str) -> None:
    if arch not in pm.DEVICES:
        raise KgenUserError(f"--arch: {arch} has no device preset in the performance model "
                            f"(presets: {', '.join(PERF_ARCHS)})")


@click.command()
@click.argument("spec")
@click.option("--source", "source_file", type=click.Path(), default=None,
              help="also estimate this hand-written .cu file (the ABI of `kgen abi SPEC`) beside kgen's kernel")
@click.option("--arch", default="sm_90", show_default=True,
              help=f"device preset of the model: {', '.join(f'{a} ({d.name})' for a, d in pm.DEVICES.items())}")
@click.option("--json", "as_json", is_flag=True, help="print the figures as JSON")
@guard
def perf(spec, source_file, arch, as_json):
    """Static figures and estimated speed of SPEC's kernel (no GPU; needs cuobjdump and nvdisasm)."""
    check_arch(arch)
    (loaded,) = load_specs((spec,))
    if perf_model(loaded) is PerfModel.LATENT:  # its own model (kgen/perf/mla_model.py)
        rep = mla_report(loaded, source_file, arch)
        click.echo(json.dumps(rep, indent=2) if as_json else mla_text(rep))
        return
    rep = perf_report(loaded, source_file, arch)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    else:
        print_report(rep)


def mla_report(spec, source_file: str | None, arch: str) -> dict:
    """kgen's MLA decode kernel: its sm registers (NVRTC) and the static estimate over batches and contexts."""
    if perf_model(spec) is not PerfModel.LATENT:  # the latent model reads kgen's own MLA decode geometry
        raise no_model(spec)
    if source_file:
        raise KgenUserError(f"{spec.source_path or spec.name}: kgen perf's model of the mla layout covers kgen's "
                            "own paged_decode kernel only (got a --source)")
    rendered = render(spec, None, arch)  # the body `arch` gets
    res = compile_cubin(rendered.source, arch).resources
    regs = res[spec.name].registers
    rows = [{"batch": e.batch, "context": e.context, "us": e.estimate.seconds * 1e6,
             "copy_fraction": e.estimate.fraction, "tensor_fraction": e.tensor_fraction, "bound": e.estimate.bound,
             "partitions": e.partitions, "blocks": e.estimate.blocks}
            for e in decode_table(spec_for_arch(spec, arch), rendered.config, regs, pm.DEVICES[arch])]  # its geometry
    return {"spec": spec.name, "arch": arch, "device": pm.DEVICES[arch].name, "config": rendered.config,
            "resources": {name: {"registers": r.registers, "spill_stores": r.spill_stores,
                                 "spill_loads": r.spill_loads} for name, r in res.items()},
            "estimates": rows}


def mla_text(rep: dict) -> str:
    lines = [f"{rep['spec']} on {rep['device']}, config {rep['config']}",
             "registers: " + ", ".join(f"{n} {r['registers']} (spills {r['spill_stores']}/{r['spill_loads']})"
                                       for n, r in rep["resources"].items()),
             "ESTIMATES (kgen/perf/mla_model.py): fraction of the copy bandwidth and of the tensor-core peak",
             md_table(["batch", "context", "us", "copy bw", "tensor peak", "bound", "partitions"],
                      [[str(r["batch"]), str(r["context"]), f"{r['us']:.1f}", _pct(r["copy_fraction"]),
                        _pct(r["tensor_fraction"]), r["bound"], str(r["partitions"])] for r in rep["estimates"]])]
    return "\n".join(lines)


# ---- `kgen verify --source`: the hand-written kernel's figures beside kgen's -----------------------------
def parse_margin(value: str) -> float:
    """--require-speed's margin: 0.1 or 10%."""
    text = value.strip()
    try:
        margin = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise KgenUserError(f"--require-speed: expected a margin like 0.1 or 10%, got {value!r}") from None
    if not 0 <= margin < 1:
        raise KgenUserError(f"--require-speed: the margin must be in [0, 1) (or 0%..99%), got {value!r}")
    return margin


def speed_beside_kgen(spec, source_file: str, margin: float | None, arch: str = "sm_90") -> dict | None:
    """Print the source's figures beside kgen's kernel for the same spec. Returns the perf report, or None
    (with a one-line note) when there are no SASS tools or no speed model for the kind; with `margin`,
    those are errors (exit 2), and the caller fails the kernel on the cells `slower_cells` names."""
    why = None
    if usable_cuobjdump() is None:
        why = "no speed comparison: cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
    elif perf_model(spec) is not PerfModel.STREAMING:
        why = f"no speed comparison: {PREFILL_NOTE.split(';')[0]}"
    if why is not None:
        if margin is not None:
            raise KgenUserError(f"--require-speed: {why.removeprefix('no speed comparison: ')}")
        out.print(f"note: {why}", markup=False)
        return None
    rep = perf_report(spec, source_file, arch)
    print_report(rep)
    return rep


def require_speed_model(spec) -> None:
    """--require-speed's preconditions without printing: SASS tools and a decode spec (else exit 2)."""
    require_cuobjdump()
    if perf_model(spec) is not PerfModel.STREAMING:
        raise KgenUserError(f"--require-speed: {PREFILL_NOTE.split(';')[0]}")
