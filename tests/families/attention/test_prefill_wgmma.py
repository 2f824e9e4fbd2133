"""The Hopper prefill path (templates/common/paged_prefill_wgmma.cuh; its choice and tiles:
kgen/families/attention/prefill_geometry.py): a producer warpgroup gathering paged K/V tiles by cp.async into
128B-swizzled stages, consumer warpgroups computing S = Q K^T (wgmma_ss) and O += P V (wgmma_rs), full /
empty mbarriers between them. Verified element by element on the CPU backend (its wgmma, mbarrier and
cp.async emulation); the fallback to mma.sync with its note; pruned configs; the sm_90a cubin's HGMMA;
and mutants that drop an arrive or a wait, or pack P out of order, fail verification."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import inline_provided

import kgen
from kgen.build import check_register_splits
from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin
from kgen.compile.provided import kgen_headers
from kgen.errors import CompileError, KgenUserError
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.attention.prefill_geometry import prefill_geometry, wgmma_smem_bytes
from kgen.families.base import resolve_config
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.render import render
from kgen.tune.search import expand_space
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {
    "kgen": 1, "name": "wg_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, "causal": True},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
LLAMA = {"attention.num_q_heads": 32, "attention.num_kv_heads": 8, "attention.head_dim": 128}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


# ---- selection, fallback, pruning -----------------------------------------------------------------
def test_auto_takes_wgmma_on_an_sm_90_only_fp16_spec():
    spec = _spec(**LLAMA)
    config = resolve_config(PAGED_PREFILL, spec, None)
    geo = prefill_geometry(spec, config)
    assert geo.path == "wgmma" and geo.refusal is None
    # two consumer warpgroups of 128-key tiles: ~200 registers a consumer, past the 168 of 384 threads at
    # launch, so setmaxnreg gives the consumers 232 (the producer keeps 40)
    assert (geo.warps, geo.kv_tile) == (8, 128) and geo.setmaxnreg
    main = PAGED_PREFILL.kernels(spec, config)[0]
    assert main.block == 3 * 128 and main.smem == wgmma_smem_bytes(spec, 8, 128, 2) == 1024 + 128 * 256 + 2 * 128 * 512
    rendered = render(spec, config)
    assert "paged_prefill_wgmma_body<Cfg>" in rendered.source and "arch-specific sm_90a" in rendered.source
    assert rendered.body == "wgmma" and "Hopper body" in rendered.why and "setmaxnreg 40/232" in rendered.why
    assert "SETMAXNREG = true" in rendered.source


@pytest.mark.parametrize("overrides,why", [
    ({"targets": ["sm_80"]}, "no wgmma before sm_90"),
    ({"targets": ["sm_100"]}, "sm_100 has no wgmma"),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head", "targets": ["sm_90"]}, "unscaled"),
    ({"dtype.q": "fp32", "kv_cache.dtype": "fp32"}, "fp16 or bf16"),
    ({"attention.head_dim": 96}, "multiples of 64"),
    ({"kv_cache.layout": "vllm", "kv_cache.order": None}, "unscaled"),
], ids=["sm_80", "sm_100", "fp8", "fp32", "d96", "vllm"])
def test_unsupported_specs_fall_back_to_mma_with_a_note(overrides, why):
    spec = _spec(**overrides)
    rendered = render(spec, None)
    assert "paged_prefill_body<Cfg>" in rendered.source and "wgmma" not in rendered.source.split("namespace {")[1]
    assert rendered.body == ("fma" if spec.dtype.q == "fp32" else "mma.sync")
    assert rendered.why.startswith("not the Hopper body: ") and why in rendered.why


def test_mma_path_forced_and_wgmma_forced_where_it_cannot_build():
    spec = _spec()
    assert prefill_geometry(spec, resolve_config(PAGED_PREFILL, spec, {"path": 1})).path == "mma"
    assert render(spec, {"path": 1}).why == "path 1 (mma) in the config"
    # forced onto an arch that cannot take it: a config error naming the target and what it accepts
    with pytest.raises(KgenUserError, match=r"for target sm_80: path 2 \(wgmma\) cannot build for sm_80: no wgmma "
                                            r"before sm_90 \(accepted there: path 0, auto, or 1, mma.sync\)"):
        render(_spec(targets=["sm_80", "sm_90"]), {"path": 2}, "sm_80")
    with pytest.raises(KgenUserError, match="consumers are 4 or 8 warps"):
        render(spec, {"path": 2, "warps": 2})


def test_configs_that_cannot_launch_are_pruned_with_the_reason():
    spec = kgen.spec_from_dict({**BASE, "tuning": {"params": {"path": [2], "warps": [4, 8], "kv_tile": [64, 128],
                                                              "stages": [1, 4]}}}).with_overrides(
        **{**LLAMA, "attention.head_dim": 256})
    space = expand_space(spec)
    kept = {(c["warps"], c["kv_tile"], c["stages"]) for c in space.configs}
    assert kept == {(4, 64, 1), (8, 64, 1)}  # d256: 128-key tiles need ~264 registers; 4 stages, > 227 KiB
    reasons = " ".join(p["reason"] for p in space.pruned)
    assert "registers a consumer thread" in reasons and "bytes of shared memory" in reasons


# ---- verification on the CPU backend ------------------------------------------------------------------
@pytest.mark.parametrize("overrides,config", [
    ({}, {"partition_size": 0, "kv_tile": 32, "warps": 8}),                        # GQA 4, d64, 2 consumers
    ({"attention.num_q_heads": 2}, {"partition_size": 32, "kv_tile": 16, "warps": 4}),  # MHA, split-KV
    ({"attention.num_q_heads": 16, "attention.sliding_window": 40, "attention.sinks": True, "dtype.q": "bf16",
      "kv_cache.dtype": "bf16"}, {"partition_size": 0, "kv_tile": 32, "warps": 8, "stages": 3}),  # GQA 8 bf16
    ({"attention.num_kv_heads": 8, "attention.num_q_heads": 8, "attention.head_dim": 128,
      "attention.logits_soft_cap": 30.0, "attention.alibi": True, "kv_cache.order": "HND"},
     {"partition_size": 0, "kv_tile": 64, "warps": 4, "stages": 1}),
    ({"attention.sinks": True, "attention.sliding_window": 24}, {"partition_size": 32, "kv_tile": 16, "warps": 8}),
    ({"attention.causal": False, "attention.head_dim": 128, "attention.v_head_dim": 64},
     {"partition_size": 0, "kv_tile": 32, "warps": 4, "stages": 2}),
    ({"attention.head_dim": 256, "attention.num_q_heads": 2, "attention.num_kv_heads": 1},
     {"partition_size": 0, "kv_tile": 32, "warps": 4, "stages": 3}),  # MQA-like GQA 2, d256: 4 chunks a thread
], ids=["gqa4-d64", "mha-split", "gqa8-bf16-window-sinks-s3", "d128-hnd-cap-alibi-s1", "sinks-window-split",
        "noncausal-vdim64", "d256-s3"])
def test_the_hopper_body_verifies(overrides, config):
    spec = _spec(**overrides)
    assert prefill_geometry(spec, resolve_config(PAGED_PREFILL, spec, config)).wgmma
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], seed=11, race_check=True)
    assert kernel.report.passed, kernel.report.summary()
    assert kernel.arch == "sm_90" and kernel.artifacts["bodies"]["sm_90"].body == "wgmma"


# ---- synchronisation mutants ------------------------------------------------------------------------------
HEADER = "kgen/bodies/paged_prefill_wgmma.cuh"
FULL_ARRIVE = "mbar_arrive(&full[(i - STAGES + 1) % STAGES]);"
EMPTY_ARRIVE = "mbar_arrive(&empty[s]);"
FULL_WAIT = "mbar_wait(&full[s], (i / STAGES) & 1);  // tile i has landed"
EMPTY_WAIT = "if (i >= STAGES) mbar_wait(&empty[s], (i / STAGES - 1) & 1);"
COPY_WAIT = "cp_async_wait<STAGES - 1>();"


def _inline_body(source: str) -> str:
    """The source with the Hopper body copied in as kernel code (a hand-written kernel editing it)."""
    include = f'#include "{HEADER}"\n'
    assert source.count(include) == 1
    return source.replace(include, kgen_headers()[HEADER].replace("#pragma once", ""))


@pytest.mark.parametrize("mid,old,new,expect", [
    ("unchanged", FULL_WAIT, FULL_WAIT, ""),
    ("no_full_arrive", FULL_ARRIVE, "/* arrive dropped */", "deadlock|progress|blocked"),
    ("no_empty_arrive", EMPTY_ARRIVE, "/* arrive dropped */", "deadlock|progress|blocked"),
    ("no_full_wait", FULL_WAIT, "/* wait dropped */", "NaN|race|error|FAILED"),
    ("no_empty_wait", EMPTY_WAIT, "/* wait dropped */", "NaN|race|error|FAILED"),
    ("no_copy_wait", COPY_WAIT, "/* wait dropped */", "NaN|race|error|FAILED"),
])
def test_dropping_an_arrive_or_a_wait_fails_verification(mid, old, new, expect):
    """A missing arrive leaves a waiter blocked for good: the CPU backend reports that no thread can
    make progress (an error, not a hang). A missing wait lets a consumer read a stage whose copies have
    not landed (0xFF bytes: NaN) or the producer refill one still being read: wrong numbers or a race."""
    spec = _spec(**{"attention.num_q_heads": 4})
    rendered = render(spec, {"partition_size": 0, "kv_tile": 16, "warps": 4, "stages": 2})
    body = _inline_body(rendered.source)
    assert body.count(old) == 1
    mutant = kernel_from_source(spec, body.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    report = verify(mutant, seed=3)
    if old == new:
        assert report.passed, report.summary()
        return
    assert not report.passed, mid
    text = report.summary() + " ".join(str(c.__dict__) for c in report.failed_cases)
    assert re.search(expect, text), text[:2000]


# ---- the sm_90a cubin -------------------------------------------------------------------------------------
CUOBJDUMP = find_cuobjdump()


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump (nvidia-cuda-cuobjdump wheel) is absent")
def test_the_sm_90_cubin_is_built_for_sm_90a_with_hgmma_and_no_spills(tmp_path):
    """The automatic tiles of Llama-3-8B shapes (2 consumer warpgroups x 128 keys, setmaxnreg): ptxas
    allocates all 168 registers __launch_bounds__(384) allows, which the register split's counts assume
    (128 x 40 + 256 x 232 = 384 x 168: with fewer at launch, the consumers' setmaxnreg.inc would wait
    forever), and spills nothing; a config without the split keeps its own count."""
    spec = _spec(**LLAMA)
    rendered = render(spec, None)
    art = compile_cubin(rendered.source, "sm_90", cache=ArtifactCache(tmp_path))
    assert art.arch == "sm_90a"
    ops = set(re.findall(r"\b([A-Z][A-Z0-9]+)(?:\.[A-Za-z0-9_]+)*\b", sass_text(art.cubin, CUOBJDUMP)))
    assert {"HGMMA", "SYNCS", "LDGSTS", "USETMAXREG"} <= ops, sorted(ops)
    res = art.resources[spec.name]
    assert res.spill_stores == 0 and res.registers == 168
    # the build checks that allocation on every cubin (KernelDecl.launch_registers): this one passes, the
    # same cubin read as 160 registers at launch does not
    config = resolve_config(PAGED_PREFILL, spec, None)
    assert PAGED_PREFILL.kernels(spec, config)[0].launch_registers == 168
    check_register_splits(spec, config, {"sm_90": art})
    fewer = dataclasses.replace(art, resources={**art.resources, spec.name: dataclasses.replace(res, registers=160)})
    with pytest.raises(CompileError, match=r"sm_90: wg_prefill: 160 registers per thread at launch.*exactly 168"):
        check_register_splits(spec, config, {"sm_90": fewer})
    small = render(spec, {"warps": 8, "kv_tile": 32})
    assert "SETMAXNREG = false" in small.source
    res = compile_cubin(small.source, "sm_90", cache=ArtifactCache(tmp_path)).resources[spec.name]
    assert res.spill_stores == 0 and res.registers <= 168


# ---- the GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [{}, {**LLAMA, "attention.sinks": True}])
def test_the_hopper_body_verifies_on_the_gpu(overrides):
    kernel = kgen.build(_spec(**overrides), backend="cuda", seed=5)
    assert kernel.report.passed, kernel.report.summary()


# The body's call of its epilogue part's sink (attention/epilogue.cuh; the part's own mutants are
# test_sinks.py's and test_verify_runner.py's: the mma.sync prefill source holds the part too, so it
# is not copied in here): a body that adds the sink to a partial, and one that forgets it.
@pytest.mark.parametrize("old,new", [
    ("row_ok[rr] ? ep.sink(st[rr], row_head[rr]) : 1.0f",
     "row_ok[rr] && ep.sinks != nullptr ? st[rr].add_sink(ep.sinks[row_head[rr]]) : 1.0f"),  # a partial's sink
    ("ep.sink(st[rr], row_head[rr])", "1.0f"),                                                # sink forgotten
])
def test_the_hopper_body_s_sink_mutants_fail(old, new):
    spec = _spec(**{"attention.sinks": True, "attention.num_q_heads": 4})
    rendered = render(spec, {"partition_size": 32, "kv_tile": 16, "warps": 4})
    body = _inline_body(rendered.source)
    assert body.count(old) == 1
    mutant = kernel_from_source(spec, body.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    assert not verify(mutant, seed=3).passed


# The wgmma tile part's P in A fragments (kgen/attention/wgmma_tile.cuh, which only this body packs into
# registers; the part's other mutants are test_mla_wgmma.py's): each pair of P's elements swapped.
def test_p_packed_out_of_order_fails():
    spec = _spec(**{"attention.num_q_heads": 4})
    rendered = render(spec, {"partition_size": 0, "kv_tile": 16, "warps": 4})
    source = inline_provided(_inline_body(rendered.source), "kgen/attention/wgmma_tile.cuh")
    old = "pack2<T>(p[8 * kk + 2 * j], p[8 * kk + 2 * j + 1])"
    assert source.count(old) == 1
    mutant = source.replace(old, "pack2<T>(p[8 * kk + 2 * j + 1], p[8 * kk + 2 * j])")
    assert not verify(kernel_from_source(spec, mutant, backend="cpu", config=rendered.config, archs=[]), seed=3).passed
