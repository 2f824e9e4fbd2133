"""Instruction issue of kgen's decode main loop, counted in sm_90 SASS (no GPU needed).

For every bundled decode spec (specs/*.yaml of kind paged_decode, default config) the kernel is
rendered, compiled for sm_90 with NVRTC (kgen.compile.nvrtc.compile_cubin), disassembled with
cuobjdump, and its main loop (the tile loop: kgen.perf.model.streaming_loops, the loop that issues
the cache copies) is counted:

- instrs/iter: SASS instructions of one tile iteration, counted statically over the loop body
  (every instruction once, whichever branch it sits on); a loop nested in it (the batch loop) is
  weighted by its trip count, tokens per thread and tile / batch tokens, from the geometry.
- B/thread/iter: cache bytes each thread moves per tile iteration: the geometry's tile bytes
  (K rows, V rows, per-token scales) / threads. Block-table reads are not counted as K/V bytes
  (the SASS global-load bytes of the loop, which count them, are shown as `ld B`).
- warp-instr/B = instrs/iter / (B/thread/iter x 32): one warp-instruction issues for 32 threads,
  which move 32 x B/thread/iter bytes. H200 at full bandwidth issues ~0.24 warp-instructions
  per byte at most (132 SMs x 4 schedulers x ~1.98 GHz / 4.8 TB/s ~ 0.22-0.24).
- by class (per iteration): cvt (F2F, F2FP, HADD2.F32, PRMT, I2F), fma (FFMA, FMUL, FADD, HFMA2),
  addr (IADD3, IMAD, LEA, SHF, IADD), shfl (SHFL), lds (LDS), ldgsts (LDGSTS), other.
  int8's widening FADD (the 2^23 + 128 subtraction) counts as fma here.
- regs / spills: ptxas figures of the main kernel on sm_90.

    PYTHONPATH=. python benchmarks/decode_instructions.py [--json] [specs/x.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import kgen
from kgen.compile.nvrtc import compile_cubin
from kgen.families.attention.decode_geometry import decode_geometry
from kgen.families.base import PerfModel
from kgen.families.registry import family_for
from kgen.perf import model as pm
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.render import render

ROOT = Path(__file__).resolve().parents[1]

ARCH = "sm_90"
CLASSES = ("cvt", "fma", "addr", "shfl", "lds", "ldgsts", "other")


def classify(ins: pm.Instr) -> str:
    base, mods = ins.base, ins.mods
    if base in ("F2F", "F2FP", "PRMT", "I2F", "I2FP") or (base == "HADD2" and "F32" in mods):
        return "cvt"
    if base in ("FFMA", "FMUL", "FADD", "HFMA2"):
        return "fma"
    if base in ("IADD3", "IMAD", "LEA", "SHF", "IADD", "IADD32I"):
        return "addr"
    if base == "SHFL":
        return "shfl"
    if base == "LDS":
        return "lds"
    if base == "LDGSTS":
        return "ldgsts"
    return "other"


def measure(path: Path, cuobjdump: str) -> dict:
    spec = kgen.load_spec(path)
    rendered = render(spec)
    geo, _ = decode_geometry(spec, rendered.config)
    art = compile_cubin(rendered.source, ARCH)
    fn = pm.parse_sass(sass_text(art.cubin, cuobjdump))[spec.name]
    (loop, ld_bytes), *_ = pm.streaming_loops(fn)
    inner = [lp for lp in pm.loops(fn) if loop.contains(lp) and lp != loop]
    trips = geo.tokens_per_thread // geo.batch_tokens
    weight = [1] * (loop.end - loop.start + 1)
    for lp in inner:  # a nested loop: the batch loop, trips times per tile
        for i in range(lp.start, lp.end + 1):
            weight[i - loop.start] = trips
    counts: Counter = Counter()
    for w, ins in zip(weight, fn.instrs[loop.start:loop.end + 1], strict=True):
        counts[classify(ins)] += w
    instrs = sum(counts.values())
    nbytes = geo.tile_bytes / geo.threads
    res = art.resources[spec.name]
    return {
        "spec": spec.name, "kv": spec.kv_cache.dtype, "gqa": spec.group_size, "head_dim": spec.attention.head_dim,
        "heads_per_thread": geo.heads_per_thread, "lanes": geo.lanes, "token_slots": geo.token_slots,
        "tile_tokens": geo.tile_tokens, "batch_tokens": geo.batch_tokens, "inner_loops": len(inner),
        "instrs_per_iter": instrs, "bytes_per_thread_per_iter": nbytes, "sass_load_bytes": ld_bytes,
        "warp_instr_per_byte": instrs / (nbytes * 32), "classes": {c: counts[c] for c in CLASSES},
        "registers": res.registers, "spill_bytes": res.spill_stores + res.spill_loads,
        "stack": res.stack_frame,
    }


def markdown(rows: list[dict]) -> str:
    head = ("| spec | kv | GQA | hpt | instrs/iter | B/thread/iter | ld B | warp-instr/B | "
            + " | ".join(CLASSES) + " | regs | spills |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['kv']} | {r['gqa']} | {r['heads_per_thread']} | {r['instrs_per_iter']} | "
                     f"{r['bytes_per_thread_per_iter']:g} | {r['sass_load_bytes']} | {r['warp_instr_per_byte']:.3f} | "
                     + " | ".join(str(r["classes"][c]) for c in CLASSES)
                     + f" | {r['registers']} | {r['spill_bytes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a markdown table")
    args = ap.parse_args(argv)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    paths = [Path(p) for p in args.specs] or sorted((ROOT / "specs").glob("*.yaml"))
    # the paged decode kernels (their DecodeGeometry): the family says so, not the kind
    rows = [measure(p, cuobjdump) for p in paths
            if family_for(kgen.load_spec(p)).perf_model is PerfModel.STREAMING]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
