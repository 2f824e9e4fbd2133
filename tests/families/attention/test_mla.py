"""MLA decode over the mla layout (templates/common/paged_mla.cuh, docs/mla.md): real CPU builds
verified by kgen's verifier against the float64 reference over head counts up to 128, block sizes,
geometries, pipelines and split-KV; race detection; mutants the matrix must catch; the reference's
MLA reading against a direct numpy computation; the ABI text; refusals; NVRTC compiles without spills."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import full_tier_except, inline_provided

import kgen
from kgen.abi import abi_text
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import KgenUserError, UnsupportedError
from kgen.families.attention.reference import attention_reference
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {"kgen": 1, "name": "mla_decode", "kind": "paged_decode", "tail_masking": True, "targets": ["sm_90"],
        "attention": {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 576, "v_head_dim": 512,
                      "softmax_scale": 0.1147},
        "kv_cache": {"block_size": 16, "layout": "mla", "dtype": "bf16"}, "dtype": {"q": "bf16"}}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


# The mma.sync body (path 1: sm_90 takes the Hopper body where it builds, tests/families/attention/test_mla_wgmma.py)
MATRIX = [
    ({}, {"path": 1}),
    ({"attention.num_q_heads": 128}, {"path": 1}),  # 8 row blocks a sequence
    ({"attention.num_q_heads": 128, "kv_cache.block_size": 64}, {"row_tiles": 2, "col_warps": 4, "stages": 1, "path": 1}),
    ({"dtype.q": "fp16", "kv_cache.dtype": "fp16", "attention.num_q_heads": 40, "kv_cache.block_size": 1},
     {"stages": 3, "col_warps": 2, "path": 1}),  # 40 heads: the last row tile half padding
    ({"attention.num_q_heads": 64}, {"partition_size": 64, "col_warps": 4, "stages": 1, "path": 1}),  # split-KV + merge
    ({"tail_masking": False, "attention.num_q_heads": 8, "attention.head_dim": 192, "attention.v_head_dim": 128},
     {"partition_size": 32, "path": 1}),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor", "attention.num_q_heads": 128,
      "kv_cache.block_size": 64}, {"row_tiles": 2, "col_warps": 4}),
    ({"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_token_head", "attention.num_q_heads": 32},
     {"partition_size": 32, "stages": 3}),
    ({"dtype.q": "fp16", "kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor", "kv_cache.block_size": 1},
     {"col_warps": 4, "stages": 1}),
]


@pytest.mark.parametrize("overrides,config", MATRIX, ids=["h16", "h128", "h128-b64-r2c4s1", "fp16-h40-b1",
                                                          "h64-split", "notail-small", "fp8e4m3-tensor-h128",
                                                          "fp8e5m2-token-split", "fp16q-fp8-b1"])
def test_decode_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(**overrides), backend="cpu", verify=False, archs=[], config=config)
    report = verify(kern, seed=11)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    names = {c.name.removesuffix("(rounded)") for c in report.cases}
    assert {"len_1", "len_B+1", "long", "mixed_batch", "shared_prefix", "padded_pool"} <= names


PREFILL = [
    ({}, {}),
    ({"attention.num_q_heads": 32, "attention.causal": False, "dtype.q": "fp16", "kv_cache.dtype": "fp16",
      "kv_cache.block_size": 4}, {"col_warps": 4, "stages": 1}),
    ({"tail_masking": False, "attention.num_q_heads": 8, "attention.head_dim": 192, "attention.v_head_dim": 128},
     {"row_tiles": 2, "stages": 3}),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head", "attention.num_q_heads": 8,
      "attention.head_dim": 192, "attention.v_head_dim": 128}, {}),
]


# The 32-head fp16 non-causal row (~50 s) is the full tier's; the others prove each option by default.
@pytest.mark.parametrize("overrides,config", full_tier_except(PREFILL, {0, 2, 3}), ids=["h16", "h32-noncausal-fp16-b4", "notail-small-r2",
                                                           "fp8-token-small"])
def test_prefill_verifies_on_cpu(overrides, config):
    spec = _spec(kind="paged_prefill", **overrides)
    report = verify(kgen.build(spec, backend="cpu", verify=False, archs=[], config=config), seed=13)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    names = {c.name for c in report.cases}
    assert {"chunk_17", "whole_prompt", "mixed_batch", "shared_prefix", "padded_pool", "decode_equivalence"} <= names


def test_prefill_causal_mutant_fails():
    spec = _spec(kind="paged_prefill", **{"attention.num_q_heads": 8, "attention.head_dim": 192,
                                          "attention.v_head_dim": 128})
    rendered = render(spec)
    old = "static constexpr bool CAUSAL = true;"
    assert rendered.source.count(old) == 1
    kern = kernel_from_source(spec, rendered.source.replace(old, "static constexpr bool CAUSAL = false;"),
                              backend="cpu", config=rendered.config, archs=[])
    assert not verify(kern, seed=3).passed


def test_decode_verifies_in_race_mode():
    kern = kgen.build(_spec(), backend="cpu", config={"partition_size": 32, "stages": 3, "path": 1}, archs=[], race_check=True,
                      seed=5)
    assert kern.report.passed, kern.report.summary()


FP8_TOKEN = {"attention.num_q_heads": 32, "kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"}
MUTANTS = [
    ("V's per-token scales dropped", "if (S::TOKEN_SCALES) s[j][i] *= ss[16 * cw + 8 * j + 2 * t + (i & 1)];", "",
     FP8_TOKEN),
    ("fp8 tile not converted before use", "mla_convert_tile<Cfg>(op_s, raw);\n      __syncthreads();",
     "mla_convert_tile<Cfg>(op_s, raw);", FP8_TOKEN),
    ("no barrier before P V", "pack2<T>(s[j][2 * rr], s[j][2 * rr + 1]);\n    }\n    __syncthreads();",
     "pack2<T>(s[j][2 * rr], s[j][2 * rr + 1]);\n    }\n", {}),
    ("own max only", "mla_across_warps<Cfg, true>(m, red_m, rt, cw, g, t);", "", {}),
    ("the row tile's warps read their own entry only", "const float y = red[(rt * C + w) * 16 + g + 8 * rr];",
     "const float y = red[(rt * C + cw) * 16 + g + 8 * rr];", {}),
    ("V from the rope end", "stage + cw * S::DW * 2, lane)", "stage + cw * S::DW * 2 + 2 * (S::D - S::DV), lane)", {}),
    ("mask on the wrong key", "col = 16 * cw + 8 * j + 2 * t + (i & 1), pos = tbase + col;",
     "col = 16 * cw + 8 * j + 2 * t + (i & 1), pos = tbase + col - (i & 1);", {}),
    ("row sums of one warp", "mla_across_warps<Cfg, false>(l, red_l, rt, cw, g, t);", "", {}),
]


@pytest.mark.parametrize("old,new,overrides", [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_verifier_rejects_mutant(old, new, overrides):
    spec = _spec(**{"attention.num_q_heads": 32, **overrides})
    rendered = render(spec, {"col_warps": 2, "partition_size": 32, "path": 1})
    source = inline_provided(rendered.source)  # the body as kernel code (a provided header)
    assert source.count(old) == 1, old
    kern = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    report = verify(kern, seed=99)
    assert not report.passed, report.summary()


def test_reference_reads_v_as_the_rows_first_v_head_dim_elements():
    """The float64 golden against attention written out directly: K the row, V its first 512."""
    spec = _spec(**{"kv_cache.block_size": 4})
    rng = np.random.default_rng(0)
    N, B, D, Dv, H = 5, 4, 576, 512, 16
    pool = rng.standard_normal((N, B, D))
    lens = [7, 2]
    tables = np.asarray([[3, 0], [4, 1]], dtype=np.int32)
    q = rng.standard_normal((2, H, D))
    args = {"kv_cache": pool, "block_tables": tables, "seq_lens": np.asarray(lens, np.int32)}
    ref = attention_reference(spec, q, args)
    for s, L in enumerate(lens):
        rows = np.concatenate([pool[b] for b in tables[s]])[:L]  # [L, D]
        logits = q[s] @ rows.T * 0.1147
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ rows[:, :Dv]
        np.testing.assert_allclose(ref.out[s], want, rtol=1e-12, atol=1e-12)
        lse = np.log(np.exp(logits).sum(axis=1))
        np.testing.assert_allclose(ref.lse[s], lse, rtol=1e-12)


def test_abi_text_names_the_latent_pool_and_v_head_dim():
    text = abi_text(_spec(**{"attention.num_q_heads": 128, "kv_cache.block_size": 64}))
    assert "kv_cache      [num_blocks, 64, 576]  bf16" in text
    assert "[num_seqs, 128, 512] bf16: attention output" in text
    params = text[text.index("extern"):]
    assert "kv_cache" in params and not any(f" {n}," in params for n in ("k_scale", "v_scale", "k_cache", "v_cache"))
    assert "grid (8, num_seqs, 1), block (64), dynamic shared memory 94976 bytes" in text


@pytest.mark.parametrize("overrides,message", [
    ({"dtype.q": "fp32", "kv_cache.dtype": "fp32"}, r"dtype.q: the mla kernels run Q K\^T and P V on the tensor"),
    ({"kv_cache.dtype": "fp16"}, r"kv_cache.dtype: fp16 is not built for the mla layout's attention \(allowed: "
                                 r"q's dtype bf16, fp8_e4m3, fp8_e5m2, fp8_ds_mla\)"),
    ({"kv_cache.dtype": "int8", "kv_cache.scale": "per_tensor"}, r"kv_cache.dtype: int8 is not built"),
    ({"dtype.q": "fp16", "kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"},
     r"per-token fp8 scales with fp16 q are not built"),
    ({"attention.alibi": True}, r"ALiBi, sliding windows and soft-caps are not built for the mla layout"),
    ({"attention.sinks": True}, r"attention.sinks: attention sinks are not built for the mla layout"),
    ({"targets": ["sm_75"], "dtype.q": "fp16", "kv_cache.dtype": "fp16"}, r"targets: sm_75 has no mma.sync"),
])
def test_unbuilt_combinations_are_refused(overrides, message):
    with pytest.raises(UnsupportedError, match=message):
        render(_spec(**overrides))


def test_a_config_that_would_spill_or_overflow_shared_memory_is_refused():
    with pytest.raises(KgenUserError, match=r"col_warps 1: a warp would hold 16 x 512 fp32 output accumulators"):
        render(_spec(), {"col_warps": 1, "path": 1})
    with pytest.raises(KgenUserError, match=r"bytes of shared memory > 232448"):
        render(_spec(), {"col_warps": 8, "stages": 2, "path": 1})


@pytest.mark.parametrize("overrides,config", [
    ({}, {"path": 1}), ({"attention.num_q_heads": 128}, {"row_tiles": 2, "col_warps": 4, "path": 1}),
    ({}, {"partition_size": 64, "path": 1}), ({"dtype.q": "fp16", "kv_cache.dtype": "fp16"}, {"col_warps": 4, "stages": 1, "path": 1}),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"}, {"partition_size": 64}),
    ({"kind": "paged_prefill"}, {}), ({"kind": "paged_prefill", "attention.num_q_heads": 128}, {"row_tiles": 2}),
], ids=["default", "r2c4", "split", "fp16-c4s1", "fp8-token-split", "prefill", "prefill-r2"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_without_spills(overrides, config, arch):
    spec = _spec(**overrides)
    rendered = render(spec, config)  # decode: the mma.sync body (path 1), compiled for both archs
    for name, res in compile_cubin(rendered.source, arch).resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (name, res)


@pytest.mark.full  # ~40 s; the MLA prefill body verifies by default in test_prefill_verifies_on_cpu
def test_deepseek_prefill_example_compiles_without_spills_and_verifies_at_32_heads():
    """The example's geometry (32 rows, 4 column warps, 2 stages); the 128-head matrix takes ~7 minutes
    on the CPU backend, so the verifier runs it at 32 heads (same body, same geometry)."""
    from pathlib import Path
    spec = kgen.load_spec(Path(__file__).resolve().parents[3] / "specs" / "deepseek_v3_mla_prefill.yaml")
    kern = kgen.build(spec, backend="cpu", verify=False, archs=["sm_90"])
    for name, res in kern.resources["sm_90"].items():
        assert res["spill_stores"] == res["spill_loads"] == 0 and res["registers"] > 0, (name, res)
    small = kgen.build(spec.with_overrides(**{"attention.num_q_heads": 32}), backend="cpu", verify=False, archs=[])
    report = verify(small, seed=21)
    assert report.passed, report.summary()


def test_perf_estimates_mla_decode_over_batches_and_contexts():
    """`kgen perf` on the DeepSeek example: the static model's table (kgen/perf/mla_model.py) over
    batch 1-128 and contexts 1K-32K, with the plan's split at batch 1 and none where the batch fills the GPU."""
    from pathlib import Path

    from kgen.cli.perf import mla_report
    spec = kgen.load_spec(Path(__file__).resolve().parents[3] / "specs" / "deepseek_v3_mla_decode.yaml")
    rep = mla_report(spec, None, "sm_90")
    rows = {(r["batch"], r["context"]): r for r in rep["estimates"]}
    assert set(rows) == {(b, c) for b in (1, 16, 64, 128) for c in (1024, 4096, 32768)}
    assert all(0 < r["copy_fraction"] <= 1 and 0 < r["tensor_fraction"] <= 1 for r in rows.values())
    assert rows[(1, 32768)]["partitions"] > 1 and rows[(128, 4096)]["partitions"] == 1
    assert rows[(1, 32768)]["us"] < rows[(128, 32768)]["us"]
    assert rep["resources"]["deepseek_v3_mla_decode"]["spill_stores"] == 0
    with pytest.raises(KgenUserError, match=r"kgen perf has no static model of this kernel \(kind paged_prefill"):
        mla_report(spec.with_overrides(kind="paged_prefill"), None, "sm_90")
