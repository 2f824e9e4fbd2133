"""Split-KV for mla prefill (kgen/families/attention/mla.py's MlaPrefillFamily, templates/common/
paged_mla.cuh's paged_mla_prefill_body, softmax.cuh's packed-row merge): the verifier's prefill matrix
with partition boundaries (long rows over several partitions, rows whose keys end before a partition,
chunks at the end of their sequences) on the CPU backend, causal and not, fp8 per-token scales, tail
masking off; mutants the matrix must catch; plans (their sizes, one made for shorter lengths and
chunks, refused ones); the LSE; the split form's argument table, the tuner's space and refusals."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import full_tier_except, inline_provided

import kgen
from kgen.arrays import args_to_backend, to_numpy
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import KgenUserError
from kgen.families.attention.mla import MLA_PREFILL
from kgen.families.attention.mla_cases import make_mla_prefill_case
from kgen.families.attention.prefill_cases import check, references
from kgen.families.base import resolve_config
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {"kgen": 1, "name": "mla_split_prefill", "kind": "paged_prefill", "tail_masking": True, "targets": ["sm_90"],
        "attention": {"num_q_heads": 8, "num_kv_heads": 1, "head_dim": 192, "v_head_dim": 128,
                      "softmax_scale": 0.1147},
        "kv_cache": {"block_size": 16, "layout": "mla", "dtype": "bf16"}, "dtype": {"q": "bf16"}}
FP8_TOKEN = {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"}
DEEPSEEK_DIMS = {"attention.num_q_heads": 16, "attention.head_dim": 576, "attention.v_head_dim": 512}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _indptr(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


# ---- the verifier's matrix --------------------------------------------------------------------
MATRIX = [
    ({}, {"partition_size": 32}),
    ({"attention.causal": False, **FP8_TOKEN}, {"partition_size": 32, "row_tiles": 2}),
    (DEEPSEEK_DIMS, {"partition_size": 64, "col_warps": 4}),  # the DeepSeek head dims, 16 heads
    ({"tail_masking": False, "kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor"},
     {"partition_size": 16, "stages": 1}),
    ({"dtype.q": "fp16", "kv_cache.dtype": "fp16", "attention.causal": False, "kv_cache.block_size": 4},
     {"partition_size": 48, "stages": 3}),
]


# Each ~10 s at 8 heads, the DeepSeek dims ~40 s: the causal bf16 and the non-causal fp8 per-token rows
# prove split-KV (both visibilities, per-token scales, row_tiles 2) by default, the others in the full tier.
@pytest.mark.parametrize("overrides,config", full_tier_except(MATRIX, {0, 1}),
                         ids=["causal", "noncausal-fp8token-r2", "deepseek-dims-h16", "notail-e5m2-tensor-s1",
                              "fp16-noncausal-b4-s3"])
def test_split_prefill_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(**overrides), backend="cpu", verify=False, archs=[], config=config)
    report = verify(kern, seed=17)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    names = {c.name.removesuffix("_lse") for c in report.cases}
    # partition_edges: rows at P-5 .. 2P+4, the first ones' keys ending before partitions 1 and 2;
    # split_prefix_3P: a 16-token chunk at the end of 3P+21 keys, every row over four partitions
    assert {"partition_edges", "split_prefix_3P", "small_chunk_long_prefix", "mixed_batch", "padded_pool",
            "decode_equivalence"} <= names
    assert {"mixed_batch_lse", "sharp_rows_lse"} <= {c.name for c in report.cases}


# ---- mutants ----------------------------------------------------------------------------------
MERGE_PARTS = "const int num_parts = split_partitions(kv_len, partition_tokens, max_partitions);"
MUTANTS = [
    ("the merge drops the last partition", MERGE_PARTS,
     MERGE_PARTS.replace("split_partitions(kv_len, partition_tokens, max_partitions)",
                         "min(kv_len / partition_tokens, max_partitions)")),
    ("a partition's key range one short", "if (part < max_partitions - 1) hi = min(hi, (part + 1) * partition_tokens);",
     "if (part < max_partitions - 1) hi = min(hi, (part + 1) * partition_tokens - 1);"),
    ("a partition past the block's keys writes no state",
     "if (part >= split_partitions(seq_len, p.partition_tokens, p.max_partitions)) return;",
     "if (part >= split_partitions(k_end, p.partition_tokens, p.max_partitions)) return;"),
    ("the merge takes a token's previous sequence", "if (p.q_indptr[mid] <= tok) lo = mid; else hi = mid;",
     "if (p.q_indptr[mid] < tok) lo = mid; else hi = mid;"),
]


# Each ~25 s (a build and a matrix): the partition's key range by default (the merge body is dense
# prefill's too, whose merge mutant runs by default: test_prefill_pipeline.py).
@pytest.mark.parametrize("old,new", full_tier_except([m[1:] for m in MUTANTS], {1}), ids=[m[0] for m in MUTANTS])
def test_verifier_rejects_mutant(old, new):
    spec = _spec()
    rendered = render(spec, {"partition_size": 32})
    source = inline_provided(rendered.source)  # the bodies and softmax.cuh as kernel code
    assert source.count(old) == 1, old
    kern = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    report = verify(kern, seed=23)
    assert not report.passed, report.summary()


# ---- plans ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kern():
    return kgen.build(_spec(**FP8_TOKEN), backend="cpu", config={"partition_size": 32}, archs=[], verify=False)


def _call(kern, lens, q_lens, seed, **kw):
    """One call on a fresh case; its output (and LSE) judged against the float64 reference."""
    args = make_mla_prefill_case(kern.spec, lens, q_lens, np.random.default_rng(seed))
    got = kern(**args, return_lse=True, **kw)
    ref, lowp = references(kern.spec, args)
    results = check("planned", kern.spec, args, got[0], ref, lowp, got[1])
    assert all(r.passed for r in results), (lens, q_lens, [r.note for r in results])


def test_plan_sizes_and_launches(kern):
    plan = kern.plan([600, 40], q_indptr=_indptr([16, 40]), partition_tokens=32)
    assert plan.sizes["max_partitions"] == 19 and plan.sizes["partition_tokens"] == 32
    main, merge = plan.launches
    assert (main.kernel, merge.kernel) == ("mla_split_prefill", "mla_split_prefill_merge")
    assert main.grid == (20, 2, 19) and merge.grid == (8, 56, 1)  # 40 tokens x 8 heads / 16 rows; (heads, tokens)


def test_automatic_plans_split_few_rows_over_long_contexts_only(kern):
    few = kern.plan([8192], q_indptr=[0, 2])  # 16 rows: one block without a split
    assert few.sizes["max_partitions"] > 1 and few.sizes["partition_tokens"] % 16 == 0
    assert few.sizes["partition_tokens"] >= 32 and len(few.launches) == 2
    many = kern.plan([512] * 64, q_indptr=_indptr([64] * 64))  # 64 x 32 blocks fill the GPU
    assert many.sizes["max_partitions"] == 1 and len(many.launches) == 1


def test_planned_calls_give_the_reference_with_lse(kern):
    plan = kern.plan([300, 90, 0], q_indptr=_indptr([16, 1, 0]), partition_tokens=32)
    assert plan.sizes["max_partitions"] == 10
    _call(kern, [300, 90, 0], [16, 1, 0], 1, plan=plan)


def test_a_plan_made_for_shorter_lengths_and_other_chunks_stays_correct(kern):
    """The last partition takes the rest of a longer sequence; grid x comes from the call's chunks
    (a longer chunk than planned), the scratch from the plan's rows."""
    plan = kern.plan([100, 60], q_indptr=_indptr([8, 8]), partition_tokens=32)
    assert plan.sizes["max_partitions"] == 4
    for lens, q_lens in (([400, 90], [8, 8]), ([150, 70], [14, 2]), ([33], [5])):
        _call(kern, lens, q_lens, len(lens) + lens[0], plan=plan)


