"""No bundled spec draws a ptxas advisory (kgen/compile/advisories.py): at its default config, for every
arch it targets; and, for a prefill spec, retargeted to sm_90 alone (the Hopper wgmma body) at its
default config and at every config of its tuning space that takes the Hopper body. Cubins come from
the session's cache, shared with the other tests that build the same specs."""

from __future__ import annotations

import pytest
from conftest import ROOT, full_tier_except

from kgen.compile.nvrtc import compile_cubin
from kgen.families.attention.prefill_geometry import prefill_geometry
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.render import render
from kgen.spec.models import load_spec
from kgen.tune.search import expand_space

SPECS = sorted((ROOT / "specs").glob("*.yaml"))
PREFILL = [p for p in SPECS if load_spec(p).kind == "paged_prefill"]


def _advisories(source: str, arch: str) -> list[str]:
    art = compile_cubin(source, arch)
    return [f"{art.arch} {a}" for res in art.resources.values() for a in res.advisories]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_default_config_on_every_target(path):
    spec = load_spec(path)
    found = [a for arch in spec.targets for a in _advisories(render(spec, None, arch).source, arch)]  # each its body
    assert found == [], found


def _hopper_configs(path) -> list[tuple[str, dict]]:
    spec = load_spec(path).with_overrides(targets=["sm_90"])
    family = family_for(spec)
    configs = [resolve_config(family, spec, None)]
    if spec.tuning is not None and spec.tuning.params:
        configs += expand_space(spec).configs
    seen, out = set(), []
    for c in configs:
        key = tuple(sorted(c.items()))
        if key not in seen and prefill_geometry(spec, c).wgmma:
            seen.add(key)
            out.append((path.stem, c))
    return out


HOPPER = [pair for p in PREFILL for pair in _hopper_configs(p)]


def test_prefill_specs_reach_the_hopper_body_when_they_target_sm_90_alone():
    """The sweep below is not empty: the fp16/bf16 prefill specs take the wgmma body on sm_90 alone."""
    assert {name for name, _ in HOPPER} >= {"llama3_8b_prefill", "gpt_oss_20b_prefill", "deepseek_v3_mha_prefill"}


# The default tier keeps each spec's default config (the first of its entries); the full tier adds every
# Hopper config of the tuning spaces (about 30 compiles).
_FIRST = {i for i, (name, _) in enumerate(HOPPER) if all(n != name for n, _ in HOPPER[:i])}


@pytest.mark.parametrize("name,config", full_tier_except(HOPPER, _FIRST),
                         ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in sorted(c.items())) for n, c in HOPPER])
def test_hopper_configs_retargeted_to_sm_90(name, config):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml").with_overrides(targets=["sm_90"])
    found = _advisories(render(spec, config).source, "sm_90")
    assert found == [], found
