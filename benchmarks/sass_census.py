"""Registers, spills and SASS instruction counts of every bundled spec's main kernel (no GPU needed).

For each specs/*.yaml and each arch of `--arch` (default sm_80 and sm_90) that the spec can target,
the spec's default config is rendered for that arch (the arch's own body: kgen.bodies), compiled with
NVRTC and disassembled with cuobjdump. Per main kernel (the first kernel the family declares):

- regs / spill: ptxas's registers and spill stores + loads (bytes);
- sass: SASS instructions of the whole kernel;
- loop: SASS instructions of its main loop, the loop that streams the most global memory
  (kgen.perf.model.streaming_loops; every instruction counted once), and `ld B`, the global bytes
  one thread loads in one iteration of it (cp.async and plain loads): loop / ld B is the loop's
  instructions per K/V byte a thread moves (block-table reads included).

Used to compare two trees (a refactor's "no worse" check): run it in each and diff the tables.

    PYTHONPATH=. python benchmarks/sass_census.py [--arch sm_90 ...] [--json] [specs/x.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kgen
from kgen.bodies import arch_number
from kgen.compile.nvrtc import compile_cubin
from kgen.families.registry import family_for
from kgen.perf import model as pm
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.render import render

ROOT = Path(__file__).resolve().parents[1]


def measure(path: Path, arch: str, cuobjdump: str) -> dict:
    spec = kgen.load_spec(path)
    if min(arch_number(a) for a in spec.targets) > arch_number(arch):
        return {"spec": path.stem, "arch": arch, "skipped": f"targets {list(spec.targets)}"}
    spec = spec.model_copy(update={"targets": [arch]})
    spec._source_path = path
    rendered = render(spec, arch=arch)
    main = family_for(spec).kernels(spec, rendered.config)[0].name
    art = compile_cubin(rendered.source, arch)
    res = art.resources[main]
    fn = pm.parse_sass(sass_text(art.cubin, cuobjdump))[main]
    streaming = pm.streaming_loops(fn)
    loop_instrs, ld_bytes = 0, 0
    if streaming:
        (loop, ld_bytes), *_ = streaming
        loop_instrs = loop.end - loop.start + 1
    return {"spec": path.stem, "arch": arch, "kernel": main, "regs": res.registers,
            "spill": res.spill_stores + res.spill_loads, "sass": len(fn.instrs), "loop": loop_instrs,
            "ld_bytes": ld_bytes, "per_byte": round(loop_instrs / ld_bytes, 3) if ld_bytes else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", type=Path)
    ap.add_argument("--arch", action="append", help="sm_80, sm_90 (default both)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cuobjdump = find_cuobjdump()
    specs = args.specs or sorted((ROOT / "specs").glob("*.yaml"))
    rows = [measure(p, a, cuobjdump) for p in specs for a in (args.arch or ["sm_80", "sm_90"])]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'spec':34} {'arch':6} {'regs':>4} {'spill':>5} {'sass':>6} {'loop':>5} {'ld B':>5} {'loop/B':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['spec']:34} {r['arch']:6} skipped ({r['skipped']})")
            continue
        per = "-" if r["per_byte"] is None else f"{r['per_byte']:.3f}"
        print(f"{r['spec']:34} {r['arch']:6} {r['regs']:>4} {r['spill']:>5} {r['sass']:>6} {r['loop']:>5} "
              f"{r['ld_bytes']:>5} {per:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
