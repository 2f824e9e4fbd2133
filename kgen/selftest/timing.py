"""The decode and prefill timing steps: kgen against torch SDPA and FlashInfer (when importable) at
the benchmark shapes (kgen/bench, shared with benchmarks/gpu_decode.py and gpu_prefill.py). Each
shape is measured and saved in turn, so that a step stopped by its budget keeps what it measured.
On the CPU backend the same pipeline runs at small shapes with no timings kept: what it checks there
is kgen's output against SDPA's."""

from __future__ import annotations

import math
import time

from kgen.bench import decode as bd
from kgen.bench import prefill as bp
from kgen.bench.timing import Options, copy_bandwidth
from kgen.paths import specs_dir
from kgen.perf import model as pm
from kgen.runtime.cuda import device_arch
from kgen.selftest.outcome import Context, Outcome
from kgen.spec.models import load_spec

# |kgen - SDPA| above this is a wrong kernel, not rounding (the bound tests/benchmarks holds the GPU
# runs of these pipelines to: fp16/bf16 outputs, fp8 K/V dequantized alike on both sides)
SDPA_SANITY = 2e-2
MARGIN_S = 15  # stop starting shapes this long before the step's budget ends (a shape's set-up, saving)
BUDGET_MS = 25.0  # timed GPU time per measurement (the benchmarks default to 100-150 ms; 5 samples each)
DECODE_SPEC = "llama3_8b_decode.yaml"
PREFILL_SPECS = ("llama3_8b_prefill.yaml", "prefill_fp8_e4m3.yaml")
QUICK_DECODE_SHAPES = [(1, 512), (64, 4096), (256, 32768)]
QUICK_PREFILL_SHAPES = ("prompt 4K", "chunk 256 @ 32K", "mixed 8x256 + 56x1 @ 4K")
TIME_KEYS = ("kgen_s", "kgen_host_s", "sdpa_s", "copy_bw")  # and every flashinfer_*_s


