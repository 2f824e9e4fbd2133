"""FlashInfer-Bench interop (kgen/fib/, `kgen fib import|export`, `kgen verify --trace`): the schema
models, a dataset-style definition written here from FlashInfer-Bench's documented format, the
round trip spec -> Definition -> spec, the exported reference run against kgen's float64 reference,
and bad input refused with exit 2 and nothing written."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import yaml
from conftest import ROOT, TINY_DECODE, run_kgen, run_python, write_spec

from kgen.errors import KgenUserError
from kgen.families.attention.reference import attention_outputs
from kgen.fib.convert import (
    definition_to_spec,
    export_problems,
    spec_to_definition,
    spec_to_solution,
)
from kgen.fib.schema import Definition, Solution, Trace, parse
from kgen.fib.trace import case_traces, status_of
from kgen.interop import lse_to_base2, to_flashinfer
from kgen.spec.models import load_spec, spec_from_dict
from kgen.verify.judge.report import CaseResult, VerificationReport

LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"
PREFILL = ROOT / "specs" / "llama3_8b_prefill.yaml"

REFERENCE = "import torch\n\ndef run(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale):\n    return q, None\n"


def dataset_decode() -> dict:
    """gqa_paged_decode_h32_kv8_d128_ps1 as FlashInfer-Bench's dataset documents it (written here)."""
    return {
        "name": "gqa_paged_decode_h32_kv8_d128_ps1",
        "op_type": "gqa_paged",
        "description": "Batched GQA decode with a paged KV cache (page size 1).",
        "tags": ["stage:decode", "status:verified", "model:llama-3.1-8b"],
        "axes": {
            "batch_size": {"type": "var"}, "num_qo_heads": {"type": "const", "value": 32},
            "num_kv_heads": {"type": "const", "value": 8}, "head_dim": {"type": "const", "value": 128},
            "num_pages": {"type": "var"}, "page_size": {"type": "const", "value": 1},
            "len_indptr": {"type": "var"}, "num_kv_indices": {"type": "var"},
        },
        "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1]"],
        "inputs": {
            "q": {"shape": ["batch_size", "num_qo_heads", "head_dim"], "dtype": "bfloat16"},
            "k_cache": {"shape": ["num_pages", "page_size", "num_kv_heads", "head_dim"], "dtype": "bfloat16"},
            "v_cache": {"shape": ["num_pages", "page_size", "num_kv_heads", "head_dim"], "dtype": "bfloat16"},
            "kv_indptr": {"shape": ["len_indptr"], "dtype": "int32"},
            "kv_indices": {"shape": ["num_kv_indices"], "dtype": "int32"},
            "sm_scale": {"shape": None, "dtype": "float32"},
        },
        "outputs": {
            "output": {"shape": ["batch_size", "num_qo_heads", "head_dim"], "dtype": "bfloat16"},
            "lse": {"shape": ["batch_size", "num_qo_heads"], "dtype": "float32"},
        },
        "reference": REFERENCE,
    }


def dataset_prefill() -> dict:
    d = dataset_decode()
    d["name"] = "gqa_paged_prefill_causal_h32_kv8_d128_ps1"
    d["axes"]["total_q"] = {"type": "var"}
    d["inputs"] = {"q": {"shape": ["total_q", "num_qo_heads", "head_dim"], "dtype": "bfloat16"},
                   "qo_indptr": {"shape": ["len_indptr"], "dtype": "int32"}, **{
                       k: v for k, v in d["inputs"].items() if k != "q"}}
    d["outputs"]["output"]["shape"][0] = "total_q"
    d["outputs"]["lse"]["shape"][0] = "total_q"
    return d


def _comparable(data: dict) -> dict:
    """A spec's canonical form without what a Definition does not carry (name, targets, tuning)."""
    spec = spec_from_dict(data) if isinstance(data, dict) else data
    return {k: v for k, v in spec.canonical().items() if k not in ("name", "targets", "tuning")}


# ---- import ----------------------------------------------------------------------------------------------
def test_dataset_decode_definition_imports():
    data = definition_to_spec(parse(Definition, dataset_decode(), "def.json"), "def.json")
    spec = spec_from_dict(data)
    assert spec.kind == "paged_decode" and spec.name == "gqa_paged_decode_h32_kv8_d128_ps1"
    a, kv = spec.attention, spec.kv_cache
    assert (a.num_q_heads, a.num_kv_heads, a.head_dim, a.softmax_scale) == (32, 8, 128, "auto")
    assert (kv.block_size, kv.layout, kv.resolved_order, kv.dtype) == (1, "separate", "NHD", "bf16")
    assert (spec.dtype.q, spec.dtype.resolved_out, spec.tail_masking) == ("bf16", "bf16", True)


