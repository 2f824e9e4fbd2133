"""Measured prefill figures on one GPU, against FlashInfer and torch SDPA, in one run (issue 22 item 5).

For each spec (default: specs/llama3_8b_prefill.yaml, fp16 KV, and specs/prefill_fp8_e4m3.yaml, fp8
e4m3 KV), at GQA 4 (32 q / 8 kv heads) and GQA 8 (64 / 8), head_dim 128, at the shapes
benchmarks/static_prefill.py estimates (causal prompts of 512, 4K, 16K and 64K tokens, a 256-token
chunk over a 32K prefix, the mixed batch of 8 chunks of 256 + 56 decode rows, and that batch's two
parts alone, so the mixed goal can be read off measured times too):

  - kgen, every path the spec's family offers (a tunable parameter that selects the tensor-core path,
    probed by name in the family's params: each of its values a row, for paged_prefill's `path` the
    mma.sync body and the Hopper wgmma body; else the default config), the spec retargeted to this
    GPU's arch alone (so the sm_90-only Hopper path builds from a spec that also targets sm_80), built
    for this GPU (its verification matrix run there unless --no-verify); `kern.plan(seq_lens,
    q_indptr=...)` once, outside the timed region; `kern(..., plan=plan)` timed with CUDA events around
    back-to-back calls, inputs rotated over several cache pools (and queries) until the working set is
    4 x the L2 (short prompts; a long prompt's K/V already exceed it);
  - FlashInfer's BatchPrefillWithPagedKVCacheWrapper over the very same pages (kgen's NHD pools are its
    layout), one row per backend (--flashinfer-backends, default fa2 and fa3: its sm80 and sm90
    paths), planned outside the timed region, run() timed, when `import flashinfer` works;
  - torch SDPA, causal (bottom-right aligned for a chunk after a prefix), on contiguous K/V gathered
    from the same pages (fp8 dequantized to fp16), query heads' K/V repeated for GQA; its output is
    the reference kgen's output is compared with once per shape (max |kgen - SDPA|).

Figures: TFLOP/s of the causal FLOP as the static model counts them (kgen/perf/prefill_model.py
causal_flop), kgen's fraction of the 989 TFLOP/s dense fp16 peak (H100/H200 SXM), FlashInfer time /
kgen time and SDPA time / kgen time (above 1: kgen is faster). Without a GPU it says so and exits 2:
nothing is measured or invented.

    PYTHONPATH=. python benchmarks/gpu_prefill.py [--spec specs/llama3_8b_prefill.yaml ...] [--gqa 4,8]
        [--shapes 512@512,256@33024,8x256@4096+56x1@4096] [--budget-ms 100] [--no-verify]
        [--no-flashinfer] [--flashinfer-backends fa2,fa3] [--max-minutes 7] [--json out.json]
    PYTHONPATH=. python benchmarks/gpu_prefill.py --cpu-dry-run   # the pipeline on the CPU, no figures

Designed to finish in under 8 minutes on one H200; FlashInfer's first use JIT-compiles a module per
backend and KV dtype (minutes: --no-flashinfer skips it; --max-minutes skips the remaining shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.gpu import NO_GPU_EXIT, cuda_torch

# the measuring code lives in kgen (kgen/bench/), shared with `kgen selftest`; re-exported for the tests
from kgen.bench.prefill import (  # noqa: F401
    DRY_RUN_SHAPES,
    PEAK,
    default_shapes,
    family_for,
    flop,
    mixed_lines,
    parse_shapes,
    prefill_paths,
    retargeted,
    run_spec,
    set_bytes,
    table,
    with_gqa,
)
from kgen.perf import model as pm
from kgen.runtime.cuda import device_arch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = [ROOT / "specs" / "llama3_8b_prefill.yaml", ROOT / "specs" / "prefill_fp8_e4m3.yaml"]


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: expected positive integers, e.g. 4,8")
    return values


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", type=Path,
                    help=f"prefill spec (repeatable; default {', '.join(p.name for p in DEFAULT_SPECS)})")
    ap.add_argument("--gqa", type=parse_ints, default=[4, 8], help="query heads per KV head (default 4,8)")
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="comma-separated [Nx]Q_LEN@KV_LEN[+...] (default: static_prefill's shapes and the mixed "
                         "batch's parts)")
    ap.add_argument("--budget-ms", type=float, default=100.0, help="timed GPU time per measurement (default 100)")
    ap.add_argument("--no-verify", action="store_true", help="skip kgen's verification matrix on the GPU")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer anchor")
    ap.add_argument("--flashinfer-backends", default="fa2,fa3",
                    help="FlashInfer prefill backends to time, one row each (default fa2,fa3)")
    ap.add_argument("--max-minutes", type=float, default=7.0,
                    help="skip the remaining shapes once the run has taken this long (default 7)")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the pipeline on the CPU at small shapes (tests the script; measures nothing)")
    return ap


def report(rows, shapes, args, device_name: str) -> None:
    backends = [] if args.no_flashinfer else [b for b in args.flashinfer_backends.split(",") if b]
    print(table(rows, backends))
    for line in mixed_lines(rows, shapes):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"device": device_name, "peak": PEAK, "rows": rows}, indent=1))


def specs(args, arch: str) -> list:
    """The specs to time, each retargeted to `arch` alone (kgen.bench.prefill.retargeted)."""
    return retargeted(args.spec or DEFAULT_SPECS, args.gqa, arch)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cpu_dry_run:
        return dry_run(args)
    torch = cuda_torch("gpu_prefill.py", "benchmarks/static_prefill.py", "the inputs, SDPA and FlashInfer")
    if torch is None:
        return NO_GPU_EXIT
    started = time.perf_counter()
    torch.cuda.set_stream(torch.cuda.default_stream())  # kgen launches through CuPy on the default stream
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; torch {torch.__version__}", flush=True)
    shapes = args.shapes or default_shapes()
    rows = []
    for spec in specs(args, device_arch()):
        rows += run_spec(torch, spec, shapes, args, props.multi_processor_count, l2, started)
    print(f"\nMeasured on {props.name}. TFLOP/s: causal FLOP (kgen/perf/prefill_model.causal_flop) / kgen time; "
          f"'of peak': of {PEAK / 1e12:.1f} TFLOP/s dense fp16. FI/kgen and SDPA/kgen: time ratios, above 1 kgen "
          "is faster.")
    report(rows, shapes, args, props.name)
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


def dry_run(args) -> int:
    """The same pipeline on the CPU (kgen's CPU backend, torch on the CPU, a wall clock) at small shapes:
    it checks the script's plumbing and kgen's agreement with SDPA, never a performance figure."""
    import torch

    shapes = args.shapes or DRY_RUN_SHAPES
    rows = []
    for spec in specs(args, "sm_90"):  # the paths an H200 would time
        rows += run_spec(torch, spec, shapes, args, pm.H200.sms, 0, time.perf_counter(), device="cpu")
    print("CPU DRY RUN: kgen's CPU backend and torch on the CPU; the times are not GPU figures.")
    args.no_flashinfer = True
    report(rows, shapes, args, "cpu dry run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