def _torch(ctx: Context):
    """torch, or the reason the step cannot run (skipped)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed (the timing steps run torch SDPA and make the inputs with it)"
    if ctx.backend == "cuda" and not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no GPU (a CPU-only torch?): the timings need torch with CUDA"
    return torch, ""


def untimed(row: dict) -> dict:
    """A CPU-backend row without its wall-clock times: they are not figures of anything."""
    return {k: v for k, v in row.items() if k not in TIME_KEYS and not (k.startswith("flashinfer_") and k.endswith("_s"))}


def judge(outcome: Outcome, rows: list[dict]) -> Outcome:
    """Failed where kgen failed at a shape or disagreed with SDPA beyond SDPA_SANITY (NaN included)."""
    broken = [r for r in rows if str(r.get("skipped", "")).startswith("kgen failed")]
    off = [r for r in rows if "max_abs_kgen_vs_sdpa" in r
           and not r["max_abs_kgen_vs_sdpa"] <= SDPA_SANITY]  # `not <=`: NaN fails too
    if broken:
        outcome.fail(f"kgen failed at {len(broken)} row(s): {broken[0]['skipped']}")
    if off:
        worst = max(off, key=lambda r: r["max_abs_kgen_vs_sdpa"] if not math.isnan(r["max_abs_kgen_vs_sdpa"]) else math.inf)
        outcome.fail(f"kgen's output differs from SDPA's by more than {SDPA_SANITY} at {len(off)} row(s) "
                     f"(worst {worst['max_abs_kgen_vs_sdpa']:.3g})")
    return outcome


def _cpu_note() -> None:
    print("CPU backend: the times this log prints are wall-clock times of kgen's CPU backend and torch on the "
          "CPU, not figures of anything; the report keeps none of them.", flush=True)


def _device(torch) -> tuple[str, int, int]:
    torch.cuda.set_stream(torch.cuda.default_stream())  # kgen launches through CuPy on the default stream
    props = torch.cuda.get_device_properties(0)
    return props.name, props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20)


def decode(ctx: Context) -> Outcome:
    torch, why = _torch(ctx)
    if torch is None:
        return Outcome.skipped(why)
    spec = load_spec(specs_dir() / DECODE_SPEC)
    options = Options(budget_ms=BUDGET_MS, no_verify=True, max_minutes=math.inf)  # verified by the specs step
    outcome = Outcome(figures={"spec": spec.name, "rows": [], "timed": ctx.backend == "cuda"})
    rows = outcome.figures["rows"]
    if ctx.backend == "cpu":
        device, shapes, copy_bw, sms, l2 = "cpu", bd.DRY_RUN_SHAPES, math.nan, pm.H200.sms, 0
        _cpu_note()
    else:
        device, shapes = "cuda", QUICK_DECODE_SHAPES if ctx.quick else pm.SHAPES
        outcome.figures["device"], sms, l2 = _device(torch)
        copy_bw = copy_bandwidth(BUDGET_MS / 1e3)
        outcome.figures["copy_bw"] = copy_bw
    kerns = bd.build_paths(spec, options, device)
    if not kerns:
        return outcome.fail("no decode path of kgen built (the step's log says why)")
    for shape in shapes:
        if ctx.seconds_left() < MARGIN_S:
            rows.append({"spec": spec.name, "path": "all", "batch": shape[0], "context": shape[1],
                         "kv_bytes": 0, "skipped": "the step's time budget is spent"})
            continue
        new = bd.run_spec(torch, spec, [shape], options, copy_bw, sms, l2, device=device, kerns=kerns)
        rows += new if device == "cuda" else [untimed(r) for r in new]
        ctx.save(outcome)
    return judge(outcome, rows)


def prefill(ctx: Context) -> Outcome:
    torch, why = _torch(ctx)
    if torch is None:
        return Outcome.skipped(why)
    options = Options(budget_ms=BUDGET_MS, no_verify=True, max_minutes=math.inf,
                      flashinfer_backends="fa2,fa3")
    outcome = Outcome(figures={"rows": [], "timed": ctx.backend == "cuda", "backends": ["fa2", "fa3"]})
    rows = outcome.figures["rows"]
    if ctx.backend == "cpu":  # the paths an H100/H200 would time, on the CPU backend
        device, arch, sms, l2, shapes = "cpu", "sm_90", pm.H200.sms, 0, bp.DRY_RUN_SHAPES
        _cpu_note()
        specs = bp.retargeted([specs_dir() / PREFILL_SPECS[0]], [4], arch)
        if ctx.quick:
            shapes = shapes[-1:]  # the mixed batch of chunks and single rows
        outcome.figures["backends"] = []
    else:
        device, arch = "cuda", device_arch()
        outcome.figures["device"], sms, l2 = _device(torch)
        # GQA 4 of both specs first, then GQA 8: what the budget reaches first matters most
        specs = [s for g in (4, 8) for s in bp.retargeted([specs_dir() / n for n in PREFILL_SPECS], [g], arch)]
        shapes = bp.default_shapes()
        if ctx.quick:
            specs, shapes = specs[:1], [s for s in shapes if s[0] in QUICK_PREFILL_SHAPES]
    outcome.figures["shapes"] = [label for label, _ in shapes]
    for spec in specs:
        if ctx.seconds_left() < MARGIN_S:
            rows.append({"spec": spec.name, "gqa": spec.group_size, "shape": "all", "path": "all",
                         "skipped": "the step's time budget is spent"})
            continue
        kerns = bp.build_paths(spec, options, device)
        if not kerns:
            outcome.fail(f"{spec.name}: no prefill path of kgen built (the step's log says why)")
            continue
        for label, seqs in shapes:
            if ctx.seconds_left() < MARGIN_S:
                rows.append({"spec": spec.name, "gqa": spec.group_size, "shape": label, "path": "all",
                             "skipped": "the step's time budget is spent"})
                continue
            new = bp.run_spec(torch, spec, [(label, seqs)], options, sms, l2, time.perf_counter(), device=device,
                              kerns=kerns)
            rows += new if device == "cuda" else [untimed(r) for r in new]
            ctx.save(outcome)
            if device == "cuda":
                torch.cuda.empty_cache()
    if ctx.backend == "cuda":
        outcome.figures["mixed"] = bp.mixed_lines(rows, shapes)
    return judge(outcome, rows)
