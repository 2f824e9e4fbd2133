"""kgen/selftest/specs.py: which specs --quick keeps (one per kind, every kind) and which bodies a spec
gets (the spec as written, and on a GPU each other target's body the device can run)."""

from __future__ import annotations

from pathlib import Path

from kgen.families.registry import FAMILIES
from kgen.paths import specs_dir
from kgen.render import render
from kgen.selftest.specs import QUICK_PICKS, bodies, choose
from kgen.spec.models import load_spec

BUNDLED = sorted(specs_dir().glob("*.yaml"))


def test_quick_keeps_one_spec_of_every_kind():
    picked = choose(BUNDLED, quick=True)
    kinds = [load_spec(p).kind for p in picked]
    assert sorted(kinds) == sorted({load_spec(p).kind for p in BUNDLED}) and set(kinds) <= set(FAMILIES)
    assert sorted(p.stem for p in picked) == sorted(QUICK_PICKS)
    assert choose(BUNDLED, quick=False) == BUNDLED


def test_quick_falls_back_to_the_first_spec_of_a_kind_without_a_pick():
    decode = [p for p in BUNDLED if load_spec(p).kind == "paged_decode" and p.stem not in QUICK_PICKS]
    assert choose(decode, quick=True) == [sorted(decode)[0]]


def test_an_sm_90_gpu_also_verifies_the_mma_sync_body_of_a_spec_that_targets_sm_80():
    """The as-written build runs the device's body (sm_90: the Hopper one); the sm_80 target's mma.sync
    body runs on sm_90 too, so the GPU verifies it as well. On the CPU backend the as-written build
    verifies every body; an sm_80 GPU cannot run sm_90's (sm_90a) body."""
    spec = load_spec(Path(specs_dir()) / "llama3_8b_prefill.yaml")
    found = bodies(spec, "sm_90", quick=False)
    assert [a for _, a in found] == [None, "sm_80"] and "mma.sync" in found[1][0]
    assert render(spec, None, "sm_90").source != render(spec, None, "sm_80").source  # another kernel
    assert bodies(spec, "sm_90", quick=True) == found[:1]
    assert bodies(spec, "sm_90", quick=False, cpu=True) == found[:1]
    assert [a for _, a in bodies(spec, "sm_80", quick=False)] == [None]
    alone = load_spec(Path(specs_dir()) / "cache_write_fp8_e4m3.yaml")  # targets sm_90 only: one body
    assert [a for _, a in bodies(alone, "sm_90", quick=False)] == [None]
