"""Build-time figures of the core pipeline (issue 2), printed as a table.

  cold build  : render + NVRTC for each target arch, empty artifact cache (median of N)
  warm build  : the same with the cache populated (render + cache lookups)
  nvcc anchor : `nvcc -cubin -arch=sm_90` on the same generated source (ratio anchor)
  import      : `from generated.<name> import kernel` in a fresh Python process
  first call  : import + the first call on the CPU backend (g++ artifact cached)
and ptxas registers / spills on sm_90 for every spec shipped in specs/.

Run: PYTHONPATH=. .venv/bin/python benchmarks/build_time.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kgen.build import compile_cubins
from kgen.cache import ArtifactCache
from kgen.compile.cuda_headers import cuda_include_dir
from kgen.compile.provided import kgen_headers
from kgen.render import render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[1]

SPEC = ROOT / "specs" / "llama3_8b_decode.yaml"


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:9.1f} ms (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    spec = load_spec(SPEC)
    archs = list(spec.targets)

    def cold():
        with tempfile.TemporaryDirectory() as d:
            compile_cubins(spec, render(spec), cache=ArtifactCache(d))

    warm_cache = ArtifactCache(tempfile.mkdtemp())
    compile_cubins(spec, render(spec), cache=warm_cache)

    def warm():
        compile_cubins(spec, render(spec), cache=warm_cache)

    cold_t = timed(cold, args.reps)
    warm_t = timed(warm, args.reps * 4)

    src_dir = Path(tempfile.mkdtemp())
    (src_dir / "kernel.cu").write_text(render(spec).source)
    for name, text in kgen_headers().items():  # kgen's provided headers, where nvcc's -I finds them
        (src_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (src_dir / name).write_text(text)
    nvcc = shutil.which("nvcc")
    nvcc_t: list[float] = []
    if nvcc:
        cmd = [nvcc, "-cubin", "-arch=sm_90", "-std=c++17", f"-I{cuda_include_dir()}", f"-I{src_dir}", "-o",
               str(src_dir / "k.cubin"), str(src_dir / "kernel.cu")]
        nvcc_t = timed(lambda: subprocess.run(cmd, check=True, capture_output=True), args.reps)

    # generated module: build once, then import it in fresh processes
    gen = Path(tempfile.mkdtemp())
    env = dict(os.environ, PYTHONPATH=f"{gen}{os.pathsep}{ROOT}")
    subprocess.run([sys.executable, "-m", "kgen.cli", "build", str(SPEC), "-o", str(gen / "generated"),
                    "--backend", "cpu", "--seed", "1"], check=True, env=env, capture_output=True)
    imp = "import time; t=time.perf_counter(); from generated.llama3_8b_decode import kernel; " \
          "print(time.perf_counter()-t)"
    first = ("import time; t=time.perf_counter(); from generated.llama3_8b_decode import kernel; "
             "import numpy as np; from kgen.families.attention.decode_cases import make_decode_case; "
             "a=make_decode_case(kernel.spec,[17],np.random.default_rng(0)); kernel(**a); "
             "print(time.perf_counter()-t)")
    import_t = [float(subprocess.run([sys.executable, "-c", imp], env=env, cwd=gen, capture_output=True,
                                     text=True, check=True).stdout) for _ in range(args.reps)]
    first_t = [float(subprocess.run([sys.executable, "-c", first], env=env, cwd=gen, capture_output=True,
                                    text=True, check=True).stdout) for _ in range(args.reps)]

    per_arch_cold = statistics.median(cold_t) / len(archs)
    print(f"spec {SPEC.name}, archs {archs}, {args.reps} reps")
    print(f"{'cold build (render + NVRTC, all archs)':45s} {fmt(cold_t)}  = {per_arch_cold * 1e3:.1f} ms per arch")
    print(f"{'warm build (cache hit, all archs)':45s} {fmt(warm_t)}")
    if nvcc_t:
        print(f"{'nvcc -cubin -arch=sm_90 (one arch)':45s} {fmt(nvcc_t)}")
        print(f"{'ratio nvcc / NVRTC cold, per arch':45s} {statistics.median(nvcc_t) / per_arch_cold:9.1f}x")
    print(f"{'import generated module (fresh process)':45s} {fmt(import_t)}")
    print(f"{'import + first call, CPU backend (cached)':45s} {fmt(first_t)}")
    print()
    print(f"{'shipped spec':34s} {'kernel':36s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s}")
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        s = load_spec(path)
        if "sm_90" not in s.targets:
            continue
        try:
            arts = compile_cubins(s, render(s), ["sm_90"])
        except Exception as e:  # a family not generated yet: say so, keep the table going
            print(f"{path.name:34s} (not built: {str(e).splitlines()[0]})")
            continue
        for name, r in arts["sm_90"].resources.items():
            print(f"{path.name:34s} {name:36s} {r.registers:5d} {r.spill_stores:5d}/{r.spill_loads:<6d} "
                  f"{r.stack_frame:6d}")


if __name__ == "__main__":
    main()
