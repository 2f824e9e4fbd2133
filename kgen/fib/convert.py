"""FlashInfer-Bench Definitions to kgen specs and back, and kgen's kernel as a Solution (docs/interop.md §6).

The entry points here take any op type kgen converts and hand `mla_paged` to kgen/fib/mla.py; the
rest of this module is `gqa_paged`. FlashInfer-Bench's paged attention (`op_type: gqa_paged`) keeps
the cache as `k_cache`, `v_cache` `[num_pages, page_size, num_kv_heads, head_dim]` (kgen: layout
separate, order NHD), the page table as `kv_indptr`/`kv_indices` (plus `kv_last_page_len` when pages
hold more than one token), the softmax scale as a call argument `sm_scale`, and a base-2 LSE. kgen
fixes the scale in the spec, so an exported Definition states it as a constraint (`sm_scale ==
<value>`), and an import reads it back from there (else `auto`, 1/sqrt(head_dim)).
"""

from __future__ import annotations

import math
from typing import Any

from kgen.errors import KgenUserError
from kgen.fib import mla
from kgen.fib.common import (
    DTYPES,
    FIB_DTYPES,
    REFERENCE_HELPERS,
    checked_spec,
    chosen_scale,
    definition_is_prefill,
    dtype_suffix,
    export_format_problems,
    fib_kind,
    io_problems,
    is_prefill,
    op_type,
    paged_definition,
    paging_inputs,
    reference_fields,
    refuse,
    solution_name,
    spec_name,
    what_it_computes,
)
from kgen.fib.schema import Definition, Solution, parse
from kgen.formats.cache import CacheFormat
from kgen.version import __version__

OP_TYPE = "gqa_paged"
OP_TYPES = (OP_TYPE, mla.OP_TYPE)  # what kgen imports and exports
CONST_AXES = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size")
__all__ = ["OP_TYPE", "OP_TYPES", "definition_to_spec", "spec_to_definition", "spec_to_solution", "export_problems",
           "require_exportable", "definition_name", "input_names", "fib_kind", "is_prefill", "solution_name"]


# ---- import ------------------------------------------------------------------------------------------
def definition_problems(d: Definition) -> list[str]:
    """Why kgen cannot build this gqa_paged Definition (empty: it can)."""
    if d.op_type != OP_TYPE:
        return [f"op_type '{d.op_type}': kgen imports paged attention only (op_type '{OP_TYPE}': "
                f"gqa_paged_decode_* and gqa_paged_prefill_* definitions; op_type '{mla.OP_TYPE}': "
                "mla_paged_decode_* and mla_paged_prefill_* definitions)"]
    problems = []
    for axis in CONST_AXES:
        if d.const(axis) is None:
            problems.append(f"axes.{axis}: required as a const axis (kgen specializes on it)")
    prefill = definition_is_prefill(d)
    needed = ["q", "k_cache", "v_cache", "kv_indptr", "kv_indices"] + (["qo_indptr"] if prefill else [])
    problems += io_problems(d, needed, "prefill" if prefill else "decode")
    for n in ("q", "k_cache", "v_cache"):
        if n in d.inputs and d.inputs[n].dtype not in DTYPES:
            why = (" (kgen's fp8 caches need a dequantization scale, which this definition does not carry)"
                   if n != "q" and d.inputs[n].dtype.startswith("float8") else "")
            problems.append(f"inputs.{n}.dtype: {d.inputs[n].dtype} not supported (allowed: {', '.join(DTYPES)}){why}")
    if "output" in d.outputs and d.outputs["output"].dtype not in DTYPES:
        problems.append(f"outputs.output.dtype: {d.outputs['output'].dtype} not supported (allowed: {', '.join(DTYPES)})")
    if {"k_cache", "v_cache"} <= set(d.inputs) and d.inputs["k_cache"].dtype != d.inputs["v_cache"].dtype:
        problems.append("inputs.v_cache.dtype: must equal k_cache's (kgen has one cache dtype)")
    if "k_cache" in d.inputs and not problems:
        try:
            cache_order(d)
        except ValueError as e:
            problems.append(str(e))
    if "q" in d.inputs and (d.inputs["q"].shape or [])[1:] != ["num_qo_heads", "head_dim"]:
        problems.append(f"inputs.q.shape: expected [rows, num_qo_heads, head_dim], got {d.inputs['q'].shape}")
    return problems


