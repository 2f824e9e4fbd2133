"""attention.v_head_dim on the separate layout (docs/abi.md): q and K at head_dim,
V, out and the split scratch at v_head_dim. Decode (both bodies) and prefill verified on the CPU
backend at block and partition boundaries, with v_head_dim both below and above head_dim, float
and fp8 caches, GQA, split-KV, the LSE, NHD and HND; the call's shapes; `kgen abi`."""

from __future__ import annotations

import numpy as np
import pytest

import kgen
from kgen.abi import abi_text
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.prefill_cases import make_prefill_case
from kgen.families.registry import family_for, unbuilt_features
from kgen.formats.cache import cache_shapes, from_layout, to_layout
from kgen.verify.runner import verify

DECODE_CASES = ["len_1", "len_B-1", "len_B", "len_B+1", "len_2B+1", "len_P-1", "len_P", "len_P+1", "len_2P+1",
                "mixed_batch", "padded_pool", "strided_q_out", "large_logits"]  # mixed, strided, large: with the LSE
PREFILL_CASES = ["chunk_1", "chunk_15", "chunk_16", "chunk_17", "inside_blocks", "whole_prompt", "partition_edges",
                 "sharp_rows", "mixed_batch", "padded_pool", "decode_equivalence"]


def _spec(kind: str, head_dim: int, v_head_dim: int, kv_dtype: str = "fp16", q: str = "fp16", order: str = "NHD",
          heads: tuple[int, int] = (6, 2), scale: str = "none", name: str = "vdim"):
    return kgen.spec_from_dict({
        "kgen": 1, "name": name, "kind": kind,
        "attention": {"num_q_heads": heads[0], "num_kv_heads": heads[1], "head_dim": head_dim,
                      "v_head_dim": v_head_dim},
        "kv_cache": {"block_size": 16, "layout": "separate", "order": order, "dtype": kv_dtype, "scale": scale},
        "dtype": {"q": q}, "tail_masking": True, "targets": ["sm_90"]})


def _verified(spec, config: dict, cases: list[str], seed: int = 5):
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], verify=False)
    report = verify(kernel, seed=seed, cases=cases)
    assert {c.name.removesuffix("_lse") for c in report.cases} == set(cases)  # every case named ran
    assert report.passed, report.summary()
    return kernel, report


def test_the_feature_is_no_longer_refused():
    spec = _spec("paged_decode", 192, 128)
    assert unbuilt_features(spec) == []
    assert family_for(spec).kind == "paged_decode"


# ---- decode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dims,kv,q,order,heads,scale,config,tensor_cores", [
    ((192, 128), "fp16", "fp16", "NHD", (6, 2), "none", {"partition_size": 32}, False),
    ((64, 128), "bf16", "bf16", "HND", (8, 2), "none", {"partition_size": 32, "mma_min_group": 1}, True),
    ((128, 64), "fp8_e4m3", "fp16", "NHD", (8, 2), "per_token_head", {"mma_min_group": 1}, True),
    ((64, 128), "fp8_e4m3", "bf16", "HND", (4, 1), "per_head", {"partition_size": 48, "mma_min_group": 0}, False),
], ids=["192-128-fp16-cuda-split", "64-128-bf16-hnd-mma-split", "128-64-fp8-token-mma", "64-128-fp8-hnd-cuda-split"])
def test_decode_verifies(dims, kv, q, order, heads, scale, config, tensor_cores):
    spec = _spec("paged_decode", *dims, kv, q, order, heads, scale)
    cases = DECODE_CASES if config.get("partition_size") else [c for c in DECODE_CASES if "_P" not in c]
    kernel, report = _verified(spec, config, cases)
    assert ("paged_decode_mma_body<Cfg>(" in kernel.source) == tensor_cores
    assert any(c.name.endswith("_lse") for c in report.cases)


def test_decode_call_shapes_and_lse():
    spec = _spec("paged_decode", 192, 128)
    kernel = kgen.build(spec, backend="cpu", config={"partition_size": 16}, archs=[], verify=False)
    args = make_decode_case(spec, [1, 17, 40], np.random.default_rng(3))
    assert args["k_cache"].shape[-1] == 192 and args["v_cache"].shape[-1] == 128
    args.pop("out")
    out, lse = kernel(**args, return_lse=True)
    assert out.shape == (3, 6, 128) and lse.shape == (3, 6)
    # q at V's width, or out at K's, are refused with the shape the ABI wants
    with pytest.raises(kgen.ArgumentError, match=r"q: expected shape \[3, 6, 192\]"):
        kernel(**{**args, "q": args["q"][..., :128]})
    with pytest.raises(kgen.ArgumentError, match=r"out: expected shape \[3, 6, 128\]"):
        kernel(**args, out=np.zeros((3, 6, 192), np.float16))
    with pytest.raises(kgen.ArgumentError, match=r"v_cache: expected shape \[\d+, 16, 2, 128\]"):
        kernel(**{**args, "v_cache": args["k_cache"]})