def test_a_plan_with_one_partition_launches_no_merge(kern):
    plan = kern.plan([30, 20], q_indptr=_indptr([30, 20]))
    assert plan.sizes["max_partitions"] == 1 and len(plan.launches) == 1
    _call(kern, [30, 20], [30, 20], 3, plan=plan)


def test_bad_plans_are_refused(kern):
    args = make_mla_prefill_case(kern.spec, [100, 100, 100], [10, 10, 10], np.random.default_rng(4))
    with pytest.raises(kgen.ArgumentError, match="made for at most 2 sequences, the call has 3"):
        kern(**args, plan=kern.plan([100, 100], q_indptr=_indptr([10, 10])))
    with pytest.raises(kgen.ArgumentError, match="made for at most 20 query rows, the call has 30"):
        kern(**args, plan=kern.plan([100, 100, 100], q_indptr=_indptr([10, 10, 0])))
    with pytest.raises(kgen.ArgumentError, match="q_indptr: required to plan a paged_prefill call"):
        kern.plan([100])
    with pytest.raises(kgen.ArgumentError, match=r"sequence 1: q_len = 50 is larger than seq_lens\[1\] = 40"):
        kern.plan([100, 40], q_indptr=[0, 5, 55])
    with pytest.raises(kgen.ArgumentError, match="partition_tokens 40: must be a multiple of 16"):
        kern.plan([100], q_indptr=[0, 4], partition_tokens=40)


