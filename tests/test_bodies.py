"""kgen/bodies.py: each arch's body. The rules (which built body a device runs, which the CPU backend
runs, archs sharing a source) on arch strings; then a two-target prefill build: one body per arch,
one Kernel, every body verified on the CPU backend, `archs` beyond the spec's targets, and a body
forced onto an arch that cannot take it refused."""

from __future__ import annotations

import pytest

import kgen
from kgen.bodies import arch_number, cpu_arch, dispatch, groups, newest, spec_for_arch
from kgen.errors import KgenUserError
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.attention.prefill_geometry import prefill_geometry
from kgen.families.base import resolve_config

# {arch built: arch-specific (an sm_90a body runs on sm_90 alone)}
HOPPER_BUILD = {"sm_80": False, "sm_90": True}


@pytest.mark.parametrize("device,expect", [
    ("sm_80", "sm_80"), ("sm_90", "sm_90"),  # built: the device's own
    ("sm_86", "sm_80"), ("sm_89", "sm_80"),  # not built: the newest older portable body
    ("sm_100", "sm_80"),                     # sm_90's body is sm_90a: it cannot run on sm_100
    ("sm_75", None),                         # older than every body
])
def test_the_device_runs_its_own_body_else_the_newest_older_portable_one(device, expect):
    assert dispatch(HOPPER_BUILD, device) == expect


def test_a_portable_sm_90_body_serves_a_newer_gpu():
    assert dispatch({"sm_80": False, "sm_90": False}, "sm_120") == "sm_90"
    assert dispatch({"sm_90": True}, "sm_120") is None


def test_the_cpu_backend_runs_the_newest_arch_unless_told():
    assert newest(["sm_90", "sm_80", "sm_89"]) == "sm_90" and arch_number("sm_90a") == 90
    assert cpu_arch(["sm_80", "sm_90"]) == "sm_90"
    assert cpu_arch(["sm_80", "sm_90"], "sm_80") == "sm_80"
    with pytest.raises(ValueError):
        newest([])


def test_archs_sharing_a_source_are_one_body():
    assert groups({"sm_80": "a", "sm_86": "a", "sm_90": "b"}) == [["sm_90"], ["sm_86", "sm_80"]]
    assert groups({"sm_80": "a", "sm_90": "a"}) == [["sm_90", "sm_80"]]


# ---- a two-target prefill spec ------------------------------------------------------------------------
BASE = {
    "kgen": 1, "name": "arch_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64, "causal": True},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_80", "sm_90"],
}
SMALL = {"kv_tile": 16, "warps": 4, "partition_size": 0}  # small tiles: fast on the CPU backend


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def test_the_family_sees_one_arch_at_a_time():
    spec = _spec()
    config = resolve_config(PAGED_PREFILL, spec, SMALL)
    assert spec_for_arch(spec, "sm_90").targets == ["sm_90"] and spec_for_arch(spec, None) is spec
    assert prefill_geometry(spec_for_arch(spec, "sm_80"), config).path == "mma"
    assert prefill_geometry(spec_for_arch(spec, "sm_90"), config).path == "wgmma"


def test_a_two_target_prefill_build_has_two_bodies_each_verified_on_the_cpu():
    kernel = kgen.build(_spec(), backend="cpu", config=SMALL, archs=[], seed=7)
    bodies = kernel.artifacts["bodies"]
    assert {a: r.body for a, r in bodies.items()} == {"sm_80": "mma.sync", "sm_90": "wgmma"}
    assert "paged_prefill_wgmma_body<Cfg>" in bodies["sm_90"].source
    assert "paged_prefill_body<Cfg>" in bodies["sm_80"].source
    assert bodies["sm_80"].why == "not the Hopper body: no wgmma before sm_90"
    assert all(f"spec sha256 {kernel.spec.spec_hash()[:16]}" in r.source for r in bodies.values())  # the whole spec's
    # one Kernel: the CPU backend runs the newest arch's body, with that body's launch
    assert kernel.arch == "sm_90" and kernel.source == bodies["sm_90"].source
    assert PAGED_PREFILL.kernels(kernel.body_spec, kernel.config)[0].block == 4 * 32 + 128  # + the producer
    # both bodies ran the whole matrix, with the same seed, named in one report
    assert kernel.report.passed, kernel.report.summary()
    ran = {}
    for case in kernel.report.cases:
        label, name = case.name[1:].split("] ")
        ran.setdefault(label, []).append(name)
    assert set(ran) == {"sm_90 wgmma", "sm_80 mma.sync"} and ran["sm_90 wgmma"] == ran["sm_80 mma.sync"]


def test_the_cpu_body_can_be_chosen():
    kernel = kgen.build(_spec(), backend="cpu", config=SMALL, archs=[], verify=False, body_arch="sm_80")
    assert kernel.arch == "sm_80" and kernel.source == kernel.artifacts["bodies"]["sm_80"].source
    assert PAGED_PREFILL.kernels(kernel.body_spec, kernel.config)[0].block == 4 * 32  # mma.sync: no producer


def test_archs_beyond_an_sm_90_only_spec_each_get_their_body():
    """It once failed: the body came from the spec's targets (wgmma), compiled for sm_80 too."""
    kernel = kgen.build(_spec(targets=["sm_90"]), backend="cpu", config=SMALL, archs=["sm_80", "sm_90"],
                        verify=False)
    assert {a: c.arch for a, c in kernel.artifacts["cubins"].items()} == {"sm_80": "sm_80", "sm_90": "sm_90a"}
    assert {a: r.body for a, r in kernel.artifacts["bodies"].items()} == {"sm_80": "mma.sync", "sm_90": "wgmma"}


def test_a_body_forced_onto_an_arch_that_cannot_take_it_is_a_config_error():
    with pytest.raises(KgenUserError, match=r"config .* for target sm_80: path 2 \(wgmma\) cannot build for sm_80: "
                                            r"no wgmma before sm_90 \(accepted there: path 0, auto, or 1, mma.sync\)"):
        kgen.build(_spec(), backend="cpu", config={**SMALL, "path": 2}, archs=[], verify=False)
    # the same config on sm_90 alone builds the Hopper body
    kernel = kgen.build(_spec(targets=["sm_90"]), backend="cpu", config={**SMALL, "path": 2}, archs=[], verify=False)
    assert kernel.artifacts["bodies"]["sm_90"].body == "wgmma"


def test_one_body_for_every_arch_is_verified_once():
    """A spec whose archs get the same source (fp32 q: fp32 FMAs everywhere) is one body, no labels."""
    spec = _spec(**{"dtype.q": "fp32", "kv_cache.dtype": "fp32"})
    kernel = kgen.build(spec, backend="cpu", config=SMALL, archs=[], seed=7)
    bodies = kernel.artifacts["bodies"]
    assert bodies["sm_80"].source == bodies["sm_90"].source and bodies["sm_90"].body == "fma"
    assert kernel.report.passed and not any(c.name.startswith("[") for c in kernel.report.cases)
