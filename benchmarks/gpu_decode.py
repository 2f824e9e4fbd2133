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
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_figures import kv_bytes_per_token  # noqa: E402

from kgen.build import build  # noqa: E402
from kgen.families.registry import family_for  # noqa: E402
from kgen.formats.cache import cache_shapes, scale_shape  # noqa: E402
from kgen.formats.dtypes import dtype  # noqa: E402
from kgen.perf import model as pm  # noqa: E402
from kgen.runtime.cuda import gpu_available  # noqa: E402
from kgen.spec.models import load_spec  # noqa: E402

DEFAULT_SPEC = ROOT / "specs" / "llama3_8b_decode.yaml"
ROTATE_BYTES = 4  # rotate inputs until the working set is this many times the L2
MAX_ROTATE = 256
FLOAT_CACHES = ("fp16", "bf16", "fp32")
NO_GPU_EXIT = 2
DRY_RUN_SHAPES = [(2, 40), (3, 100)]


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


# ---- timing -----------------------------------------------------------------------------------------
def time_per_call(torch, call, sets: int, budget_s: float, device: str = "cuda", min_calls: int = 10,
                  samples: int = 5) -> tuple[float, float]:
    """(device seconds, host seconds) per call, medians of `samples` samples: CUDA events around n
    back-to-back calls (input set i % sets), n sized so one sample takes about budget_s / samples (at
    least min_calls), min(3, min_calls) warm-up calls first; the host figure is the wall time the loop
    took to enqueue them (when it is close to the device figure, the launches were host-bound). Long
    calls (a 64K-token prefill) take a small min_calls. In the CPU dry run both are the wall clock."""
    for i in range(min(3, min_calls)):
        call(i % sets)
    if device == "cpu":
        samples = []
        for _ in range(3):
            t = time.perf_counter()
            call(len(samples) % sets)
            samples.append(time.perf_counter() - t)
        return statistics.median(samples), statistics.median(samples)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(n: int) -> tuple[float, float]:
        start.record()
        t = time.perf_counter()
        for i in range(n):
            call(i % sets)
        host = time.perf_counter() - t
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / n, host / n

    n = max(min_calls, min(5000, int(budget_s / samples / max(sample(min(5, min_calls))[0], 1e-7))))
    runs = [sample(n) for _ in range(samples)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def copy_bandwidth(budget_s: float) -> float:
    """Device-to-device copy of 1 GiB (CuPy): (bytes read + bytes written) / median time."""
    import cupy

    n = 1 << 30
    # a fill kernel, not cupy.random: the values do not matter to a copy, and cuRAND is not installed
    src, dst = cupy.full(n // 4, 1.5, dtype=cupy.float32), cupy.empty(n // 4, dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(max(10, int(budget_s / 0.5e-3))):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * n / statistics.median(times[2:])


# ---- inputs -----------------------------------------------------------------------------------------
def torch_dtype(torch, name: str):
    return getattr(torch, dtype(name).torch_name)


def random_tensor(torch, shape, name: str, gen):
    t, device = torch_dtype(torch, name), gen.device
    if name == "int8":
        return torch.randint(-100, 101, shape, dtype=t, device=device, generator=gen)
    if name.startswith("fp8"):
        return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(t)
    return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(t)


def decode_inputs(torch, spec, batch: int, context: int, sets: int, gen) -> dict:
    """Device arguments of one call (torch tensors): `sets` independent cache pools under one shuffled
    block table, q, seq_lens, out."""
    a, kv = spec.attention, spec.kv_cache
    B = kv.block_size
    width = -(-context // B)
    nblocks = batch * width
    device = gen.device
    table = torch.randperm(nblocks, device=device, generator=gen).to(torch.int32).view(batch, width).contiguous()
    pools = []
    for _ in range(sets):
        pool = {n: random_tensor(torch, s, kv.dtype, gen) for n, s in cache_shapes(spec, nblocks).items()}
        shape = scale_shape(spec, nblocks)
        if shape is not None:
            for n in ("k_scale", "v_scale"):
                pool[n] = 0.01 + 0.02 * torch.rand(shape, dtype=torch.float32, device=device, generator=gen)
        pools.append(pool)
    common = {
        "q": random_tensor(torch, (batch, a.num_q_heads, a.head_dim), spec.dtype.q, gen),
        "block_tables": table,
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "out": torch.empty((batch, a.num_q_heads, a.head_dim), dtype=torch_dtype(torch, spec.dtype.resolved_out),
                           device=device),
    }
    if a.alibi:
        common["alibi_slopes"] = torch.rand(a.num_q_heads, dtype=torch.float32, device=device, generator=gen)
    return {"pools": pools, "common": common, "width": width}


def plain_float_cache(spec) -> bool:
    """SDPA and FlashInfer see the same cache: separate K/V in a float dtype, no ALiBi or soft-cap."""
    a, kv = spec.attention, spec.kv_cache
    return (kv.layout == "separate" and kv.dtype in FLOAT_CACHES and kv.dtype == spec.dtype.q
            and not a.alibi and not a.logits_soft_cap)


def contiguous_kv(torch, spec, pool: dict, table, context: int):
    """[batch, kv_heads, tokens, head_dim] K and V gathered through the block table (the window only)."""
    kv, a = spec.kv_cache, spec.attention
    first = max(0, context - a.sliding_window) if a.sliding_window else 0
    out = []
    for name in ("k_cache", "v_cache"):
        blocks = pool[name][table.long()]  # [batch, width, ...one block]
        if kv.resolved_order == "HND":
            blocks = blocks.transpose(2, 3)
        seq = blocks.reshape(table.shape[0], -1, a.num_kv_heads, a.head_dim)[:, first:context]
        out.append(seq.transpose(1, 2).contiguous())
        del blocks, seq
    return out


# ---- one spec -------------------------------------------------------------------------------------------
def kgen_caller(kern, spec, inputs: dict, sms: int):
    """(call(i), grid text, how launches are planned). Planning happens here, outside the timed loop."""
    pools, common = inputs["pools"], inputs["common"]
    if hasattr(kern, "plan"):
        plan = kern.plan(common["seq_lens"].cpu().numpy(), num_sms=sms)
        grid = " + ".join(str(int(np.prod(ln.grid))) for ln in plan.launches)
        return (lambda i: kern(**pools[i], **common, plan=plan)), grid, "kern.plan, outside the timed region"
    decls = family_for(spec).kernels(spec, kern.config)
    part = kern.config.get("partition_size", 0)
    sizes = {"num_seqs": common["q"].shape[0],
             "max_partitions": -(-inputs["width"] * spec.kv_cache.block_size // part) if part else 1}
    grid = " + ".join(str(int(np.prod([sizes[g] if isinstance(g, str) else g for g in d.grid]))) for d in decls)
    kern.checked = False  # the value checks read seq_lens and block_tables back to the host
    return (lambda i: kern(**pools[i], **common)), grid, "no kern.plan in this kgen: per-call binding, unchecked"


def flashinfer_caller(torch, spec, inputs: dict, context: int):
    """FlashInfer's decode wrapper over the same pools, planned once, or (None, reason)."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a wheel that does not load on this machine
        return None, f"not importable ({type(e).__name__}: {e})"[:120]
    a, kv = spec.attention, spec.kv_cache
    common, table = inputs["common"], inputs["common"]["block_tables"]
    batch, width = table.shape
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout=kv.resolved_order)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * width
    last = torch.full((batch,), context - (width - 1) * kv.block_size, dtype=torch.int32, device="cuda")
    wrapper.plan(indptr, table.reshape(-1), last, a.num_q_heads, a.num_kv_heads, a.head_dim, kv.block_size,
                 pos_encoding_mode="NONE", q_data_type=common["q"].dtype, kv_data_type=common["q"].dtype,
                 sm_scale=spec.softmax_scale_value,
                 window_left=(a.sliding_window - 1) if a.sliding_window else -1)
    out = torch.empty_like(common["out"])
    pools = inputs["pools"]
    return (lambda i: wrapper.run(common["q"], (pools[i]["k_cache"], pools[i]["v_cache"]), out=out)), None


MMA_PARAM = "mma_min_group"


def decode_paths(spec) -> list[tuple[str, dict | None]]:
    """(path name, config) per decode path to time: the CUDA-core loop (`mma_min_group: 0`) and the
    tensor-core path (`mma_min_group: 1`) when the spec's family has that parameter, else the default."""
    if MMA_PARAM in getattr(family_for(spec), "params", {}):
        return [("CUDA cores (mma_min_group=0)", {MMA_PARAM: 0}), ("tensor cores (mma_min_group=1)", {MMA_PARAM: 1})]
    return [(f"default config (no {MMA_PARAM} in this kgen)", None)]


def build_paths(spec, args, device: str) -> list[tuple[str, object]]:
    """(path name, built kernel) per decode path; a path that does not build is reported and left out."""
    kerns = []
    for name, config in decode_paths(spec):
        try:
            kern = build(spec, backend=device, verify=not args.no_verify, seed=1, config=config)
        except Exception as e:  # e.g. a config the family refuses for this spec
            print(f"{spec.name} [{name}]: not built ({type(e).__name__}: {str(e)[:160]})", flush=True)
            continue
        if kern.report is not None:
            print(f"{spec.name} [{name}]: verification matrix on {device}: "
                  f"{'pass' if kern.report.passed else 'FAIL'} ({kern.report.summary()})", flush=True)
        kerns.append((name, kern))
    return kerns


def run_spec(torch, spec, shapes, args, copy_bw: float, sms: int, l2: int, device: str = "cuda") -> list[dict]:
    """One row per (shape, decode path): every path timed on the same inputs, against the same SDPA and
    FlashInfer times (measured once per shape)."""
    import torch.nn.functional as F

    kerns = build_paths(spec, args, device)
    rows = []
    per_token = kv_bytes_per_token(spec)
    window = spec.attention.sliding_window or 0
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    budget = args.budget_ms / 1e3
    started = time.perf_counter()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for batch, context in shapes:
        kv_bytes = batch * (min(context, window) if window else context) * per_token
        pool_bytes = batch * (-(-context // spec.kv_cache.block_size)) * spec.kv_cache.block_size * per_token
        sets = max(1, min(MAX_ROTATE, math.ceil(ROTATE_BYTES * l2 / pool_bytes)))
        row = {"spec": spec.name, "path": "all", "batch": batch, "context": context, "kv_bytes": kv_bytes,
               "sets": sets, "copy_bw": copy_bw}
        free = torch.cuda.mem_get_info()[0] if device == "cuda" else math.inf
        factor = 3.2 if plain_float_cache(spec) else 1.2  # pools, then the contiguous copies and a gather
        if pool_bytes * sets * factor > 0.9 * free:
            row["skipped"] = f"needs ~{pool_bytes * sets * factor / 1e9:.0f} GB, {free / 1e9:.0f} GB free"
            rows.append(row)
            print(f"  {batch}x{context}: skipped ({row['skipped']})", flush=True)
            continue
        if time.perf_counter() - started > args.max_minutes * 60:
            row["skipped"] = f"the --max-minutes {args.max_minutes:g} budget is spent"
            rows.append(row)
            continue
        inputs = decode_inputs(torch, spec, batch, context, sets, gen)
        timed, outs = [], {}
        for name, kern in kerns:
            prow = dict(row, path=name)
            try:
                call, grid, how = kgen_caller(kern, spec, inputs, sms)
                prow.update(grid=grid, planning=how)
                prow["kgen_s"], prow["kgen_host_s"] = time_per_call(torch, call, sets, budget, device)
                inputs["common"]["out"].fill_(float("nan"))  # poison: the checked output must be written
                call(0)
                sync()
                outs[name] = inputs["common"]["out"].float().clone()
            except Exception as e:  # one failing path or shape must not lose the others' figures
                prow["skipped"] = f"kgen failed: {type(e).__name__}: {e}"[:200]
                print(f"  {batch}x{context} [{name}]: {prow['skipped']}", flush=True)
            timed.append(prow)
        anchors: dict = {}
        if plain_float_cache(spec) and outs:
            try:
                q = inputs["common"]["q"].unsqueeze(2)
                kvs = [contiguous_kv(torch, spec, p, inputs["common"]["block_tables"], context)
                       for p in inputs["pools"]]

                def sdpa(i, q=q, kvs=kvs):
                    return F.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], scale=spec.softmax_scale_value,
                                                          enable_gqa=True)

                anchors["sdpa_s"], _ = time_per_call(torch, sdpa, sets, budget, device)
                ref = sdpa(0).squeeze(2).float()
                for prow in timed:
                    if prow["path"] in outs:
                        prow["max_abs_kgen_vs_sdpa"] = float((outs[prow["path"]] - ref).abs().max())
                del kvs, sdpa, ref
            except Exception as e:
                anchors["sdpa"] = f"failed: {type(e).__name__}: {e}"[:120]
            if not args.no_flashinfer and device == "cuda":
                try:
                    fi, why = flashinfer_caller(torch, spec, inputs, context)
                    if fi is None:
                        anchors["flashinfer"] = why
                    else:
                        anchors["flashinfer_s"], _ = time_per_call(torch, fi, sets, budget, device)
                except Exception as e:
                    anchors["flashinfer"] = f"failed: {type(e).__name__}: {e}"[:120]
        del inputs, outs
        if device == "cuda":
            torch.cuda.empty_cache()
        for prow in timed:
            prow.update(anchors)
            rows.append(prow)
            if "kgen_s" in prow:
                print(f"  {batch}x{context} [{prow['path']}]: kgen {prow['kgen_s'] * 1e6:.1f} us"
                      + (f", SDPA {prow['sdpa_s'] * 1e6:.1f} us" if "sdpa_s" in prow else "")
                      + (f", FlashInfer {prow['flashinfer_s'] * 1e6:.1f} us" if "flashinfer_s" in prow else ""),
                      flush=True)
    return rows


def table(rows: list[dict], copy_bw: float) -> str:
    head = ["spec", "decode path", "shape", "KV MB", "kgen grid", "kgen us", "host us/call", "kgen GB/s", "kgen/copy", "SDPA us",
            "SDPA/kgen", "FlashInfer us", "FI/kgen", "max|kgen-SDPA|"]
    out = []
    for r in rows:
        if "skipped" in r:
            out.append([r["spec"], r["path"], f"{r['batch']}x{r['context']}", f"{r['kv_bytes'] / 1e6:.1f}",
                        "skipped: " + r["skipped"], *[""] * (len(head) - 5)])
            continue
        t = r["kgen_s"]
        bw = r["kv_bytes"] / t
        sd, fi = r.get("sdpa_s"), r.get("flashinfer_s")
        out.append([r["spec"], r["path"], f"{r['batch']}x{r['context']}", f"{r['kv_bytes'] / 1e6:.1f}", r["grid"],
                    f"{t * 1e6:.1f}", f"{r['kgen_host_s'] * 1e6:.1f}", f"{bw / 1e9:.0f}",
                    "n/a" if math.isnan(copy_bw) else f"{bw / copy_bw:.0%}",
                    f"{sd * 1e6:.1f}" if sd else r.get("sdpa", "n/a"), f"{sd / t:.2f}" if sd else "n/a",
                    f"{fi * 1e6:.1f}" if fi else r.get("flashinfer", "n/a"), f"{fi / t:.2f}" if fi else "n/a",
                    f"{r['max_abs_kgen_vs_sdpa']:.2e}" if "max_abs_kgen_vs_sdpa" in r else "n/a"])
    widths = [max(len(str(x[i])) for x in [head, *out]) for i in range(len(head))]
    fmt = lambda x: "| " + " | ".join(str(c).ljust(w) for c, w in zip(x, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, out)])


def cuda_torch(script: str, static: str, needs: str):
    """torch with a CUDA device, or None after saying on stderr why nothing was measured (no GPU for
    CuPy, or a torch without CUDA); the caller then exits NO_GPU_EXIT."""
    if not gpu_available():
        print(f"{script}: no CUDA GPU visible (CuPy sees none); these figures need one, so nothing was "
              f"measured. {static} gives the static estimates without a GPU.", file=sys.stderr)
        return None
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: CuPy sees a GPU but torch does not (a CPU-only torch?); {needs} need torch with "
              "CUDA. Nothing was measured.", file=sys.stderr)
        return None
    return torch


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
