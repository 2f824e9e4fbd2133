"""Measured decode figures on one GPU, with the anchors a user compares against, in one run.

For each spec (default: the Llama-3-8B decode spec) at batch {1, 16, 64, 256} x context {512, 4096,
32768} (the shapes benchmarks/static_perf.py estimates):

  - kgen, each decode path: the CUDA-core loop (config `mma_min_group: 0`) and the tensor-core path
    (`mma_min_group: 1`) when the spec's family has that parameter (else the default config), each
    built and timed on the same inputs, one table row per path (the "decode path" column);
    the launches planned once, outside the timed region (`kern.plan(seq_lens)` when kgen has a
    planner; otherwise kgen's per-call binding runs inside the timed loop, unchecked: host work only,
    no device sync), then `kern(..., plan=plan)` timed with CUDA events around many back-to-back
    calls, inputs rotated over several cache pools so that the working set exceeds the L2;
  - device copy bandwidth: a 1 GiB device-to-device copy (CuPy), bytes read + written / time;
  - torch SDPA over the same K/V gathered into contiguous [batch, kv_heads, tokens, head_dim]
    tensors: attention without paging (the cost of paging is kgen's time over SDPA's);
  - FlashInfer's batch decode (its wrapper's plan outside the timed region, run() timed the same
    way) over the very same paged cache, when `import flashinfer` works on this machine.

It prints one table (a row per shape and decode path) of ratios (kgen's fraction of the copy bandwidth, SDPA time / kgen time,
FlashInfer time / kgen time: above 1 means kgen is faster) and the largest |kgen - SDPA| as a
sanity check. Without a GPU it says so and exits 2: nothing is measured or invented here.

    PYTHONPATH=. python benchmarks/gpu_decode.py [--spec specs/llama3_8b_decode.yaml]
        [--shapes 1x512,64x4096] [--budget-ms 150] [--no-verify] [--no-flashinfer] [--json out.json]

Designed to finish in well under 10 minutes on one H100/H200 (FlashInfer's first use JIT-compiles
its decode module, a minute or two; --no-flashinfer skips it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from benchmarks.gpu import NO_GPU_EXIT, cuda_torch

# the measuring code lives in kgen (kgen/bench/), shared with `kgen selftest`; re-exported for the tests
from kgen.bench.decode import (  # noqa: F401
    DRY_RUN_SHAPES,
    decode_paths,
    family_for,
    kv_bytes_per_token,
    run_spec,
    table,
)
from kgen.bench.timing import copy_bandwidth, random_tensor, time_per_call, torch_dtype  # noqa: F401
from kgen.perf import model as pm
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = ROOT / "specs" / "llama3_8b_decode.yaml"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x512,64x4096' -> [(1, 512), (64, 4096)]; argparse reports a bad value."""
    shapes = []
    for item in text.split(","):
        b, sep, c = item.strip().lower().partition("x")
        if not sep or not b.isdigit() or not c.isdigit() or int(b) < 1 or int(c) < 1:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: expected BATCHxCONTEXT, e.g. 64x4096")
        shapes.append((int(b), int(c)))
    return shapes


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", type=Path, help=f"decode spec (repeatable; default {DEFAULT_SPEC.name})")
    ap.add_argument("--shapes", type=parse_shapes, default=pm.SHAPES,
                    help="comma-separated BATCHxCONTEXT (default: batch 1,16,64,256 x context 512,4096,32768)")
    ap.add_argument("--budget-ms", type=float, default=150.0, help="timed GPU time per measurement (default 150)")
    ap.add_argument("--no-verify", action="store_true", help="skip the verification matrix on the GPU")
    ap.add_argument("--max-minutes", type=float, default=8.0,
                    help="skip the remaining shapes once a spec has run this long (default 8)")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer anchor")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the pipeline on the CPU at small shapes (tests the script; measures nothing)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cpu_dry_run:
        return dry_run(args)
    torch = cuda_torch("gpu_decode.py", "benchmarks/static_perf.py", "the SDPA anchor and the inputs")
    if torch is None:
        return NO_GPU_EXIT
    t0 = time.perf_counter()
    torch.cuda.set_stream(torch.cuda.default_stream())  # kgen launches through CuPy on the default stream
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
          f"L2 {l2 >> 20} MiB; torch {torch.__version__}", flush=True)
    copy_bw = copy_bandwidth(args.budget_ms / 1e3)
    print(f"device copy bandwidth (read + write, 1 GiB): {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for path in args.spec or [DEFAULT_SPEC]:
        rows += run_spec(torch, load_spec(path), args.shapes, args, copy_bw, props.multi_processor_count, l2)
    print()
    print(f"Measured on {props.name} (copy bandwidth {copy_bw / 1e9:.0f} GB/s). Time ratios: SDPA/kgen and "
          "FI/kgen above 1 mean kgen is faster; kgen/copy is KV bytes / kgen time over the copy bandwidth.")
    print(table(rows, copy_bw))
    for how in sorted({r["planning"] for r in rows if "planning" in r}):
        print(f"kgen's launches: {how}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"device": props.name, "copy_bw": copy_bw, "rows": rows}, indent=1))
    return 0


def dry_run(args) -> int:
    """The same pipeline on the CPU (kgen's CPU backend, torch on the CPU, a wall clock) at small shapes:
    it checks the script's plumbing and the kgen-vs-SDPA agreement, never a performance figure."""
    import torch

    shapes = args.shapes if args.shapes is not pm.SHAPES else DRY_RUN_SHAPES
    rows = []
    for path in args.spec or [DEFAULT_SPEC]:
        rows += run_spec(torch, load_spec(path), shapes, args, math.nan, pm.H200.sms, 0, device="cpu")
    print("CPU DRY RUN: kgen's CPU backend and torch on the CPU; the times are not GPU figures.")
    print(table(rows, math.nan))
    for how in sorted({r["planning"] for r in rows if "planning" in r}):
        print(f"kgen's launches: {how}")
    if args.json:
        args.json.write_text(json.dumps({"device": "cpu dry run", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