def cache_order(d: Definition) -> str:
    """NHD or HND from k_cache's shape (a 3-d [num_pages, num_kv_heads, head_dim] is one token per page)."""
    for n in ("k_cache", "v_cache"):
        shape = d.inputs[n].shape or []
        if shape[1:] == ["page_size", "num_kv_heads", "head_dim"]:
            order = "NHD"
        elif shape[1:] == ["num_kv_heads", "page_size", "head_dim"]:
            order = "HND"
        elif shape[1:] == ["num_kv_heads", "head_dim"] and d.const("page_size") == 1:
            order = "NHD"
        else:
            raise ValueError(f"inputs.{n}.shape: {shape} is not a paged cache kgen reads ([num_pages, page_size, "
                             "num_kv_heads, head_dim] or [num_pages, num_kv_heads, page_size, head_dim])")
    return order


def softmax_scale(d: Definition, given: float | None = None, origin: str = "") -> float | str:
    """The spec's softmax_scale: `given`, else a `sm_scale == <number>` constraint; `auto` when that is
    1/sqrt(head_dim) or when there is none."""
    value = chosen_scale(d, given, origin)
    if value is None or math.isclose(value, 1.0 / math.sqrt(d.const("head_dim")), rel_tol=1e-9):
        return "auto"
    return value


def definition_to_spec(d: Definition, origin: str, sm_scale: float | None = None) -> dict[str, Any]:
    """The kgen spec (as a dict, validated and buildable) for Definition `d` (`sm_scale`: the softmax scale
    to build for, when the Definition fixes none); KgenUserError with every reason it cannot."""
    if mla.is_mla_definition(d):
        return mla.definition_to_spec(d, origin, sm_scale)
    refuse(d, origin, definition_problems(d))
    prefill = definition_is_prefill(d)
    attention: dict[str, Any] = {"num_q_heads": d.const("num_qo_heads"), "num_kv_heads": d.const("num_kv_heads"),
                                 "head_dim": d.const("head_dim"), "softmax_scale": softmax_scale(d, sm_scale, origin)}
    if prefill:
        attention["causal"] = "causal" in d.name
    data = {
        "kgen": 1, "name": spec_name(d.name), "kind": "paged_prefill" if prefill else "paged_decode",
        "attention": attention,
        "kv_cache": {"block_size": d.const("page_size"), "layout": "separate", "order": cache_order(d),
                     "dtype": DTYPES[d.inputs["k_cache"].dtype], "scale": "none"},
        "dtype": {"q": DTYPES[d.inputs["q"].dtype], "out": DTYPES[d.outputs["output"].dtype]},
        "tail_masking": True,
    }
    return checked_spec(data, d, origin)


# ---- export ------------------------------------------------------------------------------------------
def export_problems(spec) -> list[str]:
    """Why a spec has no FlashInfer-Bench Definition (empty: it has one)."""
    a, kv = spec.attention, spec.kv_cache
    if fib_kind(spec) is None:
        return [f"kind {spec.kind} (kv_cache.layout {kv.layout}): this kernel has no FlashInfer-Bench definition "
                f"kind (exported are the {' and '.join(OP_TYPES)} decode and prefill kernels)"]
    if op_type(spec) == mla.OP_TYPE:
        return mla.export_problems(spec)
    problems = []
    if a.sliding_window is not None:
        problems.append("attention.sliding_window: FlashInfer-Bench's gqa_paged definitions have no window")
    if a.logits_soft_cap is not None:
        problems.append("attention.logits_soft_cap: FlashInfer-Bench's gqa_paged definitions have no soft cap")
    if a.alibi:
        problems.append("attention.alibi: FlashInfer-Bench's gqa_paged definitions have no ALiBi")
    if a.sinks:  # exporting would drop them: a definition that is not this kernel
        problems.append("attention.sinks: FlashInfer-Bench's gqa_paged definitions have no attention sinks")
    if spec.v_head_dim_value != a.head_dim:
        problems.append(f"attention.v_head_dim {spec.v_head_dim_value}: FlashInfer-Bench's gqa_paged definitions "
                        f"have one head_dim for q, K, V and the output (got head_dim {a.head_dim})")
    if not CacheFormat.of(spec).separate:
        problems.append(f"kv_cache.layout {kv.layout}: FlashInfer-Bench's definitions keep separate k_cache and "
                        "v_cache arrays (layout: separate)")
    return problems + export_format_problems(spec, OP_TYPE, "fp16, bf16 and fp32 caches")


