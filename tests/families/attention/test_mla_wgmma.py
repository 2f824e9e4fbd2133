"""The Hopper (wgmma) body of mla decode (templates/common/paged_mla_wgmma.cuh, kgen/families/attention/
mla_wgmma.py): which arch's render takes it and why the others do not, CPU-backend verification
against the float64 reference (single pass, split-KV, race mode), mutants the verifier must catch,
and the sm_90a compile: no spills, no ptxas advisories, the wgmma ordering rules kept."""

from __future__ import annotations

import pytest
from conftest import ROOT, inline_provided

import kgen
from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import SM90A_MARKER, compile_cubin, compile_ptx
from kgen.compile.wgmma_order import check_ptx, check_sass
from kgen.errors import KgenUserError
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.render import render
from kgen.spec.models import load_spec
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

CUOBJDUMP = find_cuobjdump()
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump (nvidia-cuda-cuobjdump wheel) is absent")
DEEPSEEK = ROOT / "specs" / "deepseek_v3_mla_decode.yaml"
# A small MLA decode (16 heads: a 64-row block three quarters padding; rows of 192 = 128 + 64 rope)
SMALL = {"kgen": 1, "name": "mla_decode_small", "kind": "paged_decode", "tail_masking": True, "targets": ["sm_90"],
         "attention": {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 192, "v_head_dim": 128,
                       "softmax_scale": 0.1147},
         "kv_cache": {"block_size": 16, "layout": "mla", "dtype": "bf16"}, "dtype": {"q": "bf16"}}


def _spec(**overrides):
    return kgen.spec_from_dict(SMALL).with_overrides(**overrides)


def test_sm90_takes_the_hopper_body_and_older_archs_the_mma_one():
    spec = _spec(targets=["sm_80", "sm_90"])
    hopper, ampere = render(spec, None, "sm_90"), render(spec, None, "sm_80")
    assert hopper.body == "wgmma" and "paged_mla_decode_wgmma_body<Cfg>" in hopper.source
    assert SM90A_MARKER in hopper.source[:2048]
    assert ampere.body == "mma.sync" and "no wgmma before sm_90" in ampere.why
    assert "paged_mla_decode_body<Cfg>" in ampere.source and SM90A_MARKER not in ampere.source
    forced = render(spec, {"path": 1}, "sm_90")
    assert forced.body == "mma.sync" and forced.why == "path 1 (mma) in the config"


@pytest.mark.parametrize("overrides,reason", [
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"}, "fp8 caches take the mma.sync body"),
    ({"attention.v_head_dim": 64}, "v_head_dim a multiple of 128"),
])
def test_a_spec_the_hopper_body_cannot_take_falls_back_with_the_reason(overrides, reason):
    spec = _spec(**overrides)
    rendered = render(spec)
    assert rendered.body == "mma.sync" and reason in rendered.why, rendered.why
    with pytest.raises(KgenUserError, match=r"path 2 \(wgmma\) cannot build for sm_90: .*" + reason):
        render(spec, {"path": 2})


def test_path_2_on_an_older_arch_is_refused():
    with pytest.raises(KgenUserError, match=r"path 2 \(wgmma\) cannot build for sm_80: no wgmma before sm_90"):
        render(_spec(targets=["sm_80"]), {"path": 2})
    with pytest.raises(KgenUserError, match=r"path must be 0 \(auto\), 1 \(mma\) or 2 \(wgmma\) \(got 3\)"):
        render(_spec(), {"path": 3})


@pytest.mark.parametrize("overrides,config", [
    ({}, {}),
    ({"attention.num_q_heads": 72, "kv_cache.block_size": 64}, {"partition_size": 32}),  # two row blocks, split
    ({"tail_masking": False, "dtype.q": "fp16", "kv_cache.dtype": "fp16", "kv_cache.block_size": 1}, {}),
], ids=["h16", "h72-b64-split", "fp16-notail-b1"])
def test_decode_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(**overrides), backend="cpu", verify=False, archs=[], config=config)
    assert kern.artifacts["bodies"]["sm_90"].body == "wgmma"
    report = verify(kern, seed=11)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    names = {c.name.removesuffix("(rounded)") for c in report.cases}
    assert {"len_1", "len_B+1", "long", "mixed_batch", "shared_prefix", "padded_pool"} <= names


