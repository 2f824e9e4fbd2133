"""Where a build of the Llama-3-8B decode spec spends its time (docs/pipeline.md, "Measured figures").

    PYTHONPATH=. python benchmarks/build_profile.py [--rounds 5] [--rev REV ...]

Warm: each step of a warm `compile_cubins(spec, render(spec))` alone (best of 50 calls, wall time).
Cold: NVRTC's CPU time (this process's, so other programs on a busy machine count little) for the sm_90
body's source, best of `--rounds`, rounds interleaved: as built (the thin source plus kgen's provided
headers, resolved by NVRTC from its header list) and with every provided header pasted in where it is
included (one self-contained text: what header delivery itself costs), for compute_90 (the front end
alone: no ptxas), sm_90 and sm_80. Each `--rev` adds the source a past tree renders (its kgen run from a
`git archive` of it), as that tree built it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from benchmarks.build_time import timed
from kgen.build import compile_cubins
from kgen.cache import ArtifactCache
from kgen.compile import nvrtc
from kgen.compile.cuda_headers import (
    cuda_include_dir,
    cuda_include_dirs,
    headers_fingerprint,
)
from kgen.compile.provided import kgen_headers, kgen_headers_digest
from kgen.render import render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = "specs/llama3_8b_decode.yaml"
MODES = ("compute_90", "sm_90", "sm_80")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
# Run by a past tree's own Python (its kgen): the sm_90 body's source and its provided headers.
_DUMP = r"""
import json, sys
from kgen.render import render
try:
    from kgen.spec.models import load_spec
except ImportError:
    from kgen.spec import load_spec
spec = load_spec(sys.argv[1])
try:
    source = render(spec, None, "sm_90").source
except TypeError:  # a tree from before per-arch bodies
    source = render(spec).source
try:
    from kgen.compile.provided import kgen_headers
    headers = kgen_headers()
except ImportError:  # a tree from before provided headers
    headers = {}
print(json.dumps({"source": source, "headers": headers}))
"""


def best(fn, n: int = 50) -> float:
    fn()  # warm: the first call fills the caches the timed calls hit
    return min(timed(fn, n))


def warm_steps() -> list[tuple[str, float]]:
    spec = load_spec(ROOT / SPEC)
    cache = ArtifactCache(tempfile.mkdtemp())
    rendered = render(spec)
    compile_cubins(spec, rendered, cache=cache)
    include = cuda_include_dir()
    return [("warm compile_cubins(spec, render(spec)), both archs", best(lambda: compile_cubins(spec, render(spec),
                                                                                             cache=cache))),
            ("  render, newest arch (sm_90)", best(lambda: render(spec))),
            ("  render, sm_80 (compile_cubins renders the other arch's body)",
             best(lambda: render(spec, rendered.config, "sm_80"))),
            ("  compile_cubin, cache hit, one arch", best(lambda: nvrtc.compile_cubin(rendered.source, "sm_90",
                                                                                     cache=cache))),
            ("    kgen_headers_digest()", best(kgen_headers_digest)),
            ("    headers_fingerprint(CUDA include)", best(lambda: headers_fingerprint(include)))]


def pasted(source: str, headers: dict[str, str]) -> str:
    """`source` with each provided header pasted in where it is first included (#pragma once)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def one(m: re.Match) -> str:
            name = m.group(1)
            if name not in headers:
                return m.group(0)
            if name in seen:
                return ""
            seen.add(name)
            return expand(headers[name].replace("#pragma once", ""))
        return _INCLUDE.sub(one, text)
    return expand(source)


def nvrtc_cpu_seconds(source: str, headers: dict[str, str], arch: str) -> float:
    """CPU time of one nvrtcCompileProgram of `source` (kgen's options) with `headers` as its header list."""
    lib = nvrtc._library()
    prog = nvrtc._Program()
    texts = (ctypes.c_char_p * len(headers))(*(v.encode() for v in headers.values()))
    names = (ctypes.c_char_p * len(headers))(*(k.encode() for k in headers))
    nvrtc._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", len(headers), texts,
                                        names), "createProgram")
    opts = [f"-arch={arch}", *(o for o in nvrtc.BASE_OPTIONS if arch.startswith("sm_") or "ptxas" not in o),
            *(f"-I{d}" for d in cuda_include_dirs())]
    try:
        t = time.process_time()
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts)))
        spent = time.process_time() - t
        if status != 0:
            raise SystemExit(f"NVRTC failed ({arch}):\n{nvrtc._program_log(prog)[:2000]}")
        return spent
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def past_source(rev: str) -> tuple[str, dict[str, str]]:
    """The sm_90 body's source and provided headers that the tree at `rev` renders (its own kgen)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as d:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(d, filter="data")
        out = subprocess.run([sys.executable, "-c", _DUMP, str(Path(d) / SPEC)], cwd=d, env={"PYTHONPATH": d},
                             check=True, capture_output=True, text=True).stdout
    found = json.loads(out)
    return found["source"], found["headers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="cold compiles per variant and arch (best is shown)")
    ap.add_argument("--rev", action="append", default=[], help="also a past tree's source (git revision)")
    a = ap.parse_args()

    print("warm build steps (best of 50, wall ms)")
    for name, seconds in warm_steps():
        print(f"  {name:66s} {seconds * 1e3:7.3f}")

    spec = load_spec(ROOT / SPEC)
    source, headers = render(spec, None, "sm_90").source, kgen_headers()
    variants = {"this tree, as built": (source, headers),
                "this tree, provided headers pasted in": (pasted(source, headers), {})}
    for rev in a.rev:
        old, old_headers = past_source(rev)
        variants[f"{rev}, as built"] = (old, old_headers)
    print()
    for name, (text, hdr) in variants.items():
        flat = pasted(text, hdr)
        print(f"{name:40s} source {len(text):6d} B + {len(hdr):2d} provided headers; self-contained "
              f"{len(flat):6d} B, {flat.count(chr(10)):5d} lines")
    spent = {(v, m): float("inf") for v in variants for m in MODES}
    for _ in range(a.rounds):
        for m in MODES:
            for v, (text, hdr) in variants.items():
                spent[v, m] = min(spent[v, m], nvrtc_cpu_seconds(text, hdr, m))
    print(f"\nNVRTC CPU ms, best of {a.rounds} (compute_90: front end only)")
    print(f"  {'source':40s}" + "".join(f"{m:>12s}" for m in MODES))
    for v in variants:
        print(f"  {v:40s}" + "".join(f"{spent[v, m] * 1e3:12.0f}" for m in MODES))


if __name__ == "__main__":
    main()
