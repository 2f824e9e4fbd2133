"""Sparse mla attention on the Hopper (wgmma) body (templates/common/paged_mla_wgmma.cuh's sparse decode
and prefill entries, kgen/families/attention/mla_wgmma.py): which render takes it and why the others do
not, CPU-backend verification with kgen's sparse cases (NaN in every slot no row names; split-KV over
the entries; race mode), mutants of the row selection the verifier must catch, the sm_90a compile (no spills, no
advisories, the wgmma ordering rules kept) and the mma.sync launch the ABI keeps."""

from __future__ import annotations

import pytest
from conftest import full_tier_except, inline_provided

import kgen
from kgen.abi import abi_text
from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin, compile_ptx
from kgen.compile.wgmma_order import check_ptx, check_sass
from kgen.errors import KgenUserError
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

CUOBJDUMP = find_cuobjdump()
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump (nvidia-cuda-cuobjdump wheel) is absent")
# 16 heads (a 64-row block three quarters padding), rows of 192 = 128 + 64 rope, 48 entries a row
BASE = {"kgen": 1, "name": "mla_sparse_wg", "kind": "paged_decode", "tail_masking": True, "targets": ["sm_90"],
        "attention": {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 192, "v_head_dim": 128,
                      "softmax_scale": 0.1147, "sparse_topk": 48},
        "kv_cache": {"block_size": 16, "layout": "mla", "dtype": "bf16"}, "dtype": {"q": "bf16"}}
SPARSE_CASES = {"edges", "full_topk", "padding", "tail_padding", "duplicates", "shared_prefix", "padded_pool",
                "mixed_batch", "empty_rows", "empty_rows_lse"}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


@pytest.mark.parametrize("kind,body", [("paged_decode", "paged_mla_sparse_decode_wgmma_body"),
                                       ("paged_prefill", "paged_mla_sparse_prefill_wgmma_body")])
def test_sm90_sparse_takes_the_hopper_body_and_sm80_the_mma_one(kind, body):
    spec = _spec(kind=kind, targets=["sm_80", "sm_90"])
    hopper, ampere = render(spec, None, "sm_90"), render(spec, None, "sm_80")
    assert hopper.body == "wgmma" and f"{body}<Cfg>" in hopper.source, hopper.why
    assert ampere.body == "mma.sync" and "no wgmma before sm_90" in ampere.why
    forced = render(spec, {"path": 1}, "sm_90")
    assert forced.body == "mma.sync" and f"{body.replace('_wgmma', '')}<Cfg>" in forced.source


DS = {"kv_cache.dtype": "fp8_ds_mla", "attention.head_dim": 576, "attention.v_head_dim": 512}


@pytest.mark.parametrize("kind", ["paged_decode", "paged_prefill"])
def test_the_fp8_ds_mla_cache_takes_the_hopper_body_with_32_key_tiles(kind):
    rendered = render(_spec(kind=kind, **DS))
    assert rendered.body == "wgmma" and "fp8_ds_mla cache" in rendered.why and "32-key tiles" in rendered.why


def test_other_fp8_caches_and_dense_fp8_ds_mla_keep_the_mma_body_with_the_reason():
    fp8 = render(_spec(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"}))
    assert fp8.body == "mma.sync" and "fp8 caches take the mma.sync body" in fp8.why, fp8.why
    dense = kgen.spec_from_dict({**BASE, "attention": {k: v for k, v in BASE["attention"].items()
                                                       if k != "sparse_topk"}}).with_overrides(**DS)
    assert render(dense).body == "mma.sync" and "dense spec over the fp8_ds_mla cache" in render(dense).why
    with pytest.raises(KgenUserError, match=r"path 2 \(wgmma\) cannot build for sm_90: .*fp8_ds_mla"):
        render(dense, {"path": 2})


def test_dense_mla_prefill_has_no_hopper_body():
    dense = kgen.spec_from_dict({**BASE, "kind": "paged_prefill", "attention": {
        k: v for k, v in BASE["attention"].items() if k != "sparse_topk"}})
    assert render(dense).body == ""  # no choice to report: one body
    with pytest.raises(KgenUserError, match=r"path 2 \(wgmma\) cannot build for sm_90: dense mla prefill has no "
                                            r"Hopper body"):
        render(dense, {"path": 2})


def test_the_abi_keeps_the_mma_sync_launch():
    assert "grid (num_q_tokens, 1, 1)" in abi_text(_spec(kind="paged_prefill"))
    assert "paged_mla_sparse_decode_body" not in abi_text(_spec())  # the text names arguments, not bodies


DECODE = [
    ({}, {}),
    ({"attention.sparse_topk": 100}, {"partition_size": 32}),  # split-KV over the entries + the merge
    ({"attention.num_q_heads": 72, "kv_cache.block_size": 1, "attention.sparse_topk": 20, "dtype.q": "fp16",
      "kv_cache.dtype": "fp16"}, {}),  # two head tiles, fp16
    ({"attention.num_q_heads": 128, "attention.head_dim": 576, "attention.v_head_dim": 512,
      "kv_cache.block_size": 64, "attention.sparse_topk": 160}, {"partition_size": 64}),  # V3.2's dims
    ({**DS, "attention.sparse_topk": 100}, {"partition_size": 32}),  # stored rows dequantized a tile
]


# V3.2's dims (128 heads: two 64-head blocks a sequence) in the full tier; the small rows prove the body
@pytest.mark.parametrize("overrides,config", full_tier_except(DECODE, {0, 1, 2, 4}),
                         ids=["h16", "split", "h72-fp16-b1", "v32", "fp8-ds-mla-split"])
def test_sparse_decode_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(**overrides), backend="cpu", verify=False, archs=[], config=config)
    assert kern.artifacts["bodies"]["sm_90"].body == "wgmma"
    report = verify(kern, seed=11)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    assert SPARSE_CASES <= {c.name for c in report.cases}


@pytest.mark.parametrize("overrides", [{}, DS], ids=["bf16", "fp8-ds-mla"])  # fp8_ds_mla: the dequantized tile's barrier
def test_sparse_decode_verifies_in_race_mode(overrides):
    kern = kgen.build(_spec(**overrides), backend="cpu", config={"partition_size": 32}, archs=[], race_check=True,
                      seed=5)
    assert kern.artifacts["bodies"]["sm_90"].body == "wgmma"
    assert kern.report.passed, kern.report.summary()


PREFILL = [
    ({}, {}),
    ({"attention.num_q_heads": 72, "attention.sparse_topk": 70}, {}),  # two head tiles, a partial last key tile
    (DS, {}),
]


@pytest.mark.parametrize("overrides,config", PREFILL, ids=["h16", "h72-k70", "fp8-ds-mla"])
def test_sparse_prefill_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(kind="paged_prefill", **overrides), backend="cpu", verify=False, archs=[], config=config)
    assert kern.artifacts["bodies"]["sm_90"].body == "wgmma"
    report = verify(kern, seed=13)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    assert {"chunk", "chunk_lse", "shared_prefix", "mixed_batch", "padded_pool"} <= {c.name for c in report.cases}


