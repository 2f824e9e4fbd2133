"""Figures for the paged-decode example specs: ptxas registers/spills on sm_90 (and sm_80
where the spec targets it), the main loop's geometry (tile tokens, stages, K/V bytes each
thread has requested ahead while it computes a tile) and the KV bytes each decoded token reads.

KV bytes per token = num_kv_heads x (K + V row bytes) + the scale bytes that belong to the
token (per_token_head: one float32 each for K and V per KV head; per_tensor/per_head
scales are a few bytes per launch, shown as 0). The figure is computed from the spec and
cross-checked against the nbytes of ABI-shaped arrays that kgen.families.attention.decode_cases builds.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_figures.py [specs/decode_*.yaml ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import kgen
from kgen.bench.decode import kv_bytes_per_token
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.decode_geometry import decode_geometry
from kgen.families.base import PerfModel
from kgen.families.registry import family_for

ROOT = Path(__file__).resolve().parents[1]


def kv_bytes_from_arrays(spec) -> int:
    """Bytes per token slot of the arrays a call actually passes (pool + per-token scales)."""
    args = make_decode_case(spec, [spec.kv_cache.block_size], np.random.default_rng(0))
    slots = None
    total = 0
    for name in ("k_cache", "v_cache", "kv_cache"):
        if name in args:
            slots = args[name].shape[0] * spec.kv_cache.block_size
            total += args[name].nbytes
    if spec.kv_cache.scale == "per_token_head":
        total += args["k_scale"].nbytes + args["v_scale"].nbytes
    return total // slots


def main(paths: list[str]) -> int:
    paths = paths or sorted(str(p) for p in (ROOT / "specs").glob("*.yaml"))
    rows = []
    for p in paths:
        spec = kgen.load_spec(p)
        if family_for(spec).perf_model is not PerfModel.STREAMING:  # the paged decode kernels (DecodeGeometry)
            continue
        archs = sorted({"sm_90", *(a for a in spec.targets if a == "sm_80")})
        kernel = kgen.build(spec, backend="cpu", archs=archs, verify=False)
        res = {arch: kernel.resources[arch][spec.name] for arch in archs}
        geo, _ = decode_geometry(spec, kernel.config)
        per_tok = kv_bytes_per_token(spec)
        assert per_tok == kv_bytes_from_arrays(spec), spec.name
        per_head_fp16 = 2 * 2 * spec.attention.head_dim * spec.attention.num_kv_heads
        regs = " / ".join(str(res[a]["registers"]) for a in ("sm_90", "sm_80") if a in res)
        spills = sum(r["spill_stores"] + r["spill_loads"] + r["stack_frame"] for r in res.values())
        rows.append((spec.name, spec.kv_cache.dtype, spec.kv_cache.scale, spec.group_size,
                     kernel.config["partition_size"], regs, spills, geo.tile_tokens, geo.stages,
                     geo.bytes_in_flight, per_tok, per_tok / per_head_fp16))
    head = ("spec", "kv dtype", "scale", "GQA", "P", "regs sm_90 / sm_80", "spills+stack", "tile tokens", "stages",
            "B in flight/thread", "KV B/token", "vs fp16")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {' | '.join(str(x) for x in r[:9])} | {r[9]:.0f} | {r[10]} | {r[11]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
