"""Static performance of the decode kernels on sm_90, side by side (no GPU needed; ESTIMATES).

For every bundled paged-decode spec (and its two decode paths, `mma_min_group` 0 and 1, when the family
has that parameter), FlashInfer's batch decode kernel (paged KV, fp16 and fp8 e4m3 caches, head_dim 128,
GQA 4: Llama-3-8B) compiled here from the headers the flashinfer-python wheel carries, and vLLM's
paged_attention v1/v2 kernels when a vLLM source tree that has them is given: registers, spills,
local-memory instructions in the SASS, shared memory, occupancy, bytes in flight per thread and per
SM (read from the SASS, kgen/perf/model.py), and an estimated fraction of H200 copy bandwidth
at batch {1, 16, 64, 256} x context {512, 4096, 32768}, grid fill included, with the term that binds
(bytes in flight, instruction issue, shared memory, tensor cores or copy bandwidth); instructions per byte
per kernel; issue 19's targets, met or missed. kgen's grid comes from
`kern.plan(seq_lens, num_sms=132)` when kgen has a planner, else from the fixed launch geometry.

    pip install --no-deps flashinfer-python          # headers only: nothing of it is imported
    pip install nvidia-cuda-nvdisasm                 # cuobjdump -sass needs it (the test extra has both tools)
    PYTHONPATH=. python benchmarks/static_perf.py [--vllm-src DIR] [--doc docs/performance.md]

nvcc (CUDA 12.4+) builds the FlashInfer and vLLM kernels; kgen's go through NVRTC as always. A
missing tool or source drops that row and says why. Builds are cached in kgen's cache directory.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import flashinfer_geometry as fi
from benchmarks import vllm_geometry as vg
from benchmarks.flashinfer_geometry import flashinfer_data
from benchmarks.nvcc import find_nvcc, nvcc_cubin
from benchmarks.tables import fmt_cell, fmt_pct, md_table, replace_between
from kgen.cache import ArtifactCache, content_key
from kgen.compile.nvrtc import parse_ptxas_report
from kgen.families.base import PerfModel
from kgen.families.registry import family_for
from kgen.perf import model as pm
from kgen.perf.report import (  # noqa: F401  (re-exported: the tests and gpu_decode.py use them from here)
    Figures,
    Plan,
    Subject,
    kgen_planner,
    kv_bytes_per_token,
    planning_kernel,
)
from kgen.perf.report import figures as _figures
from kgen.perf.report import kgen_subject as _kgen_subject
from kgen.perf.sass import cuobjdump_env, find_cuobjdump, sass_text, wheel_binary  # noqa: F401
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90"
SHAPES = pm.SHAPES
DEV = pm.H200
DOC_BEGIN, DOC_END = "<!-- static_perf:begin -->", "<!-- static_perf:end -->"
# The issue's register targets by KV dtype (fp16 Llama, fp8 per-head, bf16 GQA 8, int8 GQA 7).
REGISTER_TARGETS = {"fp16": 64, "fp8_e4m3": 96, "fp8_e5m2": 96, "bf16": 96, "int8": 128}  # (none set for nvfp4)
# Llama-3-8B decode: what FlashInfer and vLLM are built for (and kgen's llama3_8b_decode spec).
LLAMA = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page": 16, "itemsize": 2}


# ---- what the tables show of each kernel (kgen/perf/report.py) ------------------------------------
def figures(fn: pm.SassFunction, res) -> Figures:
    return _figures(fn, res, DEV)


def kgen_subject(path: Path, cuobjdump: str, cache: ArtifactCache, spec=None, config: dict | None = None,
                 label: str | None = None) -> Subject:
    """kgen's kernel for the spec at `path` (or `spec`, a variant of it) with `config` over the defaults."""
    return _kgen_subject(path, cuobjdump, cache, spec=spec, config=config, label=label, arch=ARCH)


# ---- FlashInfer ------------------------------------------------------------------------------------
FLASHINFER_CU = """\
// FlashInfer's batch decode kernel as its JIT instantiates it (csrc/batch_decode_customize_config.jinja,
// flashinfer/jit/attention/modules.py gen_batch_decode_module), for fp16 q/out, {dtype_kv} KV, int32 indices.
#include <flashinfer/page.cuh>
#include <flashinfer/math.cuh>
#include <flashinfer/layout.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/attention/variant_helper.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/attention/decode.cuh>
using namespace flashinfer;
struct Params {
  using DTypeQ = half; using DTypeKV = {dtype_kv}; using DTypeO = half; using IdType = int32_t;
  DTypeQ* q; paged_kv_t<DTypeKV, IdType> paged_kv; DTypeO* o; float* lse;
  float* maybe_alibi_slopes; double logits_soft_cap; double sm_scale; double rope_rcp_scale; double rope_rcp_theta;
  uint32_t padded_batch_size; uint32_t num_qo_heads; IdType q_stride_n; IdType q_stride_h; int32_t window_left;
  bool enable_pdl; IdType* request_indices; IdType* kv_tile_indices; IdType* o_indptr; IdType* kv_chunk_size_ptr;
  bool* block_valid_mask; bool partition_kv;
  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t) const { return 1; }
  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t b) const { return paged_kv.get_length(b); }
};
template __global__ void flashinfer::BatchDecodeWithPagedKVCacheKernel<PosEncodingMode::kNone, {stages}, {tile},
    {vec}, {bdx}, {bdy}, {bdz}, DefaultAttention<false, false, false, false>, Params>(const __grid_constant__ Params);
"""


