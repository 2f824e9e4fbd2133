"""Prefill measured on one GPU: every kgen prefill path, FlashInfer's batch prefill (one row per
backend) over the very same pages and causal torch SDPA on K/V gathered from them, at the shapes of
kgen.perf.prefill_model.SHAPES (benchmarks/gpu_prefill.py's module docstring says how each figure is
taken)."""

from __future__ import annotations

import argparse
import importlib
import math
import time

import numpy as np

from kgen.bench.timing import build_each, random_tensor, time_per_call, torch_dtype
from kgen.families.attention.prefill import PATHS
from kgen.families.registry import family_for
from kgen.formats.cache import cache_shapes, scale_shape
from kgen.formats.dtypes import dtype
from kgen.perf import prefill_model as pf
from kgen.perf.prefill_model import SHAPES, mixed_parts, mixed_shape
from kgen.spec.models import load_spec

PEAK = pf.DENSE_PEAK["sm_90"]
ROTATE_BYTES = 4   # rotate inputs until the working set is this many times the L2
MAX_ROTATE = 64
KV_SCALE = 0.5     # every KV head's dequantization scale (one value: FlashInfer's fa2/fa3 take a scalar)
# a family parameter whose name has one of these selects the tensor-core path (mma.sync, wgmma, ...)
PATH_WORDS = ("path", "wgmma", "hopper", "mma", "engine")


# ---- shapes -------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """'512@512,8x256@4096+56x1@4096' -> [('512@512', [(512, 512)]), ('8x256@4096+56x1@4096', [...])]:
    comma-separated shapes, each '+'-joined terms [Nx]Q_LEN@KV_LEN (KV_LEN counts the chunk itself)."""
    shapes = []
    for item in text.split(","):
        item, seqs = item.strip(), []
        for term in item.split("+"):
            count, _, rest = term.strip().rpartition("x")
            q, sep, kv = rest.partition("@")
            ok = sep and q.isdigit() and kv.isdigit() and (not count or count.isdigit())
            if not ok or int(q) < 1 or int(kv) < int(q) or (count and int(count) < 1):
                raise argparse.ArgumentTypeError(f"bad shape {item!r}: expected [Nx]Q_LEN@KV_LEN terms joined by "
                                                 "'+', with 1 <= Q_LEN <= KV_LEN, e.g. 8x256@4096+56x1@4096")
            seqs += [(int(q), int(kv))] * int(count or 1)
        shapes.append((item, seqs))
    return shapes


# small shapes for the CPU dry runs (the pipeline's plumbing and agreement with SDPA, no figures)
DRY_RUN_SHAPES = parse_shapes("64@64,16@100,2x16@64+3x1@64")


def default_shapes() -> list[tuple[str, list[tuple[int, int]]]]:
    """static_prefill's shapes, then each part of its mixed batch alone (the mixed goal, measured)."""
    mixed_label, mixed = mixed_shape()
    parts = [(f"{mixed_label} part: {len(p)}x{p[0][0]}", p) for p in mixed_parts(mixed)]
    return [*SHAPES, *parts]


def retargeted(paths, gqa: list[int], arch: str) -> list:
    """The specs at `paths`, one per query-heads-per-KV-head group in `gqa`, each retargeted to `arch`
    alone (the device's): an arch-specific body (the Hopper prefill path, sm_90 only) is then among
    the paths a spec that also targets sm_80 builds."""
    return [with_gqa(load_spec(p), g).with_overrides(targets=[arch]) for p in paths for g in gqa]


def flop(seqs: list[tuple[int, int]], spec) -> float:
    """The causal FLOP the static model divides by (no window: these specs have none)."""
    a = spec.attention
    return pf.causal_flop(seqs, a.head_dim, a.num_q_heads, a.sliding_window or 0)


