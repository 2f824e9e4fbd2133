"""Decode measured on one GPU: kgen's decode paths, torch SDPA over the same K/V gathered contiguous,
and FlashInfer's batch decode over the very same paged cache, at the batch x context shapes of
kgen.perf.model.SHAPES (benchmarks/gpu_decode.py's module docstring says how each figure is taken)."""

from __future__ import annotations

import importlib
import math
import time

import numpy as np

from kgen.bench.timing import build_each, random_tensor, time_per_call, torch_dtype
from kgen.families.pool import pool_of
from kgen.families.registry import family_for
from kgen.formats.cache import CacheFormat, cache_shapes, scale_shape

ROTATE_BYTES = 4  # rotate inputs until the working set is this many times the L2
MAX_ROTATE = 256
FLOAT_CACHES = ("fp16", "bf16", "fp32")
MMA_PARAM = "mma_min_group"
# small shapes for the CPU dry runs (batch, context): the pipeline's plumbing, no figures
DRY_RUN_SHAPES = [(2, 40), (3, 100)]


def kv_bytes_per_token(spec) -> int:
    """Bytes of K and V (and per-token scales) one token of context costs a decode call to read: its pool
    format's (kgen/families/pool.py)."""
    return pool_of(spec).bytes_per_token()


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
    return (CacheFormat.of(spec).separate and kv.dtype in FLOAT_CACHES and kv.dtype == spec.dtype.q
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
        flashinfer = importlib.import_module("flashinfer")  # optional: timed only where it is installed
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


def decode_paths(spec) -> list[tuple[str, dict | None]]:
    """(path name, config) per decode path to time: the CUDA-core loop (`mma_min_group: 0`) and the
    tensor-core path (`mma_min_group: 1`) when the spec's family has that parameter, else the default."""
    if MMA_PARAM in getattr(family_for(spec), "params", {}):
        return [("CUDA cores (mma_min_group=0)", {MMA_PARAM: 0}), ("tensor cores (mma_min_group=1)", {MMA_PARAM: 1})]
    return [(f"default config (no {MMA_PARAM} in this kgen)", None)]


def build_paths(spec, args, device: str) -> list[tuple[str, object]]:
    """(path name, built kernel) per decode path; a path that does not build is reported and left out."""
    return build_each(spec, decode_paths(spec), not args.no_verify, device)


def run_spec(torch, spec, shapes, args, copy_bw: float, sms: int, l2: int, device: str = "cuda",
             kerns: list | None = None) -> list[dict]:
    """One row per (shape, decode path): every path timed on the same inputs, against the same SDPA and
    FlashInfer times (measured once per shape). `kerns`: build_paths's kernels, when already built."""
    import torch.nn.functional as F

    kerns = build_paths(spec, args, device) if kerns is None else kerns
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