def definition_name(spec) -> str:
    if op_type(spec) == mla.OP_TYPE:
        return mla.definition_name(spec)
    a, kv = spec.attention, spec.kv_cache
    what = fib_kind(spec) + ("_causal" if is_prefill(spec) and a.causal else "")
    return dtype_suffix(spec, f"{what}_h{a.num_q_heads}_kv{a.num_kv_heads}_d{a.head_dim}_ps{kv.block_size}")


def require_exportable(spec) -> None:
    problems = export_problems(spec)
    if problems:
        where = spec.source_path or spec.name
        raise KgenUserError(f"{where}: no FlashInfer-Bench definition for this spec:\n"
                            + "\n".join(f"  {p}" for p in problems))


def input_names(spec) -> list[str]:
    """The exported Definition's inputs, in `run`'s parameter order."""
    return (mla.inputs(spec) if op_type(spec) == mla.OP_TYPE else _inputs(spec))[1]


def _inputs(spec) -> tuple[dict[str, Any], list[str]]:
    """(inputs, names in `run`'s parameter order)."""
    rows = "total_q" if is_prefill(spec) else "batch_size"
    q_t, kv_t = FIB_DTYPES[spec.dtype.q], FIB_DTYPES[spec.kv_cache.dtype]
    cache = (["num_pages", "page_size", "num_kv_heads", "head_dim"] if spec.kv_cache.resolved_order == "NHD"
             else ["num_pages", "num_kv_heads", "page_size", "head_dim"])
    inputs: dict[str, Any] = {
        "q": {"shape": [rows, "num_qo_heads", "head_dim"], "dtype": q_t, "description": "queries"},
        "k_cache": {"shape": cache, "dtype": kv_t, "description": f"paged K cache ({spec.kv_cache.resolved_order})"},
        "v_cache": {"shape": cache, "dtype": kv_t, "description": f"paged V cache ({spec.kv_cache.resolved_order})"},
        **paging_inputs(spec),
    }
    return inputs, list(inputs)


def spec_to_definition(spec) -> dict[str, Any]:
    """A FlashInfer-Bench Definition (a dict, validated against kgen.fib.schema.Definition)."""
    require_exportable(spec)
    if op_type(spec) == mla.OP_TYPE:
        return mla.spec_to_definition(spec)
    a, kv = spec.attention, spec.kv_cache
    inputs, params = _inputs(spec)
    return paged_definition(
        spec, definition_name(spec), OP_TYPE,
        const_axes={"num_qo_heads": a.num_q_heads, "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
                    "page_size": kv.block_size},
        description=(f"Paged GQA {what_it_computes(spec)}: {a.num_q_heads} query heads, {a.num_kv_heads} KV heads, "
                     f"head_dim {a.head_dim}, {kv.block_size} tokens per page; lse is base 2."),
        inputs=inputs, out_dim="head_dim", reference=reference_source(spec, params))


_REFERENCE = '''\
"""FlashInfer-Bench reference for {name}, exported by kgen from spec '{spec}': paged GQA attention in
float64 (kgen's reference semantics, docs/abi.md). Takes numpy arrays or torch tensors; returns
(output, lse) in the caller's library, output in q's dtype, lse float32 and base 2."""
import math

import numpy as np

PAGE_SIZE = {page}
NHD = {nhd}  # cache order: [num_pages, page_size, num_kv_heads, head_dim] (else [num_pages, num_kv_heads, page_size, head_dim])
CAUSAL = {causal}


{helpers}

def _gather(cache, pages, kv_len):
    rows = cache[pages]  # [n, page, H, D] or [n, H, page, D]
    if not NHD:
        rows = rows.transpose(0, 2, 1, 3)
    return rows.reshape(-1, rows.shape[2], rows.shape[3])[:kv_len]


def run({params}):
    qd, kd, vd = _f64(q), _f64(k_cache), _f64(v_cache)
{paging}
    rows, hq, dim = qd.shape
    group = hq // kd.shape[2 if NHD else 1]
    out = np.zeros((rows, hq, dim))
    lse = np.full((rows, hq), -np.inf)
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]]
        kv_len = (len(pages) - 1) * PAGE_SIZE + int(last[b]) if len(pages) else 0
        k = np.repeat(_gather(kd, pages, kv_len), group, axis=1)  # [kv_len, hq, dim]
        v = np.repeat(_gather(vd, pages, kv_len), group, axis=1)
        r0, r1 = int(q_starts[b]), int(q_starts[b + 1])
        if r1 == r0 or kv_len == 0:
            continue
        logits = np.einsum("rhd,khd->hrk", qd[r0:r1], k) * scale  # [hq, q_len, kv_len]
        w, lse[r0:r1] = _weights(logits, CAUSAL)
        out[r0:r1] = np.einsum("hrk,khd->rhd", w, v)
    if hasattr(q, "detach"):
        import torch

        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).to(torch.float32)
    return out.astype(np.asarray(q).dtype), lse.astype(np.float32)
'''


