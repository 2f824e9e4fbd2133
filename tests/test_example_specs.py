"""Every example spec of kind paged_decode in specs/ builds, passes the verifier's case
matrix on the CPU backend, and compiles for sm_90 without register spills."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import kgen

SPECS = Path(__file__).resolve().parents[1] / "specs"
REQUIRED = ["decode_fp8_e4m3_per_head", "decode_int8_per_token_head", "decode_vllm_layout",
            "decode_split_kv_long", "decode_sliding_window"]


def _decode_specs() -> list[Path]:
    return sorted(p for p in SPECS.glob("*.yaml") if kgen.load_spec(p).kind == "paged_decode")


def test_the_issue_examples_exist():
    names = {kgen.load_spec(p).name for p in _decode_specs()}
    assert set(REQUIRED) <= names


# The slowest to verify are the full tier's; their formats and layouts are verified by default elsewhere
# (fp8 in tests/verify/corpus, nvfp4 in test_nvfp4_attention.py, vLLM's layout in test_decode_sweep.py).
FULL_TIER = {"decode_vllm_layout", "llama3_8b_decode_nvfp4", "decode_fp8_e4m3_per_head", "gpt_oss_20b_decode_sliding",
             "decode_split_kv_long",  # split-KV decode verifies by default in test_paged_decode.py
             "deepseek_v32_sparse_mla_decode"}  # ~100 s (top-2048 x 128 heads); sparse decode: test_mla_sparse.py


def _tiered(paths: list[Path]) -> list:
    return [pytest.param(p, marks=pytest.mark.full) if p.stem in FULL_TIER else p for p in paths]


@pytest.mark.parametrize("path", _tiered(_decode_specs()), ids=lambda p: p.stem)
def test_example_spec_builds_verifies_and_does_not_spill(path):
    spec = kgen.load_spec(path)
    archs = sorted(set(spec.targets) | {"sm_90"})
    kernel = kgen.build(spec, backend="cpu", archs=archs, seed=4242)
    assert kernel.report.passed, kernel.report.summary()
    for name, res in kernel.resources["sm_90"].items():
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (name, res)
        assert res["registers"] > 0, (name, res)  # ptxas's figure was read (past 255 it spills)


def test_split_kv_example_splits_by_default():
    kernel = kgen.build(kgen.load_spec(SPECS / "decode_split_kv_long.yaml"), backend="cpu", archs=[], verify=False)
    assert kernel.config["partition_size"] > 0
    assert kernel.kernel_names == ["decode_split_kv_long", "decode_split_kv_long_merge"]


@pytest.mark.full  # ~14 s; prefill with v_head_dim != head_dim verifies by default in test_v_head_dim.py
def test_deepseek_v3_mha_prefill_example():
    """The v_head_dim example (docs/abi.md): DeepSeek-V3's MHA prefill on one TP-8 shard builds,
    verifies and compiles for sm_90 without spills; its scale is the model's YaRN-corrected one."""
    spec = kgen.load_spec(SPECS / "deepseek_v3_mha_prefill.yaml")
    a = spec.attention
    assert (a.num_q_heads, a.num_kv_heads, a.head_dim, spec.v_head_dim_value) == (16, 16, 192, 128)
    mscale = 0.1 * 1.0 * math.log(40) + 1.0  # rope_scaling: factor 40, mscale_all_dim 1.0
    assert math.isclose(spec.softmax_scale_value, mscale * mscale / math.sqrt(192), rel_tol=1e-15)
    kernel = kgen.build(spec, backend="cpu", archs=["sm_90"], seed=4242)
    assert kernel.report.passed, kernel.report.summary()
    for name, res in kernel.resources["sm_90"].items():
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (name, res)
        assert res["registers"] > 0, (name, res)
