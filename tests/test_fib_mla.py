"""kgen/fib/mla.py: FlashInfer-Bench `mla_paged` definitions (written here from FlashInfer-Bench's documented
format) to kgen's MLA specs and back; the exported reference against kgen's float64 reference and against a
reference in FlashInfer-Bench's style (torch, written here from the semantics its dataset's definitions state);
kgen's MLA kernel behind the exported Solution on the CPU backend; bad input refused naming the field."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import yaml
from conftest import ROOT, run_kgen

import kgen
from kgen.errors import KgenUserError
from kgen.families.attention.reference import attention_outputs
from kgen.fib.convert import (
    definition_to_spec,
    export_problems,
    spec_to_definition,
    spec_to_solution,
)
from kgen.fib.latent import latent_arguments
from kgen.fib.schema import Definition, Solution, Trace, parse
from kgen.fib.trace import case_traces
from kgen.interop import lse_to_base2, to_flashinfer
from kgen.render import render
from kgen.spec.models import load_spec, spec_from_dict
from kgen.verify.judge.report import CaseResult, VerificationReport

DECODE = ROOT / "specs" / "deepseek_v3_mla_decode.yaml"
PREFILL = ROOT / "specs" / "deepseek_v3_mla_prefill.yaml"
DEEPSEEK_SCALE = 1 / math.sqrt(192)  # qk_head_dim 192 (128 + 64), the scale FlashInfer-Bench's MLA descriptions name

# A reference in FlashInfer-Bench's style: torch, fp32, the request's tokens gathered page by page (its last page
# kv_last_page_len long), logits = (q_nope . ckv + q_pe . kpe) * sm_scale, causal prefill with the chunk at the end
# of the request, base-2 lse, output softmax . ckv in bf16; a request with no token: output 0, lse -inf.
FIB_STYLE_REFERENCE = '''
import math
import torch


@torch.no_grad()
def run(q_nope, q_pe, ckv_cache, kpe_cache, {prefill}kv_indptr, kv_indices, {last}sm_scale):
    rows, heads, dc = q_nope.shape
    page = ckv_cache.shape[1]
    batch = kv_indptr.shape[0] - 1
    starts = {starts}
    output = torch.zeros((rows, heads, dc), dtype=torch.bfloat16)
    lse = torch.full((rows, heads), -math.inf, dtype=torch.float32)
    for b in range(batch):
        ids = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        r0, r1 = int(starts[b]), int(starts[b + 1])
        if ids.numel() == 0 or r1 == r0:
            continue
        n = (ids.numel() - 1) * page + {last_len}
        kc = ckv_cache[ids].float().reshape(-1, dc)[:n]
        kp = kpe_cache[ids].float().reshape(-1, kpe_cache.shape[-1])[:n]
        s = (torch.einsum("rhd,nd->rhn", q_nope[r0:r1].float(), kc)
             + torch.einsum("rhd,nd->rhn", q_pe[r0:r1].float(), kp)) * sm_scale
        if {causal}:
            pos = n - (r1 - r0) + torch.arange(r1 - r0)
            s = s.masked_fill(torch.arange(n)[None, None, :] > pos[:, None, None], -math.inf)
        lse[r0:r1] = torch.logsumexp(s, dim=-1) / math.log(2.0)
        output[r0:r1] = (torch.softmax(s, dim=-1) @ kc).to(torch.bfloat16)
    return output, lse
'''


def fib_style_reference(prefill: bool, page: int, causal: bool = True) -> str:
    return FIB_STYLE_REFERENCE.format(
        prefill="qo_indptr, " if prefill else "", last="kv_last_page_len, " if page > 1 else "",
        starts="qo_indptr" if prefill else "torch.arange(batch + 1)",
        last_len="int(kv_last_page_len[b])" if page > 1 else "1", causal=prefill and causal)


def dataset_mla_decode(page: int = 1, heads: int = 16, ckv: int = 512, kpe: int = 64) -> dict:
    """mla_paged_decode_h16_ckv512_kpe64_ps1 as FlashInfer-Bench's dataset documents it (written here);
    page size 64 adds kv_last_page_len before sm_scale."""
    inputs = {
        "q_nope": {"shape": ["batch_size", "num_qo_heads", "head_dim_ckv"], "dtype": "bfloat16"},
        "q_pe": {"shape": ["batch_size", "num_qo_heads", "head_dim_kpe"], "dtype": "bfloat16"},
        "ckv_cache": {"shape": ["num_pages", "page_size", "head_dim_ckv"], "dtype": "bfloat16"},
        "kpe_cache": {"shape": ["num_pages", "page_size", "head_dim_kpe"], "dtype": "bfloat16"},
        "kv_indptr": {"shape": ["len_indptr"], "dtype": "int32"},
        "kv_indices": {"shape": ["num_kv_indices"], "dtype": "int32"},
    }
    if page > 1:
        inputs["kv_last_page_len"] = {"shape": ["batch_size"], "dtype": "int32"}
    inputs["sm_scale"] = {"shape": None, "dtype": "float32",
                          "description": "Softmax scale. Default is (1/sqrt(128 + 64) = 1/sqrt(192))."}
    return {
        "name": f"mla_paged_decode_h{heads}_ckv{ckv}_kpe{kpe}_ps{page}",
        "op_type": "mla_paged",
        "description": "Batched Multi-head Latent Attention decode with a paged KV cache.",
        "tags": ["stage:decode", "status:verified", "model:deepseek-v3"],
        "axes": {
            "batch_size": {"type": "var"}, "num_qo_heads": {"type": "const", "value": heads},
            "head_dim_ckv": {"type": "const", "value": ckv}, "head_dim_kpe": {"type": "const", "value": kpe},
            "page_size": {"type": "const", "value": page}, "num_pages": {"type": "var"},
            "len_indptr": {"type": "var"}, "num_kv_indices": {"type": "var"},
        },
        "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
        "inputs": inputs,
        "outputs": {"output": {"shape": ["batch_size", "num_qo_heads", "head_dim_ckv"], "dtype": "bfloat16"},
                    "lse": {"shape": ["batch_size", "num_qo_heads"], "dtype": "float32",
                            "description": "The 2-based log-sum-exp of attention logits."}},
        "reference": fib_style_reference(False, page),
    }


def dataset_mla_prefill(page: int = 1, **dims) -> dict:
    d = dataset_mla_decode(page, **dims)
    d["name"] = d["name"].replace("mla_paged_decode", "mla_paged_prefill_causal")
    d["tags"][0] = "stage:prefill"
    d["axes"]["total_q"] = {"type": "var"}
    d["constraints"] = ["total_q == qo_indptr[-1].item()", "num_kv_indices == kv_indptr[-1].item()"]
    for name in ("q_nope", "q_pe"):
        d["inputs"][name]["shape"][0] = "total_q"
    d["inputs"] = {k: v for k, v in d["inputs"].items() if k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache")} | {
        "qo_indptr": {"shape": ["len_indptr"], "dtype": "int32"}} | {
        k: v for k, v in d["inputs"].items() if k not in ("q_nope", "q_pe", "ckv_cache", "kpe_cache")}
    for name in ("output", "lse"):
        d["outputs"][name]["shape"][0] = "total_q"
    d["reference"] = fib_style_reference(True, page)
    return d


def _import(d: dict, sm_scale: float | None = DEEPSEEK_SCALE):
    return spec_from_dict(definition_to_spec(parse(Definition, d, "d.json"), "d.json", sm_scale))


def _comparable(spec) -> dict:
    return {k: v for k, v in spec.canonical().items() if k not in ("name", "targets", "tuning")}


def _run_of(source: str):
    namespace: dict = {}
    exec(compile(source, "<reference>", "exec"), namespace)  # noqa: S102 - text written here or exported by kgen
    return namespace["run"]


# ---- import ----------------------------------------------------------------------------------------------
def test_dataset_decode_definition_imports_as_kgens_latent_layout():
    spec = _import(dataset_mla_decode())
    a, kv = spec.attention, spec.kv_cache
    assert spec.kind == "paged_decode" and spec.name == "mla_paged_decode_h16_ckv512_kpe64_ps1"
    assert (a.num_q_heads, a.num_kv_heads, a.head_dim, spec.v_head_dim_value) == (16, 1, 576, 512)
    assert a.softmax_scale == pytest.approx(DEEPSEEK_SCALE)
    assert (kv.layout, kv.block_size, kv.dtype, spec.dtype.q, spec.dtype.resolved_out) == ("mla", 1, "bf16", "bf16",
                                                                                            "bf16")
    assert spec.tail_masking is True


@pytest.mark.parametrize("make, kind, page", [(dataset_mla_decode, "paged_decode", 64),
                                              (dataset_mla_prefill, "paged_prefill", 1),
                                              (dataset_mla_prefill, "paged_prefill", 64)])
def test_page_size_64_and_causal_prefill_definitions_import(make, kind, page):
    spec = _import(make(page, heads=8))
    assert spec.kind == kind and spec.kv_cache.block_size == page and spec.attention.num_q_heads == 8
    if kind == "paged_prefill":
        assert spec.attention.causal is True


def test_a_scale_constraint_stands_for_the_option_and_a_different_option_is_refused():
    d = dataset_mla_decode()
    d["constraints"].append("sm_scale == 0.13523378")
    assert _import(d, None).attention.softmax_scale == 0.13523378
    assert _import(d, 0.13523378).attention.softmax_scale == 0.13523378
    with pytest.raises(KgenUserError, match=r"sm_scale 0\.1 given, but its constraints fix sm_scale == 0\.13523378"):
        _import(d, 0.1)


def test_early_op_type_mla_with_an_mla_paged_name_imports():
    d = dataset_mla_decode()
    d["op_type"] = "mla"  # FlashInfer-Bench's early integration tests
    assert _import(d).kv_cache.layout == "mla"


@pytest.mark.parametrize("change, message", [
    (lambda d: None, "inputs.sm_scale: kgen builds an MLA kernel for one softmax scale"),
    (lambda d: d["inputs"]["ckv_cache"].update(dtype="float8_e4m3fn"),
     r"inputs.ckv_cache.dtype: float8_e4m3fn not supported .*dequantization scale"),
    (lambda d: d["inputs"]["q_nope"].update(dtype="float32"), r"inputs.q_nope.dtype: float32 not supported"),
    (lambda d: d["inputs"]["kpe_cache"].update(dtype="float16"), r"inputs.kpe_cache.dtype: must equal ckv_cache's"),
    (lambda d: d["inputs"].pop("q_pe"), r"inputs.q_pe: required for MLA decode"),
    (lambda d: d["inputs"].update(sparse_indices={"shape": ["batch_size"], "dtype": "int32"}),
     r"inputs.sparse_indices: kgen does not know this input"),
    (lambda d: d["inputs"]["kpe_cache"].update(shape=["num_pages", "head_dim_kpe", "page_size"]),
     r"inputs.kpe_cache.shape: expected \['num_pages', 'page_size', 'head_dim_kpe'\]"),
    (lambda d: d["axes"].update(head_dim_kpe={"type": "var"}), r"axes.head_dim_kpe: required as a const axis"),
    (lambda d: d["outputs"].update(extra={"shape": ["batch_size"], "dtype": "float32"}), r"outputs.extra"),
])
def test_what_kgen_cannot_take_is_refused_naming_the_field(change, message):
    d = dataset_mla_decode()
    change(d)
    with pytest.raises(KgenUserError, match=message):
        _import(d, None if "sm_scale" in message else DEEPSEEK_SCALE)


@pytest.mark.parametrize("axis, value, message", [
    ("page_size", 48, "kv_cache.block_size"),                   # not a power of two: kgen's spec check
    ("head_dim_ckv", 504, "the mla body takes head_dim and v_head_dim in whole k16 steps"),  # the family's
])
def test_what_kgens_spec_or_family_refuses_is_refused_at_import(axis, value, message):
    d = dataset_mla_decode()
    d["axes"][axis]["value"] = value
    with pytest.raises(KgenUserError, match=message):
        _import(d)


# ---- export ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, name", [(DECODE, "mla_paged_decode_h128_ckv512_kpe64_ps64"),
                                        (PREFILL, "mla_paged_prefill_causal_h128_ckv512_kpe64_ps64")])
def test_bundled_mla_specs_round_trip(path, name):
    spec = load_spec(path)
    doc = spec_to_definition(spec)
    assert doc["name"] == name and doc["op_type"] == "mla_paged"
    assert {k: v["value"] for k, v in doc["axes"].items() if v["type"] == "const"} == {
        "num_qo_heads": 128, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 64}
    assert list(doc["inputs"])[-2:] == ["kv_last_page_len", "sm_scale"]
    back = definition_to_spec(parse(Definition, json.loads(json.dumps(doc)), "x.json"), "x.json")
    assert _comparable(spec_from_dict(back)) == _comparable(spec)


def test_a_non_causal_fp16_prefill_keeps_both_in_its_name_and_round_trips():
    spec = load_spec(PREFILL).with_overrides(**{"attention.causal": False, "dtype.q": "fp16", "kv_cache.dtype": "fp16",
                                                "kv_cache.block_size": 1})
    doc = spec_to_definition(spec)
    assert doc["name"] == "mla_paged_prefill_h128_ckv512_kpe64_ps1_fp16" and "kv_last_page_len" not in doc["inputs"]
    back = definition_to_spec(parse(Definition, doc, "x.json"), "x.json")
    assert _comparable(spec_from_dict(back)) == _comparable(spec)


@pytest.mark.parametrize("overrides, message", [
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"}, "kv_cache.dtype fp8_e4m3: exported are fp16 and bf16"),
    ({"tail_masking": False}, "tail_masking: false"),
])
def test_mla_specs_without_a_definition_are_refused_with_the_reason(overrides, message):
    problems = export_problems(load_spec(DECODE).with_overrides(**overrides))
    assert len(problems) == 1 and problems[0].startswith(message), problems


# ---- the references --------------------------------------------------------------------------------------
def _small_spec(kind: str, block_size: int, causal: bool = True):
    spec = load_spec(DECODE if kind == "paged_decode" else PREFILL)
    over = {"attention.num_q_heads": 8, "attention.head_dim": 96, "attention.v_head_dim": 64,
            "attention.softmax_scale": 0.125, "kv_cache.block_size": block_size, "kv_cache.dtype": "fp16",
            "dtype.q": "fp16"}
    if kind == "paged_prefill":
        over["attention.causal"] = causal
    return spec.with_overrides(**over, tuning=None)


def fib_tensors(spec, rng, lib=np, dtype=np.float16, one_buffer=False):
    """A FlashInfer-Bench workload for `spec` (numpy or torch): requests of 5, 0, 9 and 1 tokens on shuffled pages
    (prefill: chunks of 3, 0, 9 and 1 rows at the end of each, the second a request with no rows and no tokens).
    `one_buffer`: ckv_cache and kpe_cache are views of one [num_pages, page_size, Dc + Dp] pool (SGLang's)."""
    B, H, D, Dv = spec.kv_cache.block_size, spec.attention.num_q_heads, spec.attention.head_dim, spec.v_head_dim_value
    seq_lens = np.array([5, 0, 9, 1], dtype=np.int32)
    width = -(-int(seq_lens.max()) // B)
    num_pages = len(seq_lens) * width + 3
    tables = rng.permutation(num_pages)[: len(seq_lens) * width].reshape(len(seq_lens), width).astype(np.int32)
    indptr, indices, last = to_flashinfer(tables, seq_lens, B)
    q_lens = np.array([3, 0, 9, 1]) if spec.kind == "paged_prefill" else np.ones(4, dtype=np.int64)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows = int(qo_indptr[-1])
    t = {"q_nope": rng.standard_normal((rows, H, Dv)), "q_pe": rng.standard_normal((rows, H, D - Dv)),
         "ckv_cache": rng.standard_normal((num_pages, B, Dv)), "kpe_cache": rng.standard_normal((num_pages, B, D - Dv))}
    t = {k: v.astype(dtype) for k, v in t.items()}
    if one_buffer:
        pool = np.concatenate([t["ckv_cache"], t["kpe_cache"]], axis=-1)
        t["ckv_cache"], t["kpe_cache"] = pool[..., :Dv], pool[..., Dv:]
    t |= {"qo_indptr": qo_indptr, "kv_indptr": indptr, "kv_indices": indices, "kv_last_page_len": last,
          "sm_scale": np.float32(spec.softmax_scale_value)}
    if lib is not np:
        t = {k: (lib.from_numpy(np.asarray(v)) if k != "sm_scale" else float(v)) for k, v in t.items()}
    return t


def _kgen_reference(spec, t):
    """kgen's float64 reference on the kgen arguments latent_arguments makes of FlashInfer-Bench's tensors."""
    call = latent_arguments(t["q_nope"], t["q_pe"], t["ckv_cache"], t["kpe_cache"], t["kv_indptr"], t["kv_indices"],
                            t["kv_last_page_len"], spec.kv_cache.block_size)
    args = {k: v for k, v in call.items() if k != "q"}
    if spec.kind == "paged_prefill":
        args["q_indptr"] = t["qo_indptr"]
    out, lse = attention_outputs(spec, call["q"], args)
    return out, lse_to_base2(lse)


@pytest.mark.parametrize("kind, block_size, causal", [("paged_decode", 1, True), ("paged_decode", 4, True),
                                                      ("paged_prefill", 1, True), ("paged_prefill", 4, False)])
def test_exported_reference_matches_kgens_reference_through_the_argument_mapping(kind, block_size, causal):
    spec = _small_spec(kind, block_size, causal)
    doc = spec_to_definition(spec)
    t = fib_tensors(spec, np.random.default_rng(0))
    out, lse = _run_of(doc["reference"])(**{name: t[name] for name in doc["inputs"]})
    ref_out, ref_lse = _kgen_reference(spec, t)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    if kind == "paged_decode":
        assert np.isneginf(lse[1]).all() and not out[1].any()  # the request with no tokens: lse -inf, output 0
    np.testing.assert_allclose(out.astype(np.float64), ref_out, rtol=2e-3, atol=2e-3)  # out rounded to fp16
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, block_size", [("paged_decode", 1), ("paged_prefill", 4)])
def test_exported_reference_matches_a_fib_style_reference_in_torch(kind, block_size):
    torch = pytest.importorskip("torch")
    spec = _small_spec(kind, block_size).with_overrides(**{"kv_cache.dtype": "bf16", "dtype.q": "bf16"})
    doc = spec_to_definition(spec)
    t = fib_tensors(spec, np.random.default_rng(1), lib=torch, dtype=np.float32)
    t = {k: (v.to(torch.bfloat16) if k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache") else v) for k, v in t.items()}
    call = {name: t[name] for name in doc["inputs"]}
    out, lse = _run_of(doc["reference"])(**call)
    fib_out, fib_lse = _run_of(fib_style_reference(kind == "paged_prefill", block_size))(**call)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(fib_lse))
    torch.testing.assert_close(out.float(), fib_out.float(), rtol=1e-2, atol=1e-2)  # two bf16 roundings
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse[finite], fib_lse[finite], rtol=1e-5, atol=1e-5)


# ---- kgen's kernel behind the Solution -------------------------------------------------------------------
def _solution_main(spec, tmp_path):
    """The exported Solution's sources written out and its main.py imported (as FlashInfer-Bench would)."""
    doc = spec_to_solution(spec, render(spec).source, yaml.safe_dump(spec.canonical()))
    parse(Solution, doc, "sol")
    for s in doc["sources"]:
        (tmp_path / s["path"]).write_text(s["content"])
    module_spec = importlib.util.spec_from_file_location(f"fib_main_{spec.kind}", tmp_path / "main.py")
    main = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(main)
    return main


@pytest.mark.parametrize("kind, block_size, one_buffer", [("paged_decode", 4, True), ("paged_prefill", 1, False)])
def test_solution_runs_kgens_kernel_on_fib_tensors_against_both_references(kind, block_size, one_buffer, tmp_path):
    """main.py's run on FlashInfer-Bench's tensors (ckv/kpe in one pool, read in place; or apart, joined) against
    the Definition's reference and kgen's float64 reference; an sm_scale other than the kernel's is refused."""
    spec = _small_spec(kind, block_size)
    main = _solution_main(spec, tmp_path)
    main._kernel = kgen.build(main.SPEC, backend="cpu", verify=False, archs=[])  # kgen's build of spec.yaml
    doc = spec_to_definition(spec)
    t = fib_tensors(spec, np.random.default_rng(2), one_buffer=one_buffer)
    call = {name: t[name] for name in doc["inputs"]}
    out, lse = main.run(**call)
    ref_out, ref_lse = _run_of(doc["reference"])(**call)
    k_out, k_lse = _kgen_reference(spec, t)
    same = np.isneginf(lse) & np.isneginf(k_lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(k_lse))
    assert np.abs(out.astype(np.float64) - k_out).max() < 2e-3  # fp16 kernel output against float64
    assert np.abs(out.astype(np.float64) - ref_out.astype(np.float64)).max() < 4e-3
    assert np.abs(np.where(same, 0.0, lse - np.where(same, 0.0, k_lse))).max() < 1e-3
    with pytest.raises(ValueError, match="sm_scale=0.5: this kernel is built for 0.125"):
        main.run(**{**call, "sm_scale": 0.5})


@pytest.mark.full  # a bf16 MLA prefill build on the CPU backend (~25 s); the default tier keeps the Solution test
def test_an_imported_dataset_definition_runs_kgens_kernel_against_its_own_reference():
    """The whole loop from FlashInfer-Bench's side: its definition imported, kgen's kernel built from the spec
    (CPU backend), called on its workload's torch tensors through latent_arguments, judged by the
    definition's own reference (FlashInfer-Bench's style, bf16 output)."""
    torch = pytest.importorskip("torch")
    d = parse(Definition, dataset_mla_prefill(4, heads=8, ckv=64, kpe=32), "d.json")
    spec = spec_from_dict(definition_to_spec(d, "d.json", 0.125))
    kern = kgen.build(spec, backend="cpu", verify=False, archs=[])
    t = fib_tensors(spec, np.random.default_rng(3), lib=torch, dtype=np.float32)
    t = {k: (v.to(torch.bfloat16) if k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache") else v) for k, v in t.items()}
    call = latent_arguments(t["q_nope"], t["q_pe"], t["ckv_cache"], t["kpe_cache"], t["kv_indptr"], t["kv_indices"],
                            t["kv_last_page_len"], 4)
    out, lse = kern(**call, q_indptr=t["qo_indptr"], return_lse=True)
    want_out, want_lse = _run_of(d.reference)(**{name: t[name] for name in d.inputs})
    assert out.dtype == torch.bfloat16 and out.shape == want_out.shape
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)  # bf16 outputs of two fp32 sums
    torch.testing.assert_close(lse_to_base2(lse), want_lse, rtol=1e-4, atol=1e-4)


# ---- traces ----------------------------------------------------------------------------------------------
def test_traces_of_an_mla_spec_name_its_definition_and_fib_inputs():
    spec = load_spec(PREFILL)
    report = VerificationReport(spec.name, "cpu", 3, {}, [CaseResult("ok", [70, 1], 1e-4, 1e-3, True)])
    (trace,) = case_traces(report, spec, "kgen_deepseek_v3_mla_prefill")
    parse(Trace, json.loads(json.dumps(trace, allow_nan=False)), "t")
    assert trace["definition"] == "mla_paged_prefill_causal_h128_ckv512_kpe64_ps64"
    assert list(trace["workload"]["inputs"]) == list(spec_to_definition(spec)["inputs"])
    assert trace["workload"]["axes"] == {"len_indptr": 3, "num_kv_indices": 3, "batch_size": 2}


# ---- the command line ------------------------------------------------------------------------------------
def test_cli_imports_a_dataset_definition_with_the_models_scale_and_refuses_one_without(tmp_path):
    src = tmp_path / "mla_paged_decode_h16_ckv512_kpe64_ps1.json"
    src.write_text(json.dumps(dataset_mla_decode()))
    out = tmp_path / "spec.yaml"
    r = run_kgen("fib", "import", str(src), "-o", str(out))
    assert r.returncode == 2 and "inputs.sm_scale" in r.stderr and "--sm-scale" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    r = run_kgen("fib", "import", str(src), "-o", str(out), "--sm-scale", str(DEEPSEEK_SCALE))
    assert r.returncode == 0, r.stderr
    spec = load_spec(out)
    assert spec.kv_cache.layout == "mla" and spec.attention.softmax_scale == pytest.approx(DEEPSEEK_SCALE)


def test_cli_exports_an_mla_spec_in_fib_dataset_layout_and_imports_it_back(tmp_path):
    r = run_kgen("fib", "export", str(DECODE), "-o", str(tmp_path / "fib"))
    assert r.returncode == 0, r.stderr
    (def_path,) = (tmp_path / "fib" / "definitions" / "mla_paged").glob("*.json")
    (sol_path,) = (tmp_path / "fib" / "solutions" / "mla_paged" / def_path.stem).glob("*.json")
    assert def_path.stem == "mla_paged_decode_h128_ckv512_kpe64_ps64"
    sol = parse(Solution, sol_path.read_text(), str(sol_path))
    assert "latent_arguments" in next(s.content for s in sol.sources if s.path == "main.py")
    r = run_kgen("fib", "import", str(def_path), "-o", str(tmp_path / "back.yaml"))
    assert r.returncode == 0, r.stderr
    assert _comparable(load_spec(tmp_path / "back.yaml")) == _comparable(load_spec(DECODE))
