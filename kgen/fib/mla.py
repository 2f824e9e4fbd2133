"""FlashInfer-Bench `mla_paged` Definitions to kgen's MLA specs and back (docs/interop.md §6).

FlashInfer-Bench's MLA (its docs/op-types/mla-paged.mdx and dataset definitions such as
`mla_paged_decode_h16_ckv512_kpe64_ps1`): const axes `num_qo_heads`, `head_dim_ckv` (the latent,
512 for DeepSeek-V3), `head_dim_kpe` (the rope part, 64), `page_size`; inputs `q_nope` [rows,
num_qo_heads, head_dim_ckv], `q_pe` [rows, num_qo_heads, head_dim_kpe], `ckv_cache` [num_pages,
page_size, head_dim_ckv], `kpe_cache` [num_pages, page_size, head_dim_kpe], `kv_indptr`, `kv_indices`
(prefill: `qo_indptr` first; page size 64: `kv_last_page_len`), `sm_scale`; outputs `output` [rows,
num_qo_heads, head_dim_ckv] and a base-2 `lse` [rows, num_qo_heads]. The logits are sm_scale * (q_nope .
ckv + q_pe . kpe), the output the softmax times ckv; prefill is causal with the chunk at the end of
the request (row i of q_len sees keys 0 .. kv_len - q_len + i).

kgen's MLA spec is the same attention over one latent row per token: `kv_cache.layout: mla`,
num_kv_heads 1, head_dim = head_dim_ckv + head_dim_kpe, v_head_dim = head_dim_ckv, and the softmax
scale fixed in the spec (it must be the model's, so an import needs it: a `sm_scale == <number>`
constraint or `kgen fib import --sm-scale`). The call's tensors map through kgen/fib/latent.py.
"""

from __future__ import annotations

from typing import Any

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
    paged_definition,
    paging_inputs,
    reference_fields,
    refuse,
    spec_name,
    what_it_computes,
)
from kgen.fib.schema import Definition

OP_TYPE = "mla_paged"
CONST_AXES = ("num_qo_heads", "head_dim_ckv", "head_dim_kpe", "page_size")
FLOAT_DTYPES = ("float16", "bfloat16")  # what kgen's MLA kernels take for q and the cache (tensor-core operands)


def is_mla_definition(d: Definition) -> bool:
    """op_type mla_paged (FlashInfer-Bench's early tests called it `mla`, with mla_paged_* names)."""
    return d.op_type == OP_TYPE or (d.op_type == "mla" and d.name.startswith(f"{OP_TYPE}_"))


# ---- import ------------------------------------------------------------------------------------------
def definition_problems(d: Definition, sm_scale: float | None, origin: str = "") -> list[str]:
    """Why kgen cannot build this mla_paged Definition (empty: it can); each names its field."""
    problems = [f"axes.{a}: required as a const axis (kgen specializes on it)" for a in CONST_AXES
                if d.const(a) is None]
    prefill = definition_is_prefill(d)
    needed = ["q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices"] + (["qo_indptr"] if prefill else [])
    problems += io_problems(d, needed, f"MLA {'prefill' if prefill else 'decode'}")
    for n in ("q_nope", "q_pe", "ckv_cache", "kpe_cache"):
        t = d.inputs.get(n)
        if t is not None and t.dtype not in FLOAT_DTYPES:
            why = (" (kgen's fp8 MLA caches need a dequantization scale, which this definition does not carry)"
                   if t.dtype.startswith("float8") else " (kgen's MLA kernels multiply fp16 or bf16 on tensor cores)")
            problems.append(f"inputs.{n}.dtype: {t.dtype} not supported (allowed: {', '.join(FLOAT_DTYPES)}){why}")
    for a, b, what in (("q_nope", "q_pe", "one query dtype"), ("ckv_cache", "kpe_cache", "one cache dtype")):
        if a in d.inputs and b in d.inputs and d.inputs[a].dtype != d.inputs[b].dtype:
            problems.append(f"inputs.{b}.dtype: must equal {a}'s (kgen has {what}: the latent row is one array)")
    if "output" in d.outputs and d.outputs["output"].dtype not in DTYPES:
        problems.append(f"outputs.output.dtype: {d.outputs['output'].dtype} not supported "
                        f"(allowed: {', '.join(DTYPES)})")
    problems += _shape_problems(d)
    if chosen_scale(d, sm_scale, origin) is None:
        problems.append("inputs.sm_scale: kgen builds an MLA kernel for one softmax scale, the model's (e.g. "
                        "1/sqrt(192) = 0.0721688 for DeepSeek-V3's qk_head_dim 192, before any YaRN factor), and this "
                        "definition fixes none: give it with `kgen fib import --sm-scale <number>` or a constraint "
                        "`sm_scale == <number>`")
    return problems