def with_gqa(spec, group: int):
    """The spec with group x num_kv_heads query heads (the GQA 8 rows: Llama-3-70B's 64 / 8)."""
    heads = group * spec.attention.num_kv_heads
    return spec if heads == spec.attention.num_q_heads else spec.with_overrides(**{"attention.num_q_heads": heads})


# ---- kgen's paths -----------------------------------------------------------------------------------
def prefill_paths(spec) -> list[tuple[str, dict | None]]:
    """(path name, config) per kgen path to time: each value of a family parameter that selects the
    tensor-core path (its name has one of PATH_WORDS; values from the family's default tuning space,
    else 0 and 1), or the default config when the family has none."""
    family = family_for(spec)
    space = family.default_space(spec) if hasattr(family, "default_space") else {}
    found = [p for p in getattr(family, "params", {}) if any(w in p for w in PATH_WORDS)]
    if not found:
        return [("default config", None)]
    return [(path_label(p, v), {p: v}) for p in found for v in sorted(set(space.get(p) or path_values(p)))]


def path_values(param: str):
    """The values of a path parameter to time: the prefill family's `path` names its bodies
    (prefill.PATHS: 0 auto, then mma.sync and the Hopper wgmma path), each body once; others 0 and 1."""
    return range(1, len(PATHS)) if param == "path" else (0, 1)


def path_label(param: str, value: int) -> str:
    return f"path={PATHS[value]}" if param == "path" and value in range(len(PATHS)) else f"{param}={value}"


def build_paths(spec, args, device: str) -> list[tuple[str, object]]:
    """(path name, built kernel) per path; a path that does not build is reported and left out."""
    return build_each(spec, prefill_paths(spec), not args.no_verify, device)