def reference_source(spec, params: list[str]) -> str:
    return _REFERENCE.format(name=definition_name(spec), spec=spec.name, nhd=spec.kv_cache.resolved_order == "NHD",
                             params=", ".join(params), helpers=REFERENCE_HELPERS, **reference_fields(spec))


_ENTRY = '''\
"""FlashInfer-Bench entry point of kgen's kernel for spec '{spec}' (exported by kgen fib export).

kernel.cu is the CUDA source kgen generated for spec.yaml (its ABI: docs/abi.md, `kgen abi spec.yaml`);
this file adapts FlashInfer-Bench's call ({adapts}) to it."""
import math
from pathlib import Path

import kgen
{imports}

HERE = Path(__file__).resolve().parent
SPEC = kgen.load_spec(HERE / "spec.yaml")
PAGE_SIZE = {page}
_kernel = None


def kernel():
    """kernel.cu, verified by kgen when kgen can load a source (kgen.load_source), else kgen's build of spec.yaml
    (the same source: kgen renders it from the spec)."""
    global _kernel
    if _kernel is None:
        load_source = getattr(kgen, "load_source", None)
        _kernel = load_source(SPEC, HERE / "kernel.cu") if load_source else kgen.build(SPEC)
    return _kernel


def check_scale(sm_scale):
    if not math.isclose(float(sm_scale), SPEC.softmax_scale_value, rel_tol=1e-6):
        raise ValueError(f"sm_scale={{float(sm_scale)}}: this kernel is built for {{SPEC.softmax_scale_value}}")


'''

_RUN = '''\
def run({params}):
    check_scale(sm_scale)
    pages = kv_indptr[1:] - kv_indptr[:-1]
    last = {last}
    block_tables, seq_lens = from_flashinfer(kv_indptr, kv_indices, last, PAGE_SIZE)
    out, lse = kernel()(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                        {extra}return_lse=True)
    return out, lse_to_base2(lse)
'''


def entry_source(spec) -> str:
    """main.py of the Solution: kgen's kernel behind the Definition's `run`."""
    page = spec.kv_cache.block_size
    if op_type(spec) == mla.OP_TYPE:
        imports, adapts, run = mla.entry_parts(spec)
    else:
        params = _inputs(spec)[1]
        last = "kv_last_page_len" if page > 1 else "(pages > 0) * PAGE_SIZE  # one token per page"
        extra = "q_indptr=qo_indptr, " if is_prefill(spec) else ""
        imports = "from kgen.interop import from_flashinfer, lse_to_base2"
        adapts = "kv_indptr/kv_indices page table, base-2 lse"
        run = _RUN.format(params=", ".join(params), last=last, extra=extra)
    return _ENTRY.format(spec=spec.name, page=page, imports=imports, adapts=adapts) + run


def spec_to_solution(spec, source: str, spec_yaml: str, name: str | None = None) -> dict[str, Any]:
    """A FlashInfer-Bench Solution holding kgen's kernel source, the spec and a Python entry point.
    `language: python` and `destination_passing_style: false`: FlashInfer-Bench imports main.py and takes
    what `run` returns (kgen builds kernel.cu itself; FlashInfer-Bench compiles a `cuda` Solution with its
    own binding, and by default passes the outputs in as arguments)."""
    entry = entry_source(spec)
    doc = {
        "name": name or solution_name(spec),
        "definition": definition_name(spec),
        "author": "kgen",
        "description": (f"kgen {__version__}'s generated CUDA kernel for spec '{spec.name}' (kernel.cu), called "
                        "through kgen (main.py adapts FlashInfer-Bench's arguments and base-2 lse)."),
        "spec": {"language": "python", "target_hardware": list(spec.targets), "entry_point": "main.py::run",
                 "dependencies": [f"kgen=={__version__}"], "destination_passing_style": False},
        "sources": [{"path": "main.py", "content": entry}, {"path": "kernel.cu", "content": source},
                    {"path": "spec.yaml", "content": spec_yaml}],
    }
    parse(Solution, doc, f"{doc['name']} (exported)")
    return doc