FLASHINFER_KV = {"fp16": ("half", 2), "fp8_e4m3": ("__nv_fp8_e4m3", 1)}


def flashinfer_subject(nvcc: str, cuobjdump: str, cache: ArtifactCache, kv_dtype: str = "fp16") -> Subject:
    """FlashInfer's batch decode for Llama-3-8B with an fp16 or fp8 (e4m3, DTypeKV = __nv_fp8_e4m3) cache."""
    dtype_kv, itemsize = FLASHINFER_KV[kv_dtype]
    data = flashinfer_data()
    if data is None:
        raise RuntimeError("flashinfer-python is not installed (pip install --no-deps flashinfer-python)")
    version = importlib.metadata.version("flashinfer-python")
    L = LLAMA
    group = L["num_q_heads"] // L["num_kv_heads"]
    geo = fi.flashinfer_geometry(L["head_dim"], group, itemsize)
    source = FLASHINFER_CU.replace("{dtype_kv}", dtype_kv)
    for k in ("stages", "tile", "vec", "bdx", "bdy", "bdz"):
        source = source.replace("{" + k + "}", str(geo[k]))
    # flashinfer/jit/core.py and cpp_ext.py: its nvcc flags (the device-relevant ones)
    flags = ["-O3", "-DNDEBUG", "-std=c++17", "-use_fast_math", "--expt-relaxed-constexpr",
             "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
             "-DFLASHINFER_ENABLE_FP8_E5M2", f"-I{data / 'include'}", f"-I{data / 'cccl' / 'cub'}",
             f"-I{data / 'cccl' / 'libcudacxx' / 'include'}", f"-I{data / 'cccl' / 'thrust'}"]
    cubin, log = nvcc_cubin(f"// flashinfer-python {version}\n" + source, flags, nvcc, cache)
    funcs = pm.parse_sass(sass_text(cubin, cuobjdump))
    res = parse_ptxas_report(log)
    (name,) = [n for n in funcs if "BatchDecodeWithPagedKVCacheKernel" in n]
    fig = figures(funcs[name], res[name])
    occ = pm.occupancy(geo["threads"], fig.registers, fig.static_smem + geo["smem"], DEV)
    per_token = 2 * L["num_kv_heads"] * L["head_dim"] * itemsize

    def plan(batch: int, context: int) -> Plan:
        pages = [-(-context // L["page"])] * batch
        split, _, new_batch = fi.flashinfer_split(pages, L["num_kv_heads"], L["page"], occ.blocks, DEV)
        main = pm.Launch("decode", new_batch * L["num_kv_heads"], geo["threads"], geo["smem"])
        if not split:
            return Plan([main])
        partial = 2 * new_batch * L["num_q_heads"] * (L["head_dim"] * 2 + 4)  # fp16 tmp_v + fp32 lse
        return Plan([main, pm.Launch("merge", batch * L["num_q_heads"], 128)], 0, partial)

    label = f"FlashInfer {version} decode" + ("" if kv_dtype == "fp16" else f" {kv_dtype} KV")
    return Subject(label, {"decode": fig}, plan,
                   lambda b, c: float(b * c * per_token),
                   "its planner: no split when batch x kv_heads >= blocks/SM x 132, else the smallest chunk "
                   "(>= 8 pages) whose chunk count x kv_heads fits (scheduler.cuh; CUDA graphs off)",
                   notes=[f"{kv_dtype} KV ({dtype_kv}): block ({geo['bdx']}, {geo['bdy']}, {geo['bdz']}), "
                          f"{geo['stages']} cp.async stages, {geo['smem']} B dynamic smem"])


# ---- vLLM ------------------------------------------------------------------------------------------
VLLM_CU = """\
// vLLM's paged attention kernels (csrc/attention/attention_kernels.cuh) for fp16, head 128, block 16,
// 128 threads, v2 partition 512: the instantiations paged_attention_v{1,2}.cu launch for Llama-3-8B.
#include "attention/attention_kernels.cuh"
#define ARGS const int, const float, const int*, const int*, const int, const float*, const int, const int, \\
    const int, const float*, const float*, const int, const int, const int, const int, const int
template __global__ void vllm::paged_attention_v1_kernel<uint16_t, uint16_t, 128, 16, 128, vllm::Fp8KVCacheDataType::kAuto,
    false>(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, ARGS);
template __global__ void vllm::paged_attention_v2_kernel<uint16_t, uint16_t, 128, 16, 128, vllm::Fp8KVCacheDataType::kAuto,
    false, 512>(float*, float*, uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, ARGS);
template __global__ void vllm::paged_attention_v2_reduce_kernel<uint16_t, 128, 128, 512>(uint16_t*, const float*,
    const float*, const uint16_t*, const int*, const int);
"""
VLLM_STUBS = ("torch/all.h", "ATen/cuda/CUDAContext.h", "c10/cuda/CUDAGuard.h")  # host-side only


def vllm_subjects(src: Path, nvcc: str, cuobjdump: str, cache: ArtifactCache) -> list[Subject]:
    csrc = src / "csrc"
    if not (csrc / "attention" / "paged_attention_v1.cu").exists():
        raise RuntimeError(f"{src} has no csrc/attention/paged_attention_v1.cu (vLLM 0.10.x has it; "
                           "later releases removed the kernels)")
    header = (csrc / "attention" / "attention_kernels.cuh").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        for stub in VLLM_STUBS:
            Path(tmp, stub).parent.mkdir(parents=True, exist_ok=True)
            Path(tmp, stub).write_text("")
        # torch's CUDA flags (torch.utils.cpp_extension COMMON_NVCC_FLAGS), as vLLM's CMake build uses them
        flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DENABLE_FP8", "-D__CUDA_NO_HALF_OPERATORS__",
                 "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                 "-D__CUDA_NO_HALF2_OPERATORS__", f"-I{tmp}", f"-I{csrc}"]
        tag = content_key(header, (csrc / "attention" / "attention_utils.cuh").read_text())
        cubin, log = nvcc_cubin(f"// vllm {tag}\n" + VLLM_CU, flags, nvcc, cache)
    funcs = pm.parse_sass(sass_text(cubin, cuobjdump))
    res = parse_ptxas_report(log)

    def pick(part: str) -> Figures:
        (name,) = [n for n in funcs if part in n]
        return figures(funcs[name], res[name])

    L = LLAMA
    Hq, D, page = L["num_q_heads"], L["head_dim"], L["page"]
    group = Hq // L["num_kv_heads"]
    per_token = 2 * L["num_kv_heads"] * D * L["itemsize"]
    v1 = {"v1": pick("paged_attention_v1_kernel")}
    v2 = {"v2": pick("paged_attention_v2_kernelI"), "reduce": pick("paged_attention_v2_reduce_kernel")}

    def plan_v1(batch: int, context: int) -> Plan:
        return Plan([pm.Launch("v1", Hq * batch, vg.VLLM_THREADS, vg.vllm_v1_smem(context, D, page))])

    def plan_v2(batch: int, context: int) -> Plan:
        parts = -(-context // vg.VLLM_PARTITION)
        partial = 2 * batch * Hq * parts * (D * 2 + 8)  # fp16 tmp_out, fp32 exp_sums and max_logits
        return Plan([pm.Launch("v2", Hq * batch * parts, vg.VLLM_THREADS, vg.vllm_v2_smem(D)),
                     pm.Launch("reduce", Hq * batch, vg.VLLM_THREADS, 2 * parts * 4)], 0, partial)

    def kv(b: int, c: int) -> float:
        return float(b * c * per_token)

    return [Subject("vLLM 0.10 paged_attention_v1", v1, plan_v1, kv, "grid (num_heads, batch): one block per query "
                    "head; dynamic smem = fp32 logits of the whole context", dedupe=group),
            Subject("vLLM 0.10 paged_attention_v2", v2, plan_v2, kv, "grid (num_heads, batch, ceil(context / 512)) "
                    "+ reduce (num_heads, batch)", dedupe=group)]


# ---- tables ---------------------------------------------------------------------------------------
def resource_rows(subjects: list[Subject]) -> list[list[str]]:
    rows = []
    for s in subjects:
        plan = s.plan(64, 4096)
        for i, ln in enumerate(plan.launches):
            f = s.kernels.get(ln.kernel)
            if f is None:  # FlashInfer's merge: modeled (two round trips + its bytes), not compiled here
                rows.append([f"  + {ln.kernel} (not compiled)", *["-"] * (len(RESOURCE_HEAD) - 1)])
                continue
            occ = pm.occupancy(ln.threads, f.registers, f.static_smem + ln.smem, DEV)
            main = i == plan.main
            per_sm = occ.blocks * ln.threads * f.in_flight
            ceiling = min(DEV.copy_bw, per_sm / s.dedupe * DEV.sms / DEV.latency_s) / DEV.copy_bw
            rows.append([
                s.label if main else f"  + {ln.kernel}",
                f.registers, f"{f.spill_stores}/{f.spill_loads}", f.stack, f"{f.ldl}/{f.stl}",
                f"{f.static_smem}+{ln.smem}", ln.threads, f"{occ.blocks} ({occ.limiter})", occ.warps,
                occ.blocks * DEV.sms,
                f"{f.in_flight:.0f}" if main else "-", f"{per_sm / 1024:.0f}" if main else "-",
                fmt_pct(ceiling) if main else "-",
            ])
    return rows


RESOURCE_HEAD = ["kernel (sm_90)", "regs", "spill st/ld B", "stack B", "LDL/STL", "smem static+dyn B", "threads",
                 "blocks/SM (limit)", "warps/SM", "resident blocks", "B in flight/thread (est.)", "KB in flight/SM (est.)",
                 "full-GPU ceiling (est.)"]


def find(subjects: list[Subject], label: str) -> Subject | None:
    return next((s for s in subjects if s.label == label), None)


def flashinfer_fp16(subjects: list[Subject]) -> Subject | None:
    return next((s for s in subjects if s.label.startswith("FlashInfer") and " KV" not in s.label), None)


def estimate_rows(subjects: list[Subject], cell: Callable[[pm.Estimate], str] = fmt_cell) -> list[list[str]]:
    rows = []
    for s in subjects:
        rows.append([s.label, *(("n/a" if e is None else cell(e)) for e in (s.estimate(b, c)[0] for b, c in SHAPES))])
    # the issue's comparison: kgen's Llama spec (each of its paths) against FlashInfer (same model shape, fp16)
    fi = flashinfer_fp16(subjects)
    for llama in [s for s in subjects if s.spec is not None and s.spec.name == "llama3_8b_decode"] if fi else []:
        ratio = []
        for b, c in SHAPES:
            a, f = llama.estimate(b, c)[0], fi.estimate(b, c)[0]
            ratio.append(f"{f.seconds / a.seconds:.2f}x" if a and f else "n/a")
        rows.append([f"{llama.label} / FlashInfer", *ratio])
    return rows


def work_rows(subjects: list[Subject]) -> list[list[str]]:
    """Instructions per byte of the streaming launch of each subject, and what binds at 64 x 4096."""
    rows = []
    for s in subjects:
        plan = s.plan(64, 4096)
        w = s.kernels[plan.launches[plan.main].kernel].work
        e, _ = s.estimate(64, 4096)
        per_byte = w.instrs_per_byte * s.dedupe  # blocks reading the same bytes each issue their instructions
        ceiling = pm.issue_bound_fraction(pm.Work(instrs_per_byte=per_byte), DEV)
        rows.append([s.label, w.loop_instrs, w.loop_bytes, f"{per_byte:.3f}", f"{w.wavefronts_per_byte * s.dedupe:.3f}",
                     f"{w.flop_per_byte * s.dedupe:.1f}", w.fixed_instrs,
                     "-" if ceiling == float("inf") else fmt_pct(ceiling), fmt_cell(e)])
    return rows


WORK_HEAD = ["kernel (streaming launch)", "loop warp-instr/iter", "K/V B/thread/iter", "warp-instr per K/V B",
             "smem wavefronts per B", "tensor FLOP per B", "warp-instr outside loop", "issue-limited fraction",
             "est. 64x4096 (binding)"]


def _tokens_per_s(s: Subject, b: int, c: int) -> float | None:
    e = s.estimate(b, c)[0]
    return None if e is None else b * c / e.seconds


def _at(s: Subject | None, b: int = 64, c: int = 4096) -> pm.Estimate | None:
    return None if s is None else s.estimate(b, c)[0]


def target_rows(subjects: list[Subject], fp8_label: str | None) -> list[list[str]]:
    """Issue 19's targets, each computed from the estimates and shown met or missed."""
    rows = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "MISSED")

    def fraction(label: str, floor: float, what: str) -> None:
        e = _at(find(subjects, label))
        rows.append([f"{what} at 64x4096 >= {floor:.0%} of copy bandwidth", label,
                     "n/a" if e is None else f"{fmt_pct(e.fraction)} ({e.bound})",
                     verdict(None if e is None else e.fraction >= floor)])

    fi = flashinfer_fp16(subjects)
    for llama in [s for s in subjects if s.spec is not None and s.spec.name == "llama3_8b_decode"]:
        fraction(llama.label, 0.95, "fp16 GQA 4")
        if fi is not None:
            ratios = [(fi.estimate(b, c)[0].seconds / llama.estimate(b, c)[0].seconds, (b, c)) for b, c in SHAPES]
            worst, (b, c) = min(ratios)
            below = sum(r < 1.0 - 5e-3 for r, _ in ratios)  # 1.00x as printed counts as met
            rows.append(["fp16 GQA 4 >= 1.0x FlashInfer (time ratio) in every grid cell", llama.label,
                         f"worst {worst:.2f}x at {b}x{c}; {below} of {len(ratios)} cells under 1.00x",
                         verdict(below == 0)])
    fp16 = find(subjects, "kgen llama3_8b_decode")
    fp8 = find(subjects, fp8_label) if fp8_label else None
    if fp16 and fp8:
        r = _tokens_per_s(fp8, 64, 4096) / _tokens_per_s(fp16, 64, 4096)
        rows.append(["fp8 tokens/s >= 1.8x fp16's at 64x4096 (same Llama shape; tokens/s = batch x context / s)",
                     f"{fp8.label} / {fp16.label}", f"{r:.2f}x", verdict(r >= 1.8)])
    fi8 = next((s for s in subjects if s.label.startswith("FlashInfer") and "fp8" in s.label), None)
    if fi and fi8:
        r = _tokens_per_s(fi8, 64, 4096) / _tokens_per_s(fi, 64, 4096)
        rows.append(["(reference) FlashInfer fp8 / fp16 tokens/s at 64x4096", f"{fi8.label} / {fi.label}",
                     f"{r:.2f}x", "-"])
    nv = find(subjects, "kgen llama3_8b_decode_nvfp4")
    if nv and fp8:
        rows += nvfp4_rows(nv, fp8, verdict)
    fraction("kgen decode_int8_per_token_head", 0.85, "int8 per-token-head")
    fraction("kgen bf16_decode_b32", 0.90, "bf16 GQA 8")
    return rows


def nvfp4_rows(nv: Subject, fp8: Subject, verdict: Callable[[bool | None], str]) -> list[list[str]]:
    """nvfp4 against fp8 on the Llama shape: cache bytes per token (4 bits and an e4m3 per 16 elements
    against 8 bits: 0.5625x; the 0.53x of 4.25 bits would need a scale per 32) and the estimated
    bandwidth fraction at 64x4096."""
    ratio = kv_bytes_per_token(nv.spec) / kv_bytes_per_token(fp8.spec)
    e_nv, e_8 = _at(nv), _at(fp8)
    ok = None if e_nv is None or e_8 is None else e_nv.fraction >= e_8.fraction
    shown = "n/a" if ok is None else f"{fmt_pct(e_nv.fraction)} ({e_nv.bound}) vs {fmt_pct(e_8.fraction)}"
    return [["nvfp4 cache bytes per token <= 0.5625x fp8's (with its block scales)", f"{nv.label} / {fp8.label}",
             f"{ratio:.4f}x", verdict(ratio <= 0.5625)],
            ["nvfp4 fraction of copy bandwidth >= fp8's at 64x4096", f"{nv.label} / {fp8.label}", shown,
             verdict(ok)]]


def register_rows(subjects: list[Subject]) -> list[list[str]]:
    rows = []
    for s in subjects:
        if s.spec is None:
            continue
        spec, kv = s.spec, s.spec.kv_cache
        f = s.kernels[spec.name]
        target = REGISTER_TARGETS.get(kv.dtype)
        rows.append([s.label.removeprefix("kgen "), kv.dtype, kv.scale, kv.layout, spec.group_size, spec.attention.head_dim,
                     f.registers, f"{f.spill_stores}/{f.spill_loads}", f.stack, f"{f.ldl}/{f.stl}",
                     f"<= {target} {'ok' if f.registers <= target else 'MISSED'}" if target else "-"])
    return rows


def assumptions(subjects: list[Subject]) -> str:
    d = DEV
    lim = d.limits
    group = LLAMA["num_q_heads"] // LLAMA["num_kv_heads"]
    lines = [
        "Every figure in these tables is an ESTIMATE from static figures (ptxas, SASS, launch geometry), "
        "not a measurement.",
        "",
        f"- **Device**: {d.name}, {d.sms} SMs. Occupancy by the CUDA occupancy rules for sm_90: {lim.regs_per_sm} "
        f"registers per SM in {lim.sub_partitions} sub-partitions, allocated {lim.reg_alloc_per_warp} per warp; "
        f"{lim.smem_per_sm // 1024} KB shared memory per SM ({lim.smem_per_block // 1024} KB per block, "
        f"{lim.smem_reserved_per_block} B reserved per block, {lim.smem_granularity} B granularity); "
        f"{lim.max_threads_per_sm} threads and {lim.max_blocks_per_sm} blocks per SM.",
        f"- **Memory**: {d.copy_bw / 1e12:.1f} TB/s copy bandwidth (a device-to-device copy measured on this "
        f"workplace's H200s; datasheet peak {d.peak_bw / 1e12:.1f} TB/s) and {d.latency_s * 1e6:.1f} us DRAM "
        "latency. The memory side of the model is latency-bound streaming: bandwidth = min(copy bandwidth, bytes "
        "in flight / latency) (Little's law); the SM side adds the issue, smem and tensor terms below. Not modeled: L2 hits of the KV stream, per-SM limits on "
        "outstanding misses, instruction latencies and dependency stalls (beyond the issue-rate terms below), "
        "launch gaps (CUDA-graph replay assumed).",
        f"- **Instruction issue** (term \"issue\"): an SM issues {d.issue_per_sm_clock} warp-instructions per clock, "
        f"one per sub-partition, each from its own warps (fewer than {d.issue_per_sm_clock} warps resident on an SM: "
        f"that many per clock), at {d.clock_hz / 1e9:.2f} GHz (the H200 SXM maximum boost clock; a throttled clock "
        "would lower it). Warp-instructions are counted in the SASS: every instruction of the streaming loop's "
        "body once per iteration (branches inside the body taken as falling through, predicated-off instructions "
        "still issued), per K/V byte = loop instructions / (32 x K/V bytes per thread per iteration; block-table "
        "and scale reads under 8 bytes that are not cp.async do not count as stream bytes); every instruction "
        "outside the streaming loops once per warp per launch. A wave's instructions / (busy SMs x min(4, warps "
        f"per SM) x clock). At full copy bandwidth the H200 issues {d.sms * d.issue_per_sm_clock * d.clock_hz / d.copy_bw:.3f} "
        "warp-instructions per byte (\"issue-limited fraction\" = that over the loop's instructions per byte).",
        f"- **Shared memory** (term \"smem\"): {d.smem_wavefronts_per_sm_clock} wavefront (128 B) per SM per clock; "
        "per warp-instruction, LDS/STS/LDGSTS take 32 x width / 128 B wavefronts (128-bit: 4, 64-bit: 2, 32-bit "
        "and narrower: 1), LDSM/STSM .x4: 4, .x2: 2, .x1: 1. Bank conflicts are not modeled (conflict-free assumed).",
        f"- **Tensor cores** (term \"tensor\"): HMMA FLOP from the SASS shape (HMMA.16816: 2 x 16 x 8 x 16 = 4096) at "
        f"{d.tensor_flop_per_sm_clock:.0f} dense fp16 FLOP per SM per clock: the H100/H200 SXM datasheet's 989 "
        "TFLOP/s dense fp16 over 132 SMs at the 1.83 GHz it is quoted at, i.e. one HMMA.16816 per sub-partition "
        "every 4 clocks; it is assumed mma.sync reaches it, which is optimistic (Hopper reaches its tensor peak "
        "through wgmma: Luo et al., arXiv 2501.12084; no decode kernel here uses wgmma, and HGMMA is not counted). A wave's FLOP / (busy SMs x that x clock).",
        "- **Binding term**: per wave, the slowest of latency (bytes in flight), issue, smem, tensor and copy "
        "bandwidth sets the wave's time; the cell names the term charged the most time over the launch (the 2 "
        "round trips per wave and per extra launch count as latency, partial results as bandwidth).",
        "- **Bytes in flight per thread**, read from the SASS (`cuobjdump -sass`): the streaming loop is the "
        "backward branch whose body has the most global-load bytes (other disjoint loops with at least 25% of "
        "that count too, e.g. vLLM's K loop and V loop, each weighted by its bytes). Its body is walked 48 times "
        "in order on a clock that only stalls advance: a global read is issued at the current time; an "
        "instruction that waits on a scoreboard holding global reads (the 6 scoreboards and wait masks are "
        "decoded from each instruction's control word), or a `DEPBAR.LE SB0, N` that retires cp.async groups "
        "(`LDGSTS` ... `LDGDEPBAR`), moves the clock to the latest issue time of what it waits for plus one "
        f"latency ({d.hit_weight} of one when it waits for under 8 bytes per thread: a block-table or scale "
        "read, mostly a cache hit). Over the last 24 passes (whole periods of any pipeline up to 8 stages "
        "deep), bytes in flight = bytes per iteration x latency / iteration time. Per SM: x threads per block x resident blocks. \"Full-GPU ceiling\": that x "
        f"{d.sms} SMs / latency, over the copy bandwidth, for the launch of batch 64 x 4096.",
        "- **Nested loops** (kgen/perf/model.py, `steady_body`): a streaming loop that issues reads but never "
        "waits for them (the tensor-core decode body's copy loop, `#pragma unroll 2`) is part of the loop around "
        "it, which is then the unit. Loops nested in the unit repeat per iteration as kgen's geometry says "
        "(`TileHint`): a copy loop until it has read the tile's bytes per thread, a loop without reads (the "
        "CUDA-core body's batch loop) tokens per thread and tile / batch tokens times. FlashInfer's, vLLM's "
        "and hand-written kernels have no hint: their nested loops count once per iteration.",
        "- **Time of a launch**: the sum over waves of equal blocks (a wave: up to SMs x blocks/SM blocks "
        "resident at once) of the slowest term for that wave (the largest of: wave bytes x latency / (wave blocks x "
        "threads x bytes in flight), wave bytes / copy bandwidth, and the issue, smem and tensor times above), "
        "plus 2 latencies per wave (seq_len and block-table reads before the first KV read, the "
        "store at the end). Each extra launch (a split-KV merge or reduce) adds 2 latencies plus its partial "
        "results, written and read back, at the copy bandwidth.",
        "- **Cells**: KV bytes / estimated time / copy bandwidth; in parentheses the binding term; the next table "
        "gives the thread blocks of the launch that streams the KV cache (the GPU holds 132 x blocks/SM at once: \"resident blocks\"). KV bytes = "
        "batch x tokens read (the window for a sliding-window spec) x KV bytes per token (K and V rows, plus "
        "per-token scales). kgen's rows are each spec's own model shape; FlashInfer's and vLLM's are Llama-3-8B "
        "(32 query heads, 8 KV heads, head_dim 128, fp16, 16-token pages), the shape of llama3_8b_decode.",
        f"- **vLLM** launches one block per query head, so the {group} blocks of a KV head read the same bytes: "
        f"DRAM bytes are counted once (L2 assumed to serve the rest) and the requests in flight per DRAM byte "
        f"are divided by {group}. L2 bandwidth is not modeled (optimistic for vLLM). vLLM itself runs v1 when the "
        "context is at most 8192 and (one 512-token partition suffices or batch x heads > 512), else v2.",
        "- **Grids**:",
        *(f"  - {s.label}: {s.grid_source}" for s in subjects),
        *(f"  - {s.label}: {n}" for s in subjects for n in s.notes),
    ]
    return "\n".join(lines)


MMA_PARAM = "mma_min_group"
MMA_CONFIGS = ((0, "CUDA cores"), (1, "tensor cores"))


def mma_paths(path: Path, spec, cuobjdump: str, cache: ArtifactCache, skipped: list[str]) -> list[Subject]:
    """The spec's two decode paths, `mma_min_group` 0 (the CUDA-core loop) and 1 (the tensor-core path),
    when its family has that parameter; else a note in `skipped` (once per family)."""
    family = family_for(spec)
    if MMA_PARAM not in getattr(family, "params", {}):
        note = (f"{family.kind} second-path rows: the family has no "
                f"`{MMA_PARAM}` parameter in this tree (params: {', '.join(getattr(family, 'params', {}))}), "
                "so there is no tensor-core decode path to render")
        if note not in skipped:
            skipped.append(note)
        return []
    out = []
    for value, name in MMA_CONFIGS:
        try:
            out.append(kgen_subject(path, cuobjdump, cache, config={MMA_PARAM: value},
                                    label=f"kgen {spec.name} [{MMA_PARAM}={value}: {name}]"))
        except Exception as e:  # a config the family refuses for this spec: say why, keep the others
            skipped.append(f"kgen {spec.name} [{MMA_PARAM}={value}]: {type(e).__name__}: {str(e)[:160]}")
    return out


LLAMA_SHAPE = ("num_q_heads", "num_kv_heads", "head_dim")


def fp8_llama(subjects: list[Subject], specs: Path, cuobjdump: str, cache: ArtifactCache) -> str | None:
    """The label of an fp8 (e4m3, per-head scales) kgen kernel with llama3_8b_decode's shape: the bundled
    decode_fp8_e4m3_per_head when its attention shape and block size are Llama's, else a variant of
    llama3_8b_decode rendered with an fp8 cache (added to `subjects`)."""
    fp16 = find(subjects, "kgen llama3_8b_decode")
    fp8 = find(subjects, "kgen decode_fp8_e4m3_per_head")
    if fp16 is None:
        return None
    same = fp8 is not None and all(getattr(fp8.spec.attention, k) == getattr(fp16.spec.attention, k)
                                   for k in LLAMA_SHAPE) and fp8.spec.kv_cache.block_size == fp16.spec.kv_cache.block_size
    if same:
        return fp8.label
    # fp8 needs sm_89 or newer: the variant targets the arch this benchmark compiles for
    variant = fp16.spec.with_overrides(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"},
                                       targets=[ARCH])
    label = "kgen llama3_8b_decode (fp8_e4m3 per_head cache)"
    subjects.append(kgen_subject(specs / "llama3_8b_decode.yaml", cuobjdump, cache, spec=variant, label=label))
    return label


def build_subjects(args, cache: ArtifactCache) -> tuple[list[Subject], list[str]]:
    skipped: list[str] = []
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    subjects = []
    for path in sorted(Path(args.specs).glob("*.yaml")):
        spec = load_spec(path)
        if family_for(spec).perf_model is PerfModel.STREAMING:  # this benchmark is about decode's streaming model
            subjects.append(kgen_subject(path, cuobjdump, cache))
            subjects += mma_paths(path, spec, cuobjdump, cache, skipped)
    args.fp8_label = fp8_llama(subjects, Path(args.specs), cuobjdump, cache)
    nvcc = find_nvcc()
    if nvcc is None:
        skipped.append("FlashInfer and vLLM: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
        return subjects, skipped
    for kv_dtype in FLASHINFER_KV:
        try:
            subjects.append(flashinfer_subject(nvcc, cuobjdump, cache, kv_dtype))
        except RuntimeError as e:
            skipped.append(f"FlashInfer ({kv_dtype} KV): {e}")
    src = args.vllm_src or os.environ.get("VLLM_SRC")
    if not src:
        skipped.append("vLLM: no source tree given (--vllm-src DIR or VLLM_SRC: an unpacked vLLM 0.10.x sdist; "
                       "the current vllm releases no longer carry paged_attention_v1/v2)")
    else:
        try:
            subjects += vllm_subjects(Path(src), nvcc, cuobjdump, cache)
        except RuntimeError as e:
            skipped.append(f"vLLM: {e}")
    return subjects, skipped


def report(subjects: list[Subject], skipped: list[str], fp8_label: str | None = None) -> str:
    shape_head = [f"{b}x{c}" for b, c in SHAPES]
    parts = [
        "### Estimated fraction of H200 copy bandwidth (binding term)\n",
        md_table(["kernel", *shape_head], estimate_rows(subjects)),
        "\n### Thread blocks of the streaming launch\n",
        md_table(["kernel", *shape_head], estimate_rows(subjects, lambda e: str(e.blocks))[:len(subjects)]),
        "\n### Instructions per byte (streaming launch, from the SASS; H200 issue allows "
        f"{DEV.sms * DEV.issue_per_sm_clock * DEV.clock_hz / DEV.copy_bw:.3f} warp-instructions per byte "
        "at full copy bandwidth)\n",
        md_table(WORK_HEAD, work_rows(subjects)),
        "\n### Targets (issue 19), from the estimates\n",
        md_table(["target", "kernel", "estimate", "verdict"], target_rows(subjects, fp8_label)),
        "\n### Resources on sm_90 (launch of batch 64 x 4096)\n",
        md_table(RESOURCE_HEAD, resource_rows(subjects)),
        "\n### Registers per spec (kgen, sm_90; targets from issue 11)\n",
        md_table(["spec", "kv dtype", "scale", "layout", "group", "head_dim", "regs", "spill st/ld B", "stack B",
                  "LDL/STL", "target"], register_rows(subjects)),
    ]
    if skipped:
        parts += ["\nNot built:\n", "\n".join(f"- {s}" for s in skipped)]
    parts += ["\n### Model and assumptions\n", assumptions(subjects)]
    return "\n".join(parts) + "\n"


def write_doc(path: Path, text: str) -> None:
    """Replace what lies between this benchmark's markers (the rest of the page is hand-written)."""
    replace_between(path, text, DOC_BEGIN, DOC_END)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=str(ROOT / "specs"), help="folder of specs (the paged-decode ones are used)")
    ap.add_argument("--vllm-src", help="an unpacked vLLM source tree with csrc/attention/paged_attention_v1.cu")
    ap.add_argument("--doc", help="write the tables into this markdown file between its static_perf markers")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    subjects, skipped = build_subjects(args, ArtifactCache())
    text = report(subjects, skipped, getattr(args, "fp8_label", None))
    print(text)
    if args.doc:
        write_doc(Path(args.doc), text)
    print(f"({time.perf_counter() - t0:.1f} s; every figure above is a static ESTIMATE, see the assumptions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
