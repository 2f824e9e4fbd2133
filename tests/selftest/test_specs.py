"""kgen/selftest/specs.py: which specs --quick keeps (one per kind, every kind) and which bodies a spec
gets (the spec as written, and the device's arch alone where that renders another body)."""

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


def test_a_spec_that_also_targets_sm80_gets_its_sm90_alone_body_too():
    spec = load_spec(Path(specs_dir()) / "llama3_8b_prefill.yaml")
    found = bodies(spec, "sm_90", quick=False)
    assert [t for _, t in found] == [None, ["sm_90"]]
    # the second body is a different kernel (the family's choice for sm_90 alone), not a repeat
    assert render(spec.with_overrides(targets=["sm_90"])).source != render(spec).source
    assert bodies(spec, "sm_90", quick=True) == found[:1]
    alone = load_spec(Path(specs_dir()) / "cache_write_fp8_e4m3.yaml")  # targets sm_90 only: one body
    assert [t for _, t in bodies(alone, "sm_90", quick=False)] == [None]