# ---- inputs -------------------------------------------------------------------------------------------
def prefill_inputs(torch, spec, seqs: list[tuple[int, int]], sets: int, gen) -> dict:
    """`sets` independent (q, cache pool) pairs under one shuffled block table, and the lengths: q
    [num_q_tokens, num_q_heads, head_dim] packed by sequence, seq_lens counting each chunk."""
    a, B = spec.attention, spec.kv_cache.block_size
    device = gen.device
    widths = [-(-kv // B) for _, kv in seqs]
    nblocks = sum(widths)
    order = torch.randperm(nblocks, device=device, generator=gen).to(torch.int32)
    table = torch.zeros((len(seqs), max(widths)), dtype=torch.int32, device=device)
    start = 0
    for s, w in enumerate(widths):
        table[s, :w] = order[start:start + w]
        start += w
    tokens = sum(q for q, _ in seqs)
    per_set = []
    for _ in range(sets):
        one = {n: random_tensor(torch, shape, spec.kv_cache.dtype, gen) for n, shape in cache_shapes(spec, nblocks).items()}
        shape = scale_shape(spec, nblocks)
        if shape is not None:
            one["k_scale"] = torch.full(shape, KV_SCALE, dtype=torch.float32, device=device)
            one["v_scale"] = torch.full(shape, KV_SCALE, dtype=torch.float32, device=device)
        one["q"] = random_tensor(torch, (tokens, a.num_q_heads, a.head_dim), spec.dtype.q, gen)
        per_set.append(one)
    common = {
        "block_tables": table,
        "seq_lens": torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device=device),
        "q_indptr": torch.tensor(np.concatenate([[0], np.cumsum([q for q, _ in seqs])]), dtype=torch.int32,
                                 device=device),
        "out": torch.empty((tokens, a.num_q_heads, spec.v_head_dim_value), device=device,
                           dtype=torch_dtype(torch, spec.dtype.resolved_out)),
    }
    return {"sets": per_set, "common": common, "seqs": seqs, "widths": widths}


def set_bytes(spec, seqs: list[tuple[int, int]]) -> int:
    """Bytes of one (q, cache pool) set: the rotation's unit."""
    a, kv = spec.attention, spec.kv_cache
    tokens = sum(-(-k // kv.block_size) for _, k in seqs) * kv.block_size
    pool = tokens * a.num_kv_heads * dtype(kv.dtype).bytes_for(a.head_dim + spec.v_head_dim_value)
    return pool + sum(q for q, _ in seqs) * a.num_q_heads * dtype(spec.dtype.q).bytes_for(a.head_dim)


# ---- the three callers --------------------------------------------------------------------------------
def kgen_caller(kern, inputs: dict, sms: int):
    """call(i) for kern over input set i; the plan is made here, outside the timed loop."""
    common = inputs["common"]
    plan = kern.plan(common["seq_lens"].cpu().numpy(), q_indptr=common["q_indptr"].cpu().numpy(), num_sms=sms)
    grid = " + ".join(str(int(np.prod(ln.grid))) for ln in plan.launches)
    return (lambda i: kern(**inputs["sets"][i], **common, plan=plan)), grid


def gathered_kv(torch, spec, one: dict, table, seq: int, kv_len: int, width: int):
    """K and V of one sequence as [num_q_heads, kv_len, head_dim] fp16/bf16 (dequantized, heads
    repeated for GQA: query head h reads KV head h // group)."""
    a, out = spec.attention, []
    q_type = torch_dtype(torch, spec.dtype.q)
    for name, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        blocks = one[name][table[seq, :width].long()]
        if spec.kv_cache.resolved_order == "HND":  # [blocks, heads, tokens, dim] -> tokens before heads
            blocks = blocks.transpose(1, 2)
        rows = blocks.reshape(-1, a.num_kv_heads, a.head_dim)[:kv_len]
        x = rows.to(q_type)
        if scale in one:
            x = (x.float() * one[scale].view(1, -1, 1)).to(q_type)
        out.append(x.transpose(0, 1).repeat_interleave(spec.group_size, dim=0))
    return out


def sdpa_caller(torch, spec, inputs: dict):
    """call(i) -> [num_q_tokens, num_q_heads, head_dim] by torch SDPA, one call per run of sequences
    with the same (q_len, kv_len): causal, the last q_len of kv_len positions (the mask's diagonal at
    kv_len - q_len), on K/V gathered here, outside the timed loop."""
    import torch.nn.functional as F

    seqs, common = inputs["seqs"], inputs["common"]
    indptr = common["q_indptr"].tolist()
    runs: list[tuple[int, int, list[int]]] = []
    for s, (q, kv) in enumerate(seqs):
        if runs and runs[-1][:2] == (q, kv) and runs[-1][2][-1] == s - 1:
            runs[-1][2].append(s)
        else:
            runs.append((q, kv, [s]))
    prepared = []  # per set: per run (k, v, mask or None, causal flag)
    for one in inputs["sets"]:
        per_run = []
        for q, kv, members in runs:
            kvs = [gathered_kv(torch, spec, one, common["block_tables"], s, kv, inputs["widths"][s]) for s in members]
            k, v = torch.stack([x[0] for x in kvs]), torch.stack([x[1] for x in kvs])
            mask = None
            if 1 < q < kv:
                mask = torch.ones((q, kv), dtype=torch.bool, device=k.device).tril(diagonal=kv - q)
            per_run.append((k, v, mask, q == kv and q > 1))
        prepared.append(per_run)
    scale = spec.softmax_scale_value

    def call(i: int):
        outs = []
        q_all = inputs["sets"][i]["q"]
        for (q, _, members), (k, v, mask, causal) in zip(runs, prepared[i], strict=True):
            first = indptr[members[0]]
            qs = q_all[first:first + q * len(members)].view(len(members), q, *q_all.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, is_causal=causal, scale=scale)
            outs.append(o.transpose(1, 2).reshape(-1, *q_all.shape[1:]))
        return torch.cat(outs)

    return call


def flashinfer_caller(torch, spec, inputs: dict, backend: str):
    """FlashInfer's batch prefill wrapper (this backend) over the same pages, planned once, or (None, why)."""
    try:
        flashinfer = importlib.import_module("flashinfer")  # optional: timed only where it is installed
    except Exception as e:  # ImportError, or a wheel that does not load on this machine
        return None, f"not importable ({type(e).__name__}: {e})"[:120]
    a, B = spec.attention, spec.kv_cache.block_size
    common, seqs, widths = inputs["common"], inputs["seqs"], inputs["widths"]
    dev = common["block_tables"].device
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout=spec.kv_cache.resolved_order,
                                                             backend=backend)
    indices = torch.cat([common["block_tables"][s, :w] for s, w in enumerate(widths)])
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(widths)]), dtype=torch.int32, device=dev)
    last = torch.tensor([kv - (w - 1) * B for (_, kv), w in zip(seqs, widths, strict=True)], dtype=torch.int32,
                        device=dev)
    one = inputs["sets"][0]
    wrapper.plan(common["q_indptr"], kv_indptr, indices, last, a.num_q_heads, a.num_kv_heads, a.head_dim, B,
                 causal=True, q_data_type=one["q"].dtype, kv_data_type=one["k_cache"].dtype,
                 sm_scale=spec.softmax_scale_value)
    out = torch.empty_like(common["out"])
    scales = {"k_scale": KV_SCALE, "v_scale": KV_SCALE} if "k_scale" in one else {}

    def call(i: int):
        s = inputs["sets"][i]
        return wrapper.run(s["q"], (s["k_cache"], s["v_cache"]), out=out, **scales)

    return call, None