def test_a_two_arch_build_verifies_both_bodies_on_cpu():
    """[sm_80, sm_90]: two sources (mma.sync, wgmma); the CPU build verifies each, cases named by body."""
    kern = kgen.build(_spec(targets=["sm_80", "sm_90"]), backend="cpu", archs=[], seed=3)
    bodies = kern.artifacts["bodies"]
    assert (bodies["sm_80"].body, bodies["sm_90"].body) == ("mma.sync", "wgmma")
    assert kern.report.passed, kern.report.summary()
    labels = {c.name.split("]", 1)[0] + "]" for c in kern.report.cases}
    assert labels == {"[sm_90 wgmma]", "[sm_80 mma.sync]"}, labels


def test_decode_verifies_in_race_mode():
    kern = kgen.build(_spec(), backend="cpu", config={"partition_size": 32}, archs=[], race_check=True, seed=5)
    assert kern.report.passed, kern.report.summary()


@pytest.mark.full  # ~20-40 s: 128 heads (two row blocks) at DeepSeek's 576 / 512 on the CPU backend
def test_deepseek_spec_verifies_on_cpu():
    kern = kgen.build(load_spec(DEEPSEEK), backend="cpu", verify=False, archs=[])
    assert kern.artifacts["bodies"]["sm_90"].body == "wgmma"
    report = verify(kern, seed=7)
    assert report.passed, report.summary()


MUTANTS = [
    ("row sums of one warpgroup", "st[rr].l = red_l[row0 + 8 * rr] + red_l[S::ROWS + row0 + 8 * rr];",
     "st[rr].l = red_l[wg * S::ROWS + row0 + 8 * rr];"),
    ("no barrier before P V", "fence_proxy_async_shared();  // P's generic stores before the wgmma's reads\n"
     "    __syncthreads();", "fence_proxy_async_shared();"),
    ("own maximum only", "const float m = fmaxf(red_m[row], red_m[S::ROWS + row]);",
     "const float m = red_m[wg * S::ROWS + row];"),
    ("V from the rope end", "wgmma_desc(operand + (col_off / 64) * (KT * 128)",
     "wgmma_desc(operand + (col_off / 64 + 1) * (KT * 128)"),
    ("tail key not masked", "seen{max(k_begin, keys.begin), keys.end};", "seen{max(k_begin, keys.begin), keys.end + 1};"),
    # the wgmma tile part's (kgen/attention/wgmma_tile.cuh)
    ("tiles not swizzled", "return off ^ (((off >> 7) & 7) << 4);", "return off;"),
    ("S adds onto the last tile's", "(kk % 4) * 32), kk > 0 ? 1 : 0);", "(kk % 4) * 32), 1);"),
    ("a thread's l of one row", "l_tile[wg_row(e)] += s[e];", "l_tile[0] += s[e];"),
]


@pytest.mark.parametrize("old,new", [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_verifier_rejects_mutant(old, new):
    spec = _spec(**{"attention.num_q_heads": 72})
    rendered = render(spec, {"partition_size": 32})
    # the body and its wgmma tile part as kernel code (provided headers)
    source = inline_provided(inline_provided(rendered.source), "kgen/attention/wgmma_tile.cuh")
    assert source.count(old) == 1, old
    kern = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    assert not verify(kern, seed=99).passed


@needs_cuobjdump
@pytest.mark.parametrize("overrides", [
    None,  # the DeepSeek spec: P V in m64n256k16
    {"attention.num_q_heads": 72},  # 192 / 128: m64n64k16
    {"dtype.q": "fp16", "kv_cache.dtype": "fp16", "attention.head_dim": 320, "attention.v_head_dim": 256},
    {"attention.head_dim": 448, "attention.v_head_dim": 384},  # m64n192k16
], ids=["deepseek", "d192-h72", "fp16-d320", "d448"])
def test_the_body_compiles_for_sm90a_without_spills_advisories_or_order_problems(overrides):
    spec = load_spec(DEEPSEEK) if overrides is None else _spec(**overrides)
    rendered = render(spec, None if overrides is None else {"partition_size": 64})
    cache = ArtifactCache()
    art = compile_cubin(rendered.source, "sm_90", cache=cache)
    assert rendered.body == "wgmma" and art.arch == "sm_90a"
    for name, res in art.resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (name, res)
        assert res.advisories == [], (name, res.advisories)
    ptx, sass = check_ptx(compile_ptx(rendered.source, "sm_90", cache=cache)), check_sass(sass_text(art.cubin, CUOBJDUMP))
    assert ptx == [] and sass == [], [str(p) for p in ptx + sass]