def test_dataset_ps64_decode_definition_with_last_page_len_imports():
    d = dataset_decode()
    d["name"] = "gqa_paged_decode_h32_kv8_d128_ps64"
    d["axes"]["page_size"]["value"] = 64
    d["inputs"] = {**{k: v for k, v in d["inputs"].items() if k != "sm_scale"},
                   "kv_last_page_len": {"shape": ["batch_size"], "dtype": "int32"},
                   "sm_scale": {"shape": [], "dtype": "float32"}}
    spec = spec_from_dict(definition_to_spec(parse(Definition, d, "d.json"), "d.json"))
    assert spec.kv_cache.block_size == 64 and spec.kind == "paged_decode"


def test_dataset_prefill_definition_imports_causal():
    data = definition_to_spec(parse(Definition, dataset_prefill(), "p.json"), "p.json")
    spec = spec_from_dict(data)
    assert spec.kind == "paged_prefill" and spec.attention.causal is True


def test_older_type_field_and_a_scale_constraint():
    d = dataset_decode()
    d["type"] = d.pop("op_type")
    d["constraints"].append("sm_scale == 0.125")
    spec = spec_from_dict(definition_to_spec(parse(Definition, d, "d.json"), "d.json"))
    assert spec.attention.softmax_scale == 0.125


def test_a_given_scale_is_built_for_and_one_against_the_constraint_is_refused():
    d = parse(Definition, dataset_decode(), "d.json")
    assert spec_from_dict(definition_to_spec(d, "d.json", 0.1)).attention.softmax_scale == 0.1
    assert spec_from_dict(definition_to_spec(d, "d.json", 128 ** -0.5)).attention.softmax_scale == "auto"
    fixed = dataset_decode()
    fixed["constraints"].append("sm_scale == 0.125")
    with pytest.raises(KgenUserError, match=r"sm_scale 0\.1 given, but its constraints fix sm_scale == 0\.125"):
        definition_to_spec(parse(Definition, fixed, "d.json"), "d.json", 0.1)


@pytest.mark.parametrize("spec_path", [LLAMA, PREFILL])
def test_round_trip_export_import_gives_an_equivalent_spec(spec_path):
    spec = load_spec(spec_path)
    doc = spec_to_definition(spec)
    back = definition_to_spec(parse(Definition, json.loads(json.dumps(doc)), "x.json"), "x.json")
    assert _comparable(back) == _comparable(spec)
    assert doc["name"] == ("gqa_paged_decode_h32_kv8_d128_ps16_fp16" if spec.kind == "paged_decode"
                           else "gqa_paged_prefill_causal_h32_kv8_d128_ps16_fp16")


def test_round_trip_keeps_a_numeric_scale_and_hnd():
    spec = load_spec(LLAMA).with_overrides(**{"attention.softmax_scale": 0.1, "kv_cache.order": "HND",
                                              "kv_cache.dtype": "bf16", "dtype.q": "bf16", "dtype.out": "bf16"})
    doc = spec_to_definition(spec)
    assert doc["name"] == "gqa_paged_decode_h32_kv8_d128_ps16"  # bf16: FlashInfer-Bench's own naming
    assert "sm_scale == 0.1" in doc["constraints"]
    back = definition_to_spec(parse(Definition, doc, "x.json"), "x.json")
    assert _comparable(back) == _comparable(spec)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(op_type="mla_ragged", name="mla_ragged_prefill_causal_h16_ckv512_kpe64"),
     "kgen imports paged attention only"),
    (lambda d: d.update(op_type="rmsnorm", name="rmsnorm_h4096"), "kgen imports paged attention only"),
    (lambda d: d["inputs"]["k_cache"].update(dtype="float8_e4m3"), "need a dequantization scale"),
    (lambda d: d["inputs"]["k_cache"].update(dtype="float8_e4m3fn"), "need a dequantization scale"),
    (lambda d: d["inputs"].update(alibi_slopes={"shape": ["num_qo_heads"], "dtype": "float32"}),
     "inputs.alibi_slopes: kgen does not know this input"),
    (lambda d: d["axes"]["head_dim"].update(value=1000), "head_dim"),
    (lambda d: d["inputs"]["k_cache"].update(shape=["num_pages", "head_dim", "page_size", "num_kv_heads"]),
     "not a paged cache kgen reads"),
])
def test_unsupported_definitions_are_refused_with_the_reason(change, message):
    d = dataset_decode()
    change(d)
    with pytest.raises(KgenUserError, match=message):
        definition_to_spec(parse(Definition, d, "d.json"), "d.json")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("reference"), "reference: required field is missing"),
    (lambda d: d.update(axes="batch_size"), "axes"),
    (lambda d: d["axes"]["num_qo_heads"].update(value="32"), "axes.num_qo_heads"),
    (lambda d: d["inputs"]["q"].update(dtype="float64"), "inputs.q.dtype"),
    (lambda d: d["inputs"]["q"].update(shape=["batch_size", "heads", "head_dim"]), "axis 'heads' is not in axes"),
    (lambda d: d.update(reference="def run(:\n"), "not valid Python"),
])
def test_malformed_definitions_name_the_field(change, message):
    d = dataset_decode()
    change(d)
    with pytest.raises(KgenUserError, match=message):
        parse(Definition, d, "d.json")