# ---- one spec -------------------------------------------------------------------------------------------
def measure_shape(torch, spec, label, seqs, kerns, args, sms: int, l2: int, device: str) -> list[dict]:
    """One row per kgen path at this shape, each with the same SDPA and FlashInfer times."""
    sets = 1 if device == "cpu" else max(1, min(MAX_ROTATE, math.ceil(ROTATE_BYTES * l2 / set_bytes(spec, seqs))))
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    inputs = prefill_inputs(torch, spec, seqs, sets, gen)
    budget = args.budget_ms / 1e3
    base = {"spec": spec.name, "gqa": spec.group_size, "shape": label, "seqs": len(seqs),
            "q_tokens": sum(q for q, _ in seqs), "flop": flop(seqs, spec), "sets": sets}

    def timed(call) -> float:
        return time_per_call(torch, call, sets, budget, device, min_calls=1, samples=3)[0]

    rows, outs = [], {}
    for name, kern in kerns:
        row = dict(base, path=name)
        try:
            call, row["grid"] = kgen_caller(kern, inputs, sms)
            row["kgen_s"] = timed(call)
            inputs["common"]["out"].fill_(float("nan"))  # poison: the checked output must be written
            call(0)
            outs[name] = inputs["common"]["out"].float().clone()
        except Exception as e:  # one failing path must not lose the others' figures
            row["skipped"] = f"kgen failed: {type(e).__name__}: {e}"[:200]
        rows.append(row)
    anchors: dict = {}
    try:
        sdpa = sdpa_caller(torch, spec, inputs)
        anchors["sdpa_s"] = timed(sdpa)
        ref = sdpa(0).float()
        for row in rows:
            if row["path"] in outs:
                row["max_abs_kgen_vs_sdpa"] = float((outs[row["path"]] - ref).abs().max())
        del sdpa, ref
    except Exception as e:
        anchors["sdpa"] = f"failed: {type(e).__name__}: {e}"[:160]
    if not args.no_flashinfer and device == "cuda":
        for backend in filter(None, args.flashinfer_backends.split(",")):
            try:
                fi, why = flashinfer_caller(torch, spec, inputs, backend)
                anchors[f"flashinfer_{backend}_s" if fi else f"flashinfer_{backend}"] = timed(fi) if fi else why
            except Exception as e:  # e.g. a backend without this KV dtype
                anchors[f"flashinfer_{backend}"] = f"failed: {type(e).__name__}: {e}"[:160]
    for row in rows:
        row.update(anchors)
    return rows


