"""The paged-prefill geometry (kgen/families/attention/prefill_geometry.py): one frozen object per
(spec, config, arch), resolved in a fixed order without recursion, read by the template (the rendered
Cfg constants), the kernel declarations and the checks; the Hopper path's refusals, its choice on sm_90
against mma.sync on sm_80, and the shared-memory limits."""

from __future__ import annotations

import ast
import dataclasses
import gc
import inspect
import re

import pytest
from conftest import ROOT

import kgen
from kgen.bodies import spec_for_arch
from kgen.families.attention import prefill_geometry as pg
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.attention.prefill_geometry import (
    KV_PATHS,
    PRODUCER_THREADS,
    SMEM_TARGET,
    prefill_geometry,
    smem_bytes,
    wgmma_smem_bytes,
)
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.plan.arch import limits_for
from kgen.render import render
from kgen.spec.models import load_spec

BASE = {
    "kgen": 1, "name": "geo_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "causal": True},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_80", "sm_90"],
}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _config(spec, config=None):
    return resolve_config(PAGED_PREFILL, spec, config)


# ---- no recursion, one order ----------------------------------------------------------------------
def _calls() -> dict[str, set[str]]:
    """The module's functions and the module functions each calls by name."""
    tree = ast.parse(inspect.getsource(pg))
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    return {name: {c.func.id for c in ast.walk(f) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                   and c.func.id in funcs} for name, f in funcs.items()}


def test_no_rule_reaches_itself():
    """The call graph of the module's functions is acyclic: no rule is resolved through itself."""
    calls = _calls()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(calls[start])
        while todo:
            f = todo.pop()
            if f not in seen:
                seen.add(f)
                todo += calls[f]
        return seen

    assert [f for f in calls if f in reaches(f)] == []


def test_resolution_runs_path_m_tiles_stages_tiles_in_order():
    """_resolve settles the path (the Hopper candidate), then m_tiles, stages and tiles, once each."""
    source = inspect.getsource(pg._resolve)
    steps = [m.group(1) for m in re.finditer(r"\b(_hopper|_m_tiles|_stages|_tiles)\(", source)]
    assert steps == ["_hopper", "_m_tiles", "_stages", "_tiles"]
    # the m_tiles rule reads the stage and tile rules with m_tiles fixed at 2, never itself
    calls = _calls()
    assert calls["_m_tiles"] >= {"_stages", "_tiles"}
    assert "_m_tiles" not in calls["_stages"] | calls["_tiles"] and "_stages" not in calls["_tiles"]


# ---- memoised, frozen --------------------------------------------------------------------------------
def test_memoised_per_spec_config_and_arch():
    spec = _spec()
    config = _config(spec)
    geo = prefill_geometry(spec, config)
    assert prefill_geometry(_spec(), dict(config)) is geo  # an equal spec, a copy of the config
    # the split-KV granule is no geometry parameter: the same object
    assert prefill_geometry(spec, {**config, "partition_size": 0}) is geo
    assert prefill_geometry(spec, {**config, "warps": 2}) is not geo
    sm80, sm90 = prefill_geometry(spec_for_arch(spec, "sm_80"), config), prefill_geometry(spec_for_arch(spec, "sm_90"), config)
    assert sm80 is not sm90 and sm80 is not geo
    with pytest.raises(dataclasses.FrozenInstanceError):
        geo.warps = 1  # type: ignore[misc]


def test_a_collected_spec_leaves_no_memo_behind():
    """The memo in front of the spec's hash is by spec object; a collected spec's entry goes with it."""
    spec = _spec(**{"attention.head_dim": 64})
    ident = id(spec)
    prefill_geometry(spec, _config(spec))
    assert ident in pg._BY_SPEC
    del spec
    gc.collect()
    assert ident not in pg._BY_SPEC


# ---- the path ----------------------------------------------------------------------------------------
def test_wgmma_on_sm_90_and_mma_sync_on_sm_80():
    """The same spec and config: the Hopper body for sm_90 (a producer warpgroup besides the consumers,
    one m tile, the unpadded tiles' shared memory), mma.sync for sm_80 with the reason."""
    spec = _spec()
    config = _config(spec, {"warps": 0, "kv_tile": 0, "stages": 0})
    hopper, ampere = (prefill_geometry(spec_for_arch(spec, a), config) for a in ("sm_90", "sm_80"))
    assert hopper.path == "wgmma" and hopper.refusal is None and hopper.m_tiles == 1
    assert hopper.threads == 32 * hopper.warps + PRODUCER_THREADS and hopper.max_registers == 0
    assert hopper.smem_bytes == wgmma_smem_bytes(spec, hopper.warps, hopper.kv_tile, hopper.stages)
    assert ampere.path == "mma" and ampere.refusal == "no wgmma before sm_90"
    assert ampere.threads == 32 * ampere.warps and not ampere.setmaxnreg and ampere.launch_registers == 0
    assert ampere.smem_bytes == smem_bytes(spec, ampere.warps, ampere.kv_tile, ampere.stages, ampere.m_tiles)
    assert ampere.rows == 16 * ampere.warps * ampere.m_tiles