def _shape_problems(d: Definition) -> list[str]:
    rows = "total_q" if definition_is_prefill(d) else "batch_size"
    expected = {("inputs", "q_nope"): [rows, "num_qo_heads", "head_dim_ckv"],
                ("inputs", "q_pe"): [rows, "num_qo_heads", "head_dim_kpe"],
                ("inputs", "ckv_cache"): ["num_pages", "page_size", "head_dim_ckv"],
                ("inputs", "kpe_cache"): ["num_pages", "page_size", "head_dim_kpe"],
                ("outputs", "output"): [rows, "num_qo_heads", "head_dim_ckv"],
                ("outputs", "lse"): [rows, "num_qo_heads"]}
    out = []
    for (where, name), shape in expected.items():
        t = getattr(d, where).get(name)
        got = None if t is None else list(t.shape or [])
        # the rows axis goes by the definition's own name; the others are what kgen's layout reads
        if got is not None and (len(got) != len(shape) or got[1:] != shape[1:]):
            out.append(f"{where}.{name}.shape: expected {shape}, got {got}")
    return out


def definition_to_spec(d: Definition, origin: str, sm_scale: float | None = None) -> dict[str, Any]:
    """The kgen MLA spec (a dict, validated and buildable) for an mla_paged Definition; KgenUserError with
    every reason it cannot."""
    refuse(d, origin, definition_problems(d, sm_scale, origin))
    ckv, kpe = d.const("head_dim_ckv"), d.const("head_dim_kpe")
    prefill = definition_is_prefill(d)
    attention: dict[str, Any] = {"num_q_heads": d.const("num_qo_heads"), "num_kv_heads": 1, "head_dim": ckv + kpe,
                                 "v_head_dim": ckv, "softmax_scale": chosen_scale(d, sm_scale)}
    if prefill:
        attention["causal"] = "causal" in d.name
    data = {
        "kgen": 1, "name": spec_name(d.name), "kind": "paged_prefill" if prefill else "paged_decode",
        "attention": attention,
        "kv_cache": {"block_size": d.const("page_size"), "layout": "mla", "dtype": DTYPES[d.inputs["ckv_cache"].dtype]},
        "dtype": {"q": DTYPES[d.inputs["q_nope"].dtype], "out": DTYPES[d.outputs["output"].dtype]},
        "tail_masking": True,
    }
    return checked_spec(data, d, origin)


# ---- export ------------------------------------------------------------------------------------------
def export_problems(spec) -> list[str]:
    """Why an MLA spec has no mla_paged Definition (empty: it has one). What kgen's MLA family refuses to
    build (windows, soft caps, sinks, fp32) never gets here."""
    problems = []
    if getattr(spec.attention, "sparse_topk", None):
        problems.append("attention.sparse_topk: FlashInfer-Bench's mla_paged definitions attend densely (its top-k "
                        "attention is op_type dsa_paged, which kgen does not export)")
    return problems + export_format_problems(spec, OP_TYPE, "fp16 and bf16 latent caches")


def definition_name(spec) -> str:
    """FlashInfer-Bench's naming: mla_paged_decode_h16_ckv512_kpe64_ps1, mla_paged_prefill_causal_..."""
    a, dv = spec.attention, spec.v_head_dim_value
    what = fib_kind(spec) + ("_causal" if is_prefill(spec) and a.causal else "")
    return dtype_suffix(spec, f"{what}_h{a.num_q_heads}_ckv{dv}_kpe{a.head_dim - dv}_ps{spec.kv_cache.block_size}")


def inputs(spec) -> tuple[dict[str, Any], list[str]]:
    """(inputs, names in `run`'s parameter order: FlashInfer-Bench's)."""
    rows = "total_q" if is_prefill(spec) else "batch_size"
    q_t, kv_t = FIB_DTYPES[spec.dtype.q], FIB_DTYPES[spec.kv_cache.dtype]
    out: dict[str, Any] = {
        "q_nope": {"shape": [rows, "num_qo_heads", "head_dim_ckv"], "dtype": q_t,
                   "description": "absorbed query, latent part (q_nope times W_UK)"},
        "q_pe": {"shape": [rows, "num_qo_heads", "head_dim_kpe"], "dtype": q_t, "description": "query rope part"},
        "ckv_cache": {"shape": ["num_pages", "page_size", "head_dim_ckv"], "dtype": kv_t,
                      "description": "paged compressed KV (the latent: K's first part and V)"},
        "kpe_cache": {"shape": ["num_pages", "page_size", "head_dim_kpe"], "dtype": kv_t,
                      "description": "paged rope keys (K's second part)"},
        **paging_inputs(spec),
    }
    return out, list(out)


