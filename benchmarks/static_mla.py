"""Static performance of MLA decode on sm_90, side by side (no GPU needed; ESTIMATES).

DeepSeek-V3's absorbed MLA decode (128 query heads on one latent KV head, rows of 576 = 512 latent + 64
rope, 512-wide output, bf16): kgen's kernel for specs/deepseek_v3_mla_decode.yaml (NVRTC; its sm_90 body,
the Hopper wgmma one, and the mma.sync body the older archs get), FlashInfer's
MLA kernel (flashinfer/attention/mla.cuh, BatchMLAPagedAttentionKernel: mma.sync and cp.async, the
FA2-style path its "fa2" backend runs on Hopper too) compiled with nvcc from the flashinfer-python
wheel's headers, and FlashMLA's sm90 decode kernel (wgmma and TMA) when a FlashMLA checkout is given
(built against the CUTLASS the flashinfer wheel carries).

Each kernel's main loop is read from the SASS (kgen/perf/prefill_model.py: tensor-core FLOP, warp-
instructions, smem wavefronts, FP32 and MUFU per iteration); its CTAs are laid out for each (batch,
context) and placed on the SMs by the same list scheduling as the prefill model. The tables give the
fraction of the copy bandwidth (latent bytes once from DRAM over the time) and of the dense bf16 tensor
peak (2 x 128 heads x (576 + 512) FLOP per key per query), with the binding term.

    pip install --no-deps flashinfer-python          # headers only: nothing of it is imported
    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    PYTHONPATH=. python benchmarks/static_mla.py [--flashmla-src DIR] [--doc docs/performance.md]

A missing tool, source or spec drops that row and says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.flashinfer_geometry import flashinfer_data
from benchmarks.nvcc import find_nvcc, nvcc_cubin
from benchmarks.tables import md_table, replace_between
from kgen.cache import ArtifactCache, content_key
from kgen.compile.nvrtc import compile_cubin, parse_ptxas_report
from kgen.families.attention.mla import decode_geometry, row_blocks
from kgen.families.registry import family_for
from kgen.perf import model as pm
from kgen.perf import prefill_model as pf
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.plan import target_blocks
from kgen.render import render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90"
DEV = dataclasses.replace(pm.H200, clock_hz=pf.TENSOR_CLOCK[ARCH])  # tensor-bound: the peak's clock
PIPES = pf.PIPES[ARCH]
PEAK = pf.DENSE_PEAK[ARCH]
DOC_BEGIN, DOC_END = "<!-- static_mla:begin -->", "<!-- static_mla:end -->"
SPEC = ROOT / "specs" / "deepseek_v3_mla_decode.yaml"

# DeepSeek-V3 MLA decode (one query token per sequence)
HEADS, D, DV, ITEM = 128, 576, 512, 2
BATCHES = (1, 16, 64, 128)
CONTEXTS = (1024, 4096, 32768)
# FlashMLA's README (deepseek-ai/FlashMLA, dense decoding): "up to 3000 GB/s in memory-bound configuration
# and 660 TFLOPS in computation-bound configuration on H800 SXM5 with CUDA 12.8".
FLASHMLA_PUBLISHED = "up to 3000 GB/s memory-bound and 660 TFLOPS compute-bound on H800 SXM5 (its README)"


def mla_flop(batch: int, context: int) -> float:
    """2 FLOP per multiply-add: S = q K^T over 576 and O = P V over 512, per head and key."""
    return 2.0 * batch * HEADS * context * (D + DV)


def latent_bytes(batch: int, context: int) -> float:
    """The latent rows each sequence reads once from DRAM (a second CTA on the same rows hits L2)."""
    return float(batch * context * D * ITEM)


@dataclass
class MlaKernel:
    """One compiled MLA decode kernel: its figures and its CTAs for a (batch, context)."""

    label: str
    registers: int
    spills: str
    smem: int                                   # static + dynamic per CTA
    threads: int
    work: pf.TileWork
    rows: int                                   # (query, head) rows per CTA
    kv_tile: int                                # keys per main-loop iteration
    ctas: Callable[[int, int], list[float]]     # (batch, context) -> main-loop iterations of each CTA
    notes: list[str] = field(default_factory=list)
    mma_warps: int = 0                          # warps running the main loop (0: all)

    @property
    def warps(self) -> int:
        return self.mma_warps or self.threads // 32

    @property
    def occ(self) -> pm.Occupancy:
        return pm.occupancy(self.threads, self.registers, self.smem, DEV)

    def unroll(self) -> float:
        """Tiles per iteration of the SASS main loop: its tensor FLOP over one tile's share of a warp
        (rows x kv_tile x (D + DV) x 2 / warps). Above 1: the compiler unrolled the tile loop; below 1:
        the main loop is a loop nested in the tile loop (kgen's k16 steps and column groups), which then
        runs 1 / unroll times a tile (the instructions between the nested loops are not counted)."""
        tile = 2 * self.rows * self.kv_tile * (D + DV) / self.warps
        return self.work.mma_flop / tile if self.work.mma_flop else 1.0

    def estimate(self, batch: int, context: int) -> pf.PrefillEstimate:
        return pf.launch_estimate(self.ctas(batch, context), self.work, self.warps, self.occ.blocks,
                                  mla_flop(batch, context), latent_bytes(batch, context), DEV, PIPES, PEAK,
                                  unroll=self.unroll())


def balanced(batch: int, context: int, kv_tile: int, row_tiles: int, ctas: int, per_seq: int = 0) -> list[float]:
    """A work-balancing scheduler's CTAs (FlashMLA's get_mla_metadata, FlashInfer's MLA plan): the
    tiles of every (sequence, row tile) spread evenly over `ctas` CTAs, `per_seq` tiles' worth of
    overhead charged per sequence each CTA touches (ASSUMPTION: an even split; both schedulers cut
    sequences into chunks to reach it)."""
    total = batch * row_tiles * (-(-context // kv_tile) + per_seq)
    return [total / ctas] * ctas


# ---- kgen -------------------------------------------------------------------------------------------
def kgen_mla(cuobjdump: str, cache: ArtifactCache, path: int = 0) -> MlaKernel:
    """kgen's MLA decode for the bundled DeepSeek-V3 spec (its default config; `path` 1: the mma.sync
    body, 0: the body sm_90 gets, the Hopper wgmma one), its CTAs from the family's own schedule: row
    blocks x sequences x the plan's partitions, each partition's keys in tiles of the body's."""
    if not SPEC.exists():
        raise RuntimeError(f"{SPEC.relative_to(ROOT)} is not in this checkout")
    spec = load_spec(SPEC)
    rendered = render(spec, {"path": path} if path else None, ARCH)
    config = rendered.config
    art = compile_cubin(rendered.source, ARCH, origin=str(SPEC), cache=cache)
    funcs = pm.parse_sass(sass_text(art.cubin, cuobjdump))
    res = art.resources[spec.name]
    geo = decode_geometry(spec, config)
    occ = pm.occupancy(geo.threads, res.registers, res.static_smem + geo.smem_bytes, DEV)
    rb = row_blocks(spec, config)

    def ctas(batch: int, context: int) -> list[float]:
        sizes, _ = family_for(spec).schedule(spec, config, {"seq_lens": np.full(batch, context)},
                                             target_blocks(DEV.sms, max(1, occ.blocks) * DEV.sms))
        parts = sizes["max_partitions"]
        keys = -(-context // parts)
        return [float(-(-keys // geo.tile_tokens))] * (rb * batch * parts)

    label = f"kgen {spec.name} ({rendered.body})"
    if rendered.body == "wgmma":
        how = "two warpgroups (S: half the keys each, O: half the 512 columns each)"
    else:
        how = f"{geo.row_tiles} row tiles x {geo.col_warps} column warps"
    return MlaKernel(label, res.registers, f"{res.spill_stores}/{res.spill_loads}",
                     res.static_smem + geo.smem_bytes, geo.threads, pf.tile_work(funcs[spec.name], DEV), geo.rows,
                     geo.tile_tokens, ctas,
                     [f"{label}: {geo.rows} heads x {geo.tile_tokens}-key tiles per CTA ({how}, {geo.stages} "
                      f"stages), {geo.threads} threads, {geo.smem_bytes} B dynamic smem; grid from the family's "
                      f"schedule (split-KV partitions of {config['partition_size']}-token granules)"])


# ---- FlashInfer's MLA kernel (mla.cuh) ------------------------------------------------------------------
FI_MLA = """\
#include <flashinfer/page.cuh>
#include <flashinfer/math.cuh>
#include <flashinfer/layout.cuh>
#include <flashinfer/utils.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/fastdiv.cuh>
#include <flashinfer/attention/variant_helper.cuh>
#include <flashinfer/attention/mla_params.cuh>
#include <flashinfer/attention/mla.cuh>
// BatchMLAPagedAttention's dispatch on a GPU with >= 221696 B of shared memory per SM (H100/H200):
// NUM_STAGES 2, CTA_TILE_KV 64, QK_SHARD true, CTA_TILE_Q 64; bf16 q/kv/o, 512 + 64, not causal (decode).
using Params = flashinfer::MLAParams<nv_bfloat16, nv_bfloat16, nv_bfloat16, int32_t>;
using KTraits = flashinfer::mla::KernelTraits<false, 2, true, 512, 64, 64, 64, nv_bfloat16, nv_bfloat16,
                                              nv_bfloat16, int32_t>;
template __global__ void flashinfer::mla::BatchMLAPagedAttentionKernel<KTraits, Params>(const __grid_constant__ Params);
"""
FI_ROWS, FI_TILE, FI_STAGES, FI_THREADS = 64, 64, 2, 256


def fi_mla_smem() -> int:
    """sizeof(SharedStorageQKVO) for the traits above: Q (nope + pe), NUM_STAGES x (ckv + kpe) tiles, and
    the union of the P tile with the cross-warpgroup (m, d) exchange; the o_smem tile aliases the K/V
    stages (mla.cuh). Restated from the struct, bf16 (2 B)."""
    q = FI_ROWS * (DV + (D - DV)) * ITEM
    kv = FI_STAGES * FI_TILE * (DV + (D - DV)) * ITEM
    p = FI_TILE * max(D - DV, FI_ROWS) * ITEM
    return q + kv + max(p, 2 * 2 * FI_ROWS * 4)


def flashinfer_mla(nvcc: str, cuobjdump: str, cache: ArtifactCache) -> MlaKernel:
    data = flashinfer_data()
    if data is None:
        raise RuntimeError("flashinfer-python is not installed (pip install --no-deps flashinfer-python)")
    version = importlib.metadata.version("flashinfer-python")
    flags = ["-O3", "-DNDEBUG", "-std=c++17", "-use_fast_math", "--expt-relaxed-constexpr",
             "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", f"-I{data / 'include'}",
             f"-I{data / 'cccl' / 'cub'}", f"-I{data / 'cccl' / 'libcudacxx' / 'include'}",
             f"-I{data / 'cccl' / 'thrust'}"]
    cubin, log = nvcc_cubin(f"// flashinfer-python {version} MLA\n" + FI_MLA, flags, nvcc, cache)
    funcs = pm.parse_sass(sass_text(cubin, cuobjdump))
    (name,) = [n for n in funcs if "BatchMLAPagedAttentionKernel" in n]
    res = parse_ptxas_report(log)[name]
    row_tiles = -(-HEADS // FI_ROWS)

    def ctas(batch: int, context: int) -> list[float]:
        # a cooperative, persistent launch: (2 row tiles) x (SMs / 2) CTAs, one per SM
        return balanced(batch, context, FI_TILE, row_tiles, DEV.sms // row_tiles * row_tiles)

    label = f"FlashInfer {version} MLA (mla.cuh, mma.sync)"
    return MlaKernel(label, res.registers, f"{res.spill_stores}/{res.spill_loads}", res.static_smem + fi_mla_smem(),
                     FI_THREADS, pf.tile_work(funcs[name], DEV), FI_ROWS, FI_TILE, ctas,
                     [f"{label}: CTA_TILE_Q {FI_ROWS} packed rows, CTA_TILE_KV {FI_TILE}, {FI_STAGES} stages, "
                      f"{FI_THREADS} threads (2 warpgroups split the 512 output columns), {fi_mla_smem()} B dynamic "
                      "smem (restated from SharedStorageQKVO); a cooperative launch of one CTA per SM whose plan "
                      "splits the KV evenly (modeled as an even split)"])


# ---- FlashMLA (sm90 dense decode: wgmma + TMA) ---------------------------------------------------------
FLASHMLA_TU = "csrc/sm90/decode/dense/instantiations/bf16.cu"
FLASHMLA_ROWS, FLASHMLA_TILE, FLASHMLA_THREADS, FLASHMLA_PER_SEQ = 64, 64, 256, 5


def flashmla(src: Path, nvcc: str, cuobjdump: str, cache: ArtifactCache) -> MlaKernel:
    data = flashinfer_data()
    if data is None or not (data / "cutlass" / "include").exists():
        raise RuntimeError("FlashMLA builds against CUTLASS; the flashinfer-python wheel's copy is missing")
    csrc = src / "csrc"
    if not (src / FLASHMLA_TU).exists():
        raise RuntimeError(f"{src}: no {FLASHMLA_TU} (a deepseek-ai/FlashMLA checkout is expected)")
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rev = head.stdout.strip() or "unknown"
    sources = "".join(p.read_text() for p in sorted(csrc.rglob("*")) if p.suffix in (".h", ".cuh", ".cu")
                      and "sm90/decode/dense" in str(p) or p.name in ("params.h", "utils.h", "defines.h"))
    flags = ["-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr", "--expt-extended-lambda",
             "-DNDEBUG", f"-I{csrc}", f"-I{csrc / 'sm90'}", f"-I{csrc / 'kerutils' / 'include'}",
             f"-I{data / 'cutlass' / 'include'}", f"-I{data / 'cutlass' / 'tools' / 'util' / 'include'}"]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = content_key("static-mla-flashmla", sources, "\0".join(flags), version)

    def build(tmp: Path) -> None:
        run = subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", *flags,
                              "-o", str(tmp / "k.cubin"), str(src / FLASHMLA_TU)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed on FlashMLA:\n{run.stderr[-3000:]}")
        (tmp / "ptxas.log").write_text(run.stderr + run.stdout)

    entry, _ = cache.get_or_build("static-mla", key, build)
    funcs = pm.parse_sass(sass_text((entry / "k.cubin").read_bytes(), cuobjdump))
    (name,) = [n for n in funcs if "flash_fwd_splitkv_mla_kernel" in n]
    res = parse_ptxas_report((entry / "ptxas.log").read_text())[name]
    row_tiles = -(-HEADS // FLASHMLA_ROWS)

    def ctas(batch: int, context: int) -> list[float]:
        # get_mla_metadata: num_sm_parts = SMs / kv heads / row tiles; grid (row tiles, 1, sm parts)
        return balanced(batch, context, FLASHMLA_TILE, row_tiles, DEV.sms // row_tiles * row_tiles, FLASHMLA_PER_SEQ)

    label = f"FlashMLA {rev} (sm90 dense decode, wgmma + TMA)"
    # its K/V tiles arrive by TMA: the SASS has no per-thread loads to count, so the latency term is 0
    return MlaKernel(label, res.registers, f"{res.spill_stores}/{res.spill_loads}", 0, FLASHMLA_THREADS,
                     pf.tile_work(funcs[name], DEV), FLASHMLA_ROWS, FLASHMLA_TILE, ctas,
                     [f"{label}: {FLASHMLA_ROWS} heads x {FLASHMLA_TILE}-key tiles per CTA, {FLASHMLA_THREADS} "
                      "threads (2 math warpgroups); its tiles arrive by TMA (no per-thread loads in the SASS: the "
                      "latency term is 0, an optimistic reading); its dynamic smem is not restated (occupancy "
                      f"from registers: one CTA per SM either way); {FLASHMLA_PER_SEQ} tiles' overhead per "
                      "sequence as its metadata charges; published: " + FLASHMLA_PUBLISHED],
                     mma_warps=8)


# ---- tables --------------------------------------------------------------------------------------------
def build(cache: ArtifactCache, flashmla_src: Path | None) -> tuple[list[MlaKernel], list[str]]:
    kernels, skipped = [], []
    cuobjdump, nvcc = find_cuobjdump(), find_nvcc()
    if cuobjdump is None:
        return [], ["every row: cuobjdump is missing (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"]
    builders = [("kgen mma.sync", lambda: kgen_mla(cuobjdump, cache, path=1)),
                ("kgen", lambda: kgen_mla(cuobjdump, cache))]
    if nvcc is None:
        skipped.append("FlashInfer MLA and FlashMLA: nvcc is missing")
    else:
        builders.append(("FlashInfer MLA", lambda: flashinfer_mla(nvcc, cuobjdump, cache)))
        if flashmla_src is None:
            skipped.append("FlashMLA: no --flashmla-src checkout given")
        else:
            builders.append(("FlashMLA", lambda: flashmla(flashmla_src, nvcc, cuobjdump, cache)))
    for what, make in builders:
        try:
            kernels.append(make())
        except Exception as e:  # noqa: BLE001 - a missing row says why; the others still print
            skipped.append(f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return kernels, skipped


def estimate_table(kernels: list[MlaKernel]) -> str:
    head = ["kernel", "batch", *[f"ctx {c // 1024}K: BW / tensor" for c in CONTEXTS]]
    rows = []
    for k in kernels:
        for b in BATCHES:
            cells = []
            for c in CONTEXTS:
                e = k.estimate(b, c)
                bw = latent_bytes(b, c) / e.seconds / DEV.copy_bw
                cells.append(f"{bw * 100:.0f}% / {e.fraction * 100:.0f}% ({e.bound})")
            rows.append([k.label, str(b), *cells])
    return md_table(head, rows)


def resource_table(kernels: list[MlaKernel]) -> str:
    head = ["kernel", "registers", "spill st/ld B", "smem B", "threads", "CTAs/SM", "rows x keys per tile",
            "main loop: tensor FLOP / instrs / smem wf per warp"]
    rows = [[k.label, str(k.registers), k.spills, str(k.smem) if k.smem else "not restated", str(k.threads),
             str(k.occ.blocks), f"{k.rows} x {k.kv_tile}",
             f"{k.work.mma_flop} / {k.work.instrs} / {k.work.wavefronts} ({k.unroll():.2g} tiles)"] for k in kernels]
    return md_table(head, rows)


def report(cache: ArtifactCache, flashmla_src: Path | None) -> str:
    kernels, skipped = build(cache, flashmla_src)
    ratio = 2 * HEADS * (D + DV) / (D * ITEM)
    parts = [
        "### MLA decode on H200 (sm_90): fraction of copy bandwidth / of the dense bf16 tensor peak\n",
        f"DeepSeek-V3 absorbed MLA: {HEADS} query heads on one latent head, rows of {D} (bf16), output {DV}. "
        f"Every key costs {ratio:.0f} tensor FLOP per latent byte, so at the H200's {DEV.copy_bw / 1e12:.1f} TB/s "
        f"copy bandwidth and {PEAK / 1e12:.0f} TFLOP/s the two limits are within "
        f"{abs(1 - ratio * DEV.copy_bw / PEAK) * 100:.0f}% of each other: "
        "a kernel near one is near both. Cells: bandwidth fraction / tensor fraction (binding term).",
        estimate_table(kernels) if kernels else "(no kernel could be built: see below)",
        "\n### Resources (sm_90)\n",
        resource_table(kernels) if kernels else "",
        "\n### Notes and assumptions\n",
        *[f"- {n}" for k in kernels for n in k.notes],
        f"- FlashMLA's published figures: {FLASHMLA_PUBLISHED}; the H800 has the H100's SMs and tensor peak "
        "(3.35 TB/s HBM3): 660 TFLOPS is 67% of the 989 TFLOP/s dense peak.",
        "- Model: kgen/perf/prefill_model.py's per-CTA terms (tensor, issue, MUFU, FP32, smem, tile latency) "
        "with list scheduling over 132 SMs at the 1.83 GHz the tensor peak is quoted at; at least the latent "
        "bytes over the copy bandwidth; split-KV merges and the query/output bytes are left out (small "
        "next to the latent rows at these shapes).",
        *[f"- not shown: {s}" for s in skipped],
    ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flashmla-src", type=Path, help="a deepseek-ai/FlashMLA checkout (its sm90 decode kernel)")
    ap.add_argument("--doc", help="write the tables into this markdown file between its static_mla markers")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    text = report(ArtifactCache(), args.flashmla_src)
    print(text)
    if args.doc:
        replace_between(Path(args.doc), text, DOC_BEGIN, DOC_END)
    print(f"({time.perf_counter() - t0:.1f} s; every figure above is a static ESTIMATE, see the notes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