@pytest.mark.parametrize("overrides,config,why", [
    ({"targets": ["sm_80"]}, {}, "no wgmma before sm_90"),
    ({"targets": ["sm_100"]}, {}, "sm_100 has no wgmma (an sm_90a instruction)"),
    ({"dtype.q": "fp32", "kv_cache.dtype": "fp32"}, {}, "wgmma takes fp16 or bf16 operands (q is fp32)"),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"}, {}, "it copies a cache in q's type, unscaled"),
    ({"kv_cache.layout": "vllm", "kv_cache.order": None}, {}, "it copies a cache in q's type, unscaled"),
    ({"attention.head_dim": 96}, {}, "head dims must be multiples of 64 up to 256"),
    ({}, {"warps": 2}, "warps 2: the consumers are 4 or 8 warps"),
    ({"attention.head_dim": 256}, {"warps": 8, "kv_tile": 128, "stages": 1}, "registers a consumer thread, more than 232"),
    ({"attention.head_dim": 256}, {"warps": 4, "kv_tile": 64, "stages": 4}, "bytes of shared memory, more than"),
], ids=["sm_80", "sm_100", "fp32", "fp8", "vllm", "d96", "warps2", "registers", "smem"])
def test_refusal_reasons(overrides, config, why):
    """Each rule the Hopper body needs, broken alone, is the refusal; auto then takes mma.sync, and
    the refusal is there whatever path the config asks for."""
    spec = _spec(**{"targets": ["sm_90"], **overrides})
    auto = prefill_geometry(spec, _config(spec, config))
    assert why in auto.refusal and auto.path == "mma"
    assert prefill_geometry(spec, _config(spec, {**config, "path": 1})).refusal == auto.refusal
    assert prefill_geometry(spec, _config(spec, {**config, "path": 2})).path == "wgmma"  # forced: check_config refuses
    assert any(auto.refusal in p for p in PAGED_PREFILL.check_config(spec, _config(spec, {**config, "path": 2})))


# ---- shared memory -----------------------------------------------------------------------------------
def test_automatic_tiles_stay_under_the_target():
    for overrides in ({}, {"attention.head_dim": 256}, {"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head"}):
        spec = _spec(**overrides)
        geo = prefill_geometry(spec_for_arch(spec, "sm_80"), _config(spec, {"warps": 0, "kv_tile": 0}))
        assert geo.smem_bytes <= SMEM_TARGET, (overrides, geo)


def test_an_explicit_config_past_the_arch_limit_is_refused_there_only():
    """4 warps of 128-key tiles in 2 stages fit sm_80's 163 KiB but not sm_86's 99 KiB."""
    spec = _spec(targets=["sm_80", "sm_86"])
    config = _config(spec, {"warps": 4, "kv_tile": 128, "stages": 2, "m_tiles": 1, "path": 1})
    need = smem_bytes(spec, 4, 128, 2, 1)
    for arch in ("sm_80", "sm_86"):
        seen = spec_for_arch(spec, arch)
        assert prefill_geometry(seen, config).smem_bytes == need
        limit = limits_for(arch).smem_per_block
        problems = PAGED_PREFILL.check_config(seen, config)
        assert (problems == []) == (need <= limit), (arch, need, limit)
        if need > limit:
            assert f"need {need} bytes of shared memory, more than {limit}" in problems[0]
    assert limits_for("sm_86").smem_per_block < need <= limits_for("sm_80").smem_per_block


# ---- every reader takes the object -------------------------------------------------------------------
def _bundled() -> list:
    specs = [load_spec(p) for p in sorted((ROOT / "specs").glob("*.yaml"))]
    specs += [load_spec(p) for p in sorted((ROOT / "examples" / "specs").glob("*.yaml"))]
    return [s for s in specs if family_for(s) is PAGED_PREFILL]


CONFIGS = [None, {"path": 1}, {"path": 0, "warps": 0, "kv_tile": 0, "stages": 0},
           {"warps": 2, "kv_tile": 64, "stages": 1, "partition_size": 0}, {"warps": 4, "kv_tile": 32, "stages": 2},
           {"m_tiles": 1, "path": 1, "partition_size": 0}]


def _constant(source: str, name: str) -> str:
    return re.search(rf"static constexpr \w+ {name} = (\w+);", source).group(1)


def test_rendered_constants_and_kernels_are_the_geometry():
    """Every bundled prefill spec, each target's body, a handful of configs the tuner and the
    benchmarks use: the Cfg constants, the launch bound and the kernel declaration are the object's."""
    checked = 0
    for spec in _bundled():
        for arch in spec.targets:
            seen = spec_for_arch(spec, arch)
            for config in CONFIGS:
                resolved = _config(spec, config)
                if PAGED_PREFILL.check_config(seen, resolved):
                    continue
                geo = prefill_geometry(seen, resolved)
                source = render(spec, config, arch).source
                got = {n: _constant(source, n) for n in ("WARPS", "KV_TILE", "STAGES", "M_TILES", "KV_PATH",
                                                          "SMEM_BYTES", "FMA_SCRATCH")}
                assert got == {"WARPS": str(geo.warps), "KV_TILE": str(geo.kv_tile), "STAGES": str(geo.stages),
                               "M_TILES": str(geo.m_tiles), "KV_PATH": str(KV_PATHS.index(geo.kv_path)),
                               "SMEM_BYTES": str(geo.smem_bytes), "FMA_SCRATCH": str(geo.fma_scratch).lower()}, \
                    (spec.name, arch, config)
                assert ("paged_prefill_wgmma_body<Cfg>" in source) == geo.wgmma
                if geo.wgmma:
                    assert _constant(source, "SETMAXNREG") == str(geo.setmaxnreg).lower()
                bound = f"__maxnreg__({geo.max_registers})" if geo.max_registers else f"__launch_bounds__({geo.threads})"
                assert f"{bound} {spec.name}(" in source
                main = PAGED_PREFILL.kernels(seen, resolved)[0]
                assert (main.block, main.smem, main.launch_registers) == (geo.threads, geo.smem_bytes,
                                                                          geo.launch_registers)
                checked += 1
    assert checked >= 30  # 7 specs, most with two targets