def run_spec(torch, spec, shapes, args, sms: int, l2: int, started: float, device: str = "cuda",
             kerns: list | None = None) -> list[dict]:
    """Rows of measure_shape for each shape until `args.max_minutes` after `started`. `kerns`:
    build_paths's kernels, when already built."""
    kerns = build_paths(spec, args, device) if kerns is None else kerns
    rows = []
    for label, seqs in shapes:
        if time.perf_counter() - started > args.max_minutes * 60:
            rows.append({"spec": spec.name, "gqa": spec.group_size, "shape": label, "path": "all",
                         "skipped": f"the --max-minutes {args.max_minutes:g} budget is spent"})
            continue
        new = measure_shape(torch, spec, label, seqs, kerns, args, sms, l2, device)
        for r in new:
            if "kgen_s" in r:
                print(f"  {spec.name} GQA {r['gqa']} {label} [{r['path']}]: kgen {r['kgen_s'] * 1e6:.1f} us, "
                      f"{r['flop'] / r['kgen_s'] / 1e12:.1f} TFLOP/s", flush=True)
        rows += new
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- output -------------------------------------------------------------------------------------------
def ratio(r: dict, key: str) -> str:
    t = r.get(f"{key}_s")
    return f"{t * 1e6:.1f} us, {t / r['kgen_s']:.2f}x" if t else str(r.get(key, "n/a"))[:60]


def table(rows: list[dict], backends: list[str]) -> str:
    head = ["spec", "GQA", "kgen path", "shape", "kgen us", "TFLOP/s", "of peak",
            *(f"FlashInfer {b} (FI/kgen)" for b in backends), "SDPA (SDPA/kgen)", "max|kgen-SDPA|"]
    out = []
    for r in rows:
        if "kgen_s" not in r:
            out.append([r["spec"], r["gqa"], r["path"], r["shape"], "skipped: " + r.get("skipped", "?"),
                        *[""] * (len(head) - 5)])
            continue
        t = r["kgen_s"]
        out.append([r["spec"], r["gqa"], r["path"], r["shape"], f"{t * 1e6:.1f}", f"{r['flop'] / t / 1e12:.1f}",
                    f"{r['flop'] / t / PEAK:.1%}", *(ratio(r, f"flashinfer_{b}") for b in backends),
                    ratio(r, "sdpa"),
                    f"{r['max_abs_kgen_vs_sdpa']:.2e}" if "max_abs_kgen_vs_sdpa" in r else "n/a"])
    widths = [max(len(str(x[i])) for x in [head, *out]) for i in range(len(head))]
    fmt = lambda x: "| " + " | ".join(str(c).ljust(w) for c, w in zip(x, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, out)])


def mixed_lines(rows: list[dict], shapes) -> list[str]:
    """The mixed batch's measured time over the sum of its parts' (issue 22's mixed goal: <= 1.10)."""
    labels = [label for label, _ in shapes]
    mixed = mixed_shape()[0]
    parts = [label for label in labels if label.startswith(f"{mixed} part: ")]
    if mixed not in labels or not parts:
        return []
    times = {(r["spec"], r["gqa"], r["path"], r["shape"]): r["kgen_s"] for r in rows if "kgen_s" in r}
    lines = []
    for spec, gqa, path, shape in sorted(times):
        if shape != mixed or any((spec, gqa, path, p) not in times for p in parts):
            continue
        alone = sum(times[spec, gqa, path, p] for p in parts)
        x = times[spec, gqa, path, mixed] / alone
        lines.append(f"mixed / parts alone, {spec} GQA {gqa} [{path}]: {times[spec, gqa, path, mixed] * 1e6:.1f} us / "
                     f"{alone * 1e6:.1f} us = {x:.2f}x ({'met' if x <= 1.10 else 'MISSED'}: <= 1.10x)")
    return lines