# ---- the exported reference ------------------------------------------------------------------------------
def _load_reference(source: str):
    namespace: dict = {}
    exec(compile(source, "<fib reference>", "exec"), namespace)  # noqa: S102 - kgen's own exported text
    return namespace["run"]


@pytest.mark.parametrize("kind", ["paged_decode", "paged_prefill"])
@pytest.mark.parametrize("block_size, order", [(1, "NHD"), (4, "HND")])
def test_exported_reference_runs_and_matches_kgen_reference(kind, block_size, order):
    base = load_spec(LLAMA if kind == "paged_decode" else PREFILL)
    spec = base.with_overrides(**{"attention.num_q_heads": 4, "attention.num_kv_heads": 2, "attention.head_dim": 32,
                                  "kv_cache.block_size": block_size, "kv_cache.order": order,
                                  "kv_cache.dtype": "fp32", "dtype.q": "fp32", "dtype.out": "fp32"}, tuning=None)
    doc = spec_to_definition(spec)
    run = _load_reference(doc["reference"])
    rng = np.random.default_rng(0)
    seq_lens = np.array([5, 0, 9, 1], dtype=np.int32)
    width = -(-int(seq_lens.max()) // block_size)
    num_blocks = len(seq_lens) * width + 3
    tables = rng.permutation(num_blocks)[: len(seq_lens) * width].reshape(len(seq_lens), width).astype(np.int32)
    shape = (num_blocks, block_size, 2, 32) if order == "NHD" else (num_blocks, 2, block_size, 32)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    if kind == "paged_prefill":
        q_lens = np.array([3, 0, 9, 1])
        q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    else:
        q_indptr = np.arange(len(seq_lens) + 1, dtype=np.int32)
    q = rng.standard_normal((int(q_indptr[-1]), 4, 32)).astype(np.float32)
    args = {"k_cache": k, "v_cache": v, "block_tables": tables, "seq_lens": seq_lens}
    if kind == "paged_prefill":
        args["q_indptr"] = q_indptr
    ref_out, ref_lse = attention_outputs(spec, q, args)
    indptr, indices, last = to_flashinfer(tables, seq_lens, block_size)
    call = {"q": q, "k_cache": k, "v_cache": v, "kv_indptr": indptr, "kv_indices": indices,
            "kv_last_page_len": last, "qo_indptr": q_indptr, "sm_scale": np.float32(spec.softmax_scale_value)}
    out, lse = run(**{name: call[name] for name in doc["inputs"]})
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, lse_to_base2(ref_lse), rtol=1e-5, atol=1e-5)  # FlashInfer's lse is base 2


def test_exported_reference_takes_torch_tensors():
    torch = pytest.importorskip("torch")
    spec = load_spec(LLAMA).with_overrides(**{"attention.num_q_heads": 2, "attention.num_kv_heads": 1,
                                              "attention.head_dim": 32, "kv_cache.block_size": 1,
                                              "kv_cache.dtype": "bf16", "dtype.q": "bf16", "dtype.out": "bf16"},
                                           tuning=None)
    run = _load_reference(spec_to_definition(spec)["reference"])
    q = torch.randn(2, 2, 32, dtype=torch.bfloat16)
    cache = torch.randn(6, 1, 1, 32, dtype=torch.bfloat16)
    out, lse = run(q, cache, cache, torch.tensor([0, 2, 6], dtype=torch.int32),
                   torch.arange(6, dtype=torch.int32), 0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 2, 32) and lse.dtype == torch.float32
    assert torch.isfinite(lse).all()