# ---- prefill --------------------------------------------------------------------------------
@pytest.mark.parametrize("dims,kv,q,order,heads,scale,config", [
    ((192, 128), "bf16", "bf16", "NHD", (4, 4), "none", {"partition_size": 32}),
    ((64, 128), "fp16", "fp16", "HND", (6, 2), "none", {}),
    ((128, 64), "fp8_e4m3", "fp16", "NHD", (4, 2), "per_token_head", {"partition_size": 48}),
    ((96, 32), "fp32", "fp32", "HND", (2, 1), "none", {}),
], ids=["192-128-bf16-split", "64-128-fp16-hnd", "128-64-fp8-token-split", "96-32-fp32-hnd"])
def test_prefill_verifies(dims, kv, q, order, heads, scale, config):
    spec = _spec("paged_prefill", *dims, kv, q, order, heads, scale)
    cases = PREFILL_CASES if config.get("partition_size") else [c for c in PREFILL_CASES if c != "partition_edges"]
    _verified(spec, config, cases)


def test_prefill_output_wider_than_one_slice():
    """v_head_dim 320 > 256 output columns a block: two slices on grid z, while q.K runs over 64."""
    spec = _spec("paged_prefill", 64, 320, heads=(2, 1))
    kernel = kgen.build(spec, backend="cpu", archs=[], verify=False)
    assert kernel.plan([40], q_indptr=[0, 9]).sizes["z"] == 2
    _verified(spec, {}, ["chunk_17", "mixed_batch"])


def test_prefill_call_shapes():
    spec = _spec("paged_prefill", 64, 128, heads=(4, 2))
    kernel = kgen.build(spec, backend="cpu", archs=[], verify=False)
    args = make_prefill_case(spec, [20, 5], [4, 5], np.random.default_rng(4))
    assert args["out"].shape == (9, 4, 128)
    args.pop("out")
    assert kernel(**args).shape == (9, 4, 128)


# ---- the pool and the ABI -------------------------------------------------------------------
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_pool_round_trips_at_two_widths(order):
    spec = _spec("paged_decode", 64, 96, order=order)
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((3, 16, 2, 64)), rng.standard_normal((3, 16, 2, 96))
    arrays = to_layout(spec, k, v)
    assert {n: a.shape for n, a in arrays.items()} == cache_shapes(spec, 3)
    gk, gv = from_layout(spec, arrays)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, v)


@pytest.mark.parametrize("kind", ["paged_decode", "paged_prefill", "cache_write"])
def test_abi_names_both_widths(kind):
    text = abi_text(_spec(kind, 192, 128, name=f"vdim_{kind}"))
    assert "head_dim 192 (q, K), v_head_dim 128 (V, out)" in text
    assert "v_cache       [num_blocks, 16, 2, 128]" in text and "k_cache       [num_blocks, 16, 2, 192]" in text
    if kind == "cache_write":
        assert "[num_tokens, 2, 128]" in text and "[num_tokens, 2, 192]" in text
    else:
        rows = "num_seqs" if kind == "paged_decode" else "num_q_tokens"
        assert f"[{rows}, 6, 128]" in text and f"[{rows}, 6, 192]" in text


def test_perf_figures_count_each_pool_at_its_width():
    """The static model's bytes per token: one K row and one V row of each KV head, from the pool's shapes."""
    from kgen.perf.report import kv_bytes_per_token

    spec = _spec("paged_decode", 192, 128)
    per_block = sum(int(np.prod(shape[1:])) for shape in cache_shapes(spec, 1).values())
    assert kv_bytes_per_token(spec) == per_block // spec.kv_cache.block_size * 2  # fp16


def test_flashinfer_bench_export_refuses_two_widths():
    from kgen.fib.convert import export_problems

    problems = export_problems(_spec("paged_decode", 192, 128))
    assert any(p.startswith("attention.v_head_dim 128: FlashInfer-Bench's gqa_paged definitions have one head_dim")
               for p in problems), problems