MUTANTS = [
    ("unused entries not masked", "if constexpr (SPARSE) sacc[e] = (named", "if constexpr (false) sacc[e] = (named", {}),
    ("every row reads row 0's indices", "indices + (long long)seq * N", "indices", {}),
    ("slot without the block stride", "(long long)((unsigned)slot / B) * kv_s_block + (long long)((unsigned)slot % B) "
     "* kv_s_token", "(long long)slot * kv_s_token", {}),
    ("named bits of the wrong key", "named >> (2 * (e >> 2) + (e & 1))", "named >> (2 * (e >> 2))", {}),
    ("last entry dropped", "int k_begin = 0, k_end = N;", "int k_begin = 0, k_end = N - 1;", {}),
    ("prefill: a neighbour token's indices", "indices + (long long)token * N",
     "indices + (long long)(token / 2 * 2) * N", {"kind": "paged_prefill"}),
    ("fp8_ds_mla: the rope read from the latent", "ds_mla_dequant8(stage + r * S::STORED, 8 * c)",
     "ds_mla_dequant8(stage + r * S::STORED, 8 * (c % 64))", DS),
    ("fp8_ds_mla: the last 16 stored bytes not copied", "if (c < S::CHUNKS) cp_async<16>",
     "if (c < S::CHUNKS - 1) cp_async<16>", DS),
    ("fp8_ds_mla: no barrier after the dequantizing pass",  # the untrusted CPU build runs race detection
     "mla_wg_dequant_tile<Cfg>(op_s, tiles + s * S::TILE_BYTES);\n      fence_proxy_async_shared();\n      __syncthreads();",
     "mla_wg_dequant_tile<Cfg>(op_s, tiles + s * S::TILE_BYTES);\n      fence_proxy_async_shared();", DS),
]


@pytest.mark.parametrize("old,new,overrides", [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_verifier_rejects_mutant(old, new, overrides):
    spec = _spec(**overrides)
    config = {"partition_size": 32} if spec.kind == "paged_decode" else {}
    rendered = render(spec, config)
    assert rendered.body == "wgmma"
    source = inline_provided(rendered.source)  # the body as kernel code (a provided header)
    assert source.count(old) == 1, old
    kern = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    report = verify(kern, seed=99)
    assert not report.passed, report.summary()


@needs_cuobjdump
@pytest.mark.parametrize("kind,config,cache", [
    ("paged_decode", {"partition_size": 256}, "bf16"), ("paged_decode", {}, "bf16"), ("paged_prefill", {}, "bf16"),
    ("paged_decode", {"partition_size": 256}, "fp8_ds_mla"), ("paged_prefill", {}, "fp8_ds_mla"),
], ids=["decode-split", "decode", "prefill", "ds-decode-split", "ds-prefill"])
def test_v32_sparse_compiles_for_sm90a_without_spills_advisories_or_order_problems(kind, config, cache):
    spec = _spec(kind=kind, **{"attention.num_q_heads": 128, "attention.head_dim": 576, "attention.v_head_dim": 512,
                               "kv_cache.block_size": 64, "attention.sparse_topk": 2048, "kv_cache.dtype": cache})
    rendered = render(spec, config)
    cache = ArtifactCache()
    art = compile_cubin(rendered.source, "sm_90", cache=cache)
    assert rendered.body == "wgmma" and art.arch == "sm_90a"
    for name, res in art.resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (name, res)
        assert res.advisories == [], (name, res.advisories)
        assert res.registers > 0
    ptx, sass = check_ptx(compile_ptx(rendered.source, "sm_90", cache=cache)), check_sass(sass_text(art.cubin, CUOBJDUMP))
    assert ptx == [] and sass == [], [str(p) for p in ptx + sass]