# ---- solution and traces ---------------------------------------------------------------------------------
def test_solution_holds_the_kernel_source_and_validates():
    spec = load_spec(LLAMA)
    doc = spec_to_solution(spec, "// source\n", LLAMA.read_text())
    sol = parse(Solution, json.loads(json.dumps(doc)), "sol.json")
    assert sol.definition == spec_to_definition(spec)["name"]
    # main.py is Python that builds kernel.cu through kgen and returns its outputs (FlashInfer-Bench's default
    # for a Solution is destination passing, and a `cuda` one it compiles with its own binding)
    assert sol.spec.language == "python" and sol.spec.destination_passing_style is False
    assert [s.path for s in sol.sources] == ["main.py", "kernel.cu", "spec.yaml"]
    compile(sol.sources[0].content, "main.py", "exec")  # the entry point is valid Python


def test_traces_map_kgen_verdicts_to_statuses():
    spec = load_spec(LLAMA)
    cases = [CaseResult("ok", [5, 17], 1e-4, 1e-3, True),
             CaseResult("bad", [5], 0.5, 1e-3, False, first_failure={"case": "bad", "output": "out", "got": 1.0}),
             CaseResult("hang", [5], math.nan, math.nan, False,
                        note="case 'hang': the kernel did not run to completion: timed out after 10 s"),
             CaseResult("crash", [5], math.nan, math.nan, False,
                        note="case 'crash': the kernel did not run to completion: SIGSEGV"),
             CaseResult("guard", [5], 0.0, 1e-3, False, first_failure={"case": "guard", "buffer": "out"})]
    report = VerificationReport(spec.name, "cpu", 7, {}, cases)
    traces = case_traces(report, spec, "mine")
    assert [status_of(c) for c in cases] == ["PASSED", "INCORRECT_NUMERICAL", "TIMEOUT", "RUNTIME_ERROR",
                                             "RUNTIME_ERROR"]
    for t in traces:
        parse(Trace, json.loads(json.dumps(t, allow_nan=False)), "t")
    assert traces[0]["workload"]["axes"] == {"len_indptr": 3, "num_kv_indices": 3, "batch_size": 2}
    assert traces[0]["evaluation"]["performance"]["latency_ms"] == 0.0 and "not timed" in traces[0]["evaluation"]["log"]
    bad = copy.deepcopy(traces[1])
    bad["evaluation"]["performance"] = {"latency_ms": 1.0}
    with pytest.raises(KgenUserError, match="performance must be absent"):
        parse(Trace, bad, "t")


# ---- the command line ------------------------------------------------------------------------------------
def test_cli_export_then_import(tmp_path):
    r = run_kgen("fib", "export", str(LLAMA), "-o", str(tmp_path / "fib"))
    assert r.returncode == 0, r.stderr
    (def_path,) = (tmp_path / "fib" / "definitions" / "gqa_paged").glob("*.json")
    (sol_path,) = (tmp_path / "fib" / "solutions" / "gqa_paged" / def_path.stem).glob("*.json")
    parse(Definition, def_path.read_text(), str(def_path))
    sol = parse(Solution, sol_path.read_text(), str(sol_path))
    assert "extern \"C\" __global__" in next(s.content for s in sol.sources if s.path == "kernel.cu")
    r = run_kgen("fib", "import", str(def_path), "-o", str(tmp_path / "back.yaml"))
    assert r.returncode == 0, r.stderr
    assert _comparable(load_spec(tmp_path / "back.yaml")) == _comparable(load_spec(LLAMA))