def spec_to_definition(spec) -> dict[str, Any]:
    """The mla_paged Definition of an exportable MLA spec (a dict, validated against the schema)."""
    a, dv, page = spec.attention, spec.v_head_dim_value, spec.kv_cache.block_size
    tensors, params = inputs(spec)
    return paged_definition(
        spec, definition_name(spec), OP_TYPE,
        const_axes={"num_qo_heads": a.num_q_heads, "head_dim_ckv": dv, "head_dim_kpe": a.head_dim - dv,
                    "page_size": page},
        description=(f"Paged MLA {what_it_computes(spec)} (absorbed): {a.num_q_heads} query heads over one latent "
                     f"row per token, head_dim_ckv {dv}, head_dim_kpe {a.head_dim - dv}, {page} tokens per page; "
                     "lse is base 2."),
        inputs=tensors, out_dim="head_dim_ckv", reference=reference_source(spec, params))


_REFERENCE = '''\
"""FlashInfer-Bench reference for {name}, exported by kgen from spec '{spec}': paged MLA attention (absorbed
form) in float64, kgen's reference semantics (docs/abi.md "MLA"): a query head's logits are
sm_scale * (q_nope . ckv + q_pe . kpe) over its request's tokens, its output the softmax times ckv{causal_doc}.
Takes numpy arrays or torch tensors; returns (output, lse) in the caller's library, output in
{out_dtype} (numpy: q_nope's dtype), lse float32 and base 2; a row that sees no token: output 0, lse -inf."""
import math

import numpy as np

PAGE_SIZE = {page}
CAUSAL = {causal}
OUT_DTYPE = "{out_dtype}"


{helpers}

def _tokens(cache, pages, kv_len):
    """One request's rows [kv_len, dim] of a [num_pages, page_size, dim] cache."""
    return cache[pages].reshape(-1, cache.shape[-1])[:kv_len]


def run({params}):
    qn, qp, ckv, kpe = _f64(q_nope), _f64(q_pe), _f64(ckv_cache), _f64(kpe_cache)
{paging}
    rows, heads, dim = qn.shape
    out = np.zeros((rows, heads, dim))
    lse = np.full((rows, heads), -np.inf)
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]]
        kv_len = (len(pages) - 1) * PAGE_SIZE + int(last[b]) if len(pages) else 0
        r0, r1 = int(q_starts[b]), int(q_starts[b + 1])
        if r1 == r0 or kv_len == 0:
            continue
        kc, kp = _tokens(ckv, pages, kv_len), _tokens(kpe, pages, kv_len)
        logits = (np.einsum("rhd,kd->hrk", qn[r0:r1], kc) + np.einsum("rhd,kd->hrk", qp[r0:r1], kp)) * scale
        w, lse[r0:r1] = _weights(logits, CAUSAL)
        out[r0:r1] = np.einsum("hrk,kd->rhd", w, kc)
    if hasattr(q_nope, "detach"):
        import torch

        return torch.from_numpy(out).to(getattr(torch, OUT_DTYPE)), torch.from_numpy(lse).to(torch.float32)
    return out.astype(np.asarray(q_nope).dtype), lse.astype(np.float32)
'''


def reference_source(spec, params: list[str]) -> str:
    fields = reference_fields(spec)
    return _REFERENCE.format(name=definition_name(spec), spec=spec.name, params=", ".join(params),
                             out_dtype=FIB_DTYPES[spec.dtype.resolved_out], helpers=REFERENCE_HELPERS,
                             causal_doc=(", causal with the chunk at the end of the request" if fields["causal"] else ""),
                             **fields)


_RUN = '''\
def run({params}):
    check_scale(sm_scale)
    call = latent_arguments(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, {last}, PAGE_SIZE)
    out, lse = kernel()(**call, {extra}return_lse=True)
    return out, lse_to_base2(lse)
'''


def entry_parts(spec) -> tuple[str, str, str]:
    """(imports, what main.py adapts, its run) for kgen/fib/convert.py's Solution entry point."""
    params = inputs(spec)[1]
    last = "kv_last_page_len" if spec.kv_cache.block_size > 1 else "None"
    extra = "q_indptr=qo_indptr, " if is_prefill(spec) else ""
    return ("from kgen.fib.latent import latent_arguments\nfrom kgen.interop import lse_to_base2",
            "q_nope/q_pe, ckv_cache/kpe_cache joined into kgen's latent rows (kgen/fib/latent.py), the "
            "kv_indptr/kv_indices page table, base-2 lse",
            _RUN.format(params=", ".join(params), last=last, extra=extra))