def test_device_lengths_are_planned_from_shapes_on_the_cuda_path(strict_cuda):
    """The CUDA host path (the strict driver model, tests/strict_cuda/; the bodies run on the CPU
    backend): a call with device q_indptr and seq_lens plans from shapes (full tables, rows spread
    evenly, grid x for all rows in one chunk) without reading them, and splits; a planned call
    allocates, copies and waits for nothing after its first."""
    spec = _spec()
    kern = kgen.build(spec, backend="cuda", verify=False, config={"partition_size": 32})
    host = make_mla_prefill_case(spec, [300, 40], [3, 29], np.random.default_rng(8))
    dev = args_to_backend(host, "cuda")
    ref, lowp = references(spec, host)
    launched = len(strict_cuda.launches)
    out = kern(**dev)
    assert [ln.grid for ln in strict_cuda.launches[launched:]][1:] == [(8, 32, 1)]  # split: the merge ran
    assert all(r.passed for r in check("device", spec, host, to_numpy(out), ref, lowp))
    plan = kern.plan(host["seq_lens"], q_indptr=host["q_indptr"], num_sms=2, partition_tokens=32)
    kern(**dev, plan=plan)  # the first call allocates the plan's split-KV scratch
    before = len(strict_cuda.log)
    out = kern(**dev, plan=plan)
    after = strict_cuda.log[before:]
    assert after and all(kind == "launch" for kind, *_ in after) and len(after) == 2, after
    assert all(r.passed for r in check("planned", spec, host, to_numpy(out), ref, lowp))


def test_a_single_pass_config_plans_without_partitions_and_refuses_scratch():
    kern = kgen.build(_spec(), backend="cpu", archs=[], verify=False)  # the default: partition_size 0
    with pytest.raises(kgen.ArgumentError, match="this config never splits"):
        kern.plan([100], q_indptr=[0, 4], partition_tokens=32)
    plan = kern.plan([4096], q_indptr=[0, 2])
    assert plan.sizes["max_partitions"] == 1 and len(plan.launches) == 1
    _call(kern, [4096 // 8], [2], 5, plan=plan)
    args = make_mla_prefill_case(kern.spec, [50], [5], np.random.default_rng(6))
    with pytest.raises(kgen.ArgumentError, match="split-KV scratch given, but this config is single-pass"):
        kern(**args, part_o=np.zeros((5, 8, 2, 128), np.float32))


# ---- the ABI, the tuner's space, refusals -------------------------------------------------------
def test_the_abi_launch_stays_single_pass_and_the_split_form_adds_the_scratch_rows():
    spec = _spec()
    abi = MLA_PREFILL.arguments(spec, resolve_config(MLA_PREFILL, spec, MLA_PREFILL.abi_config(spec)))
    split = MLA_PREFILL.arguments(spec, resolve_config(MLA_PREFILL, spec, {"partition_size": 64}))
    added = [a.name for a in split if a.name not in {b.name for b in abi}]
    assert added == ["part_o", "part_ml", "max_partitions", "partition_tokens"]
    assert [a.name for a in split if a.name in {b.name for b in abi}] == [a.name for a in abi]  # same order
    assert MLA_PREFILL.kernels(spec, resolve_config(MLA_PREFILL, spec, None))[0].grid == ("q_row_blocks", "num_seqs", 1)


def test_the_tuners_space_has_partitions_but_not_for_sparse_rows():
    spec = _spec()
    assert MLA_PREFILL.default_space(spec)["partition_size"] == [0, 64, 256]
    sparse = _spec(**{"attention.sparse_topk": 64, "attention.causal": False})
    assert "partition_size" not in MLA_PREFILL.default_space(sparse)
    with pytest.raises(KgenUserError, match="partition_size 64: split-KV is not built for sparse mla prefill"):
        render(sparse, {"partition_size": 64})


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_deepseek_split_prefill_compiles_without_spills(arch):
    from pathlib import Path
    spec = kgen.load_spec(Path(__file__).resolve().parents[3] / "specs" / "deepseek_v3_mla_prefill.yaml")
    rendered = render(spec, {"partition_size": 64})
    assert "kgen::paged_prefill_merge_body<MergeCfg>(p);" in rendered.source
    resources = compile_cubin(rendered.source, arch).resources
    assert set(resources) == {"deepseek_v3_mla_prefill", "deepseek_v3_mla_prefill_merge"}
    for name, res in resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (name, res)