@pytest.mark.parametrize("text, message", [
    ("{\"name\": ", "not valid JSON"),
    (json.dumps({k: v for k, v in dataset_decode().items() if k != "axes"}), "axes: required field is missing"),
    (json.dumps({**dataset_decode(), "inputs": []}), "inputs"),
    (json.dumps({**dataset_decode(), "op_type": "dsa_paged", "name": "dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps1"}),
     "paged attention only"),
    (json.dumps({**dataset_decode(), "op_type": "gemm", "name": "gemm_n4096_k4096"}), "paged attention only"),
])
def test_cli_import_refuses_bad_input_with_exit_2_and_writes_nothing(tmp_path, text, message):
    src = tmp_path / "def.json"
    src.write_text(text)
    out = tmp_path / "spec.yaml"
    r = run_kgen("fib", "import", str(src), "-o", str(out))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_cli_export_refuses_a_spec_without_a_definition(tmp_path):
    r = run_kgen("fib", "export", str(ROOT / "specs" / "decode_sliding_window.yaml"), "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "sliding_window" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_spec_with_sinks_has_no_definition_rather_than_one_without_them():
    problems = export_problems(load_spec(ROOT / "specs" / "gpt_oss_20b_prefill.yaml"))
    assert problems == ["attention.sinks: FlashInfer-Bench's gqa_paged definitions have no attention sinks"]


@pytest.mark.parametrize("name", ["copy_blocks_fp16", "cache_write_fp8_e4m3"])
def test_a_kernel_without_a_fib_kind_has_no_definition(name):
    """The family says it has no FlashInfer-Bench kind (a cache writer, a block copy): refused on that."""
    problems = export_problems(load_spec(ROOT / "specs" / f"{name}.yaml"))
    assert len(problems) == 1 and "has no FlashInfer-Bench definition kind" in problems[0], problems


def test_cli_verify_appends_one_trace_per_case(tmp_path):
    spec = write_spec(tmp_path, yaml.safe_dump(TINY_DECODE))
    traces = tmp_path / "t.jsonl"
    r = run_kgen("verify", str(spec), "--backend", "cpu", "--json", "--trace", str(traces))
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    lines = traces.read_text().splitlines()
    assert len(lines) == len(report["cases"])
    for line, case in zip(lines, report["cases"], strict=True):
        t = parse(Trace, line, str(traces))
        assert t.evaluation.status == ("PASSED" if case["passed"] else "INCORRECT_NUMERICAL")
        assert t.solution == "kgen_tiny_decode" and t.definition.startswith("gqa_paged_decode_h4_kv2_d32")


def test_exported_solution_runs_on_the_cpu_and_matches_the_exported_reference(tmp_path):
    """The Solution's main.py (kgen's kernel behind FlashInfer-Bench's call) against the Definition's
    reference, in a fresh process on the CPU backend."""
    spec = write_spec(tmp_path, yaml.safe_dump({**TINY_DECODE, "kv_cache": {**TINY_DECODE["kv_cache"], "block_size": 8}}))
    r = run_kgen("fib", "export", str(spec), "-o", str(tmp_path / "fib"))
    assert r.returncode == 0, r.stderr
    code = """
import glob, json, os, sys
import numpy as np
from kgen.interop import to_flashinfer
sol = json.load(open(glob.glob('fib/solutions/gqa_paged/*/*.json')[0]))
ref_doc = json.load(open(glob.glob('fib/definitions/gqa_paged/*.json')[0]))
os.makedirs('src')
for s in sol['sources']:
    open(os.path.join('src', s['path']), 'w').write(s['content'])
sys.path.insert(0, 'src')
import main
ns = {}
exec(ref_doc['reference'], ns)
rng = np.random.default_rng(1)
lens = np.array([5, 17, 8, 1], np.int32)  # kgen decode takes seq_lens >= 1
tables = rng.permutation(13)[:12].reshape(4, 3).astype(np.int32)
k, v = (rng.standard_normal((13, 8, 2, 32)).astype(np.float16) for _ in range(2))
q = rng.standard_normal((4, 4, 32)).astype(np.float16)
indptr, indices, last = to_flashinfer(tables, lens, 8)
args = (q, k, v, indptr, indices, last, np.float32(32 ** -0.5))
out, lse = main.run(*args)
ref_out, ref_lse = ns['run'](*args)
same = np.isneginf(ref_lse) & np.isneginf(lse)  # a sequence with no keys: -inf in both
print(float(np.abs(out.astype(np.float64) - ref_out.astype(np.float64)).max()), float(np.abs(np.where(same, 0.0, lse - ref_lse)).max()))
try:
    main.run(*args[:-1], 0.5)
except ValueError as e:
    print('refused', e)
"""
    r = run_python(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = r.stdout.splitlines()[-2:]
    out_err, lse_err = map(float, first.split())
    assert out_err < 2e-3 and lse_err < 1e-3  # fp16 kernel output against the float64 reference
    assert second.startswith("refused sm_scale=0.5")
