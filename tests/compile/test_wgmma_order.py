"""The wgmma ordering rules the CPU backend cannot observe (its fences are no-ops), checked in the PTX
and the SASS of the Hopper prefill body (kgen/compile/wgmma_order.py): the body as built passes, and
mutants of its wgmma tile part (kgen/attention/wgmma_tile.cuh) that break a rule (P's A fragments
written after wgmma.fence, as the body once did; a batch's wait dropped, so the softmax reads S
before it completed) are caught. No GPU needed."""

from __future__ import annotations

import pytest
from conftest import ROOT

from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin, compile_ptx
from kgen.compile.provided import kgen_headers
from kgen.compile.wgmma_order import check_ptx, check_sass
from kgen.perf.sass import find_cuobjdump, sass_text
from kgen.render import render
from kgen.spec.models import load_spec

CUOBJDUMP = find_cuobjdump()
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump (nvidia-cuda-cuobjdump wheel) is absent")
HEADER = "kgen/bodies/paged_prefill_wgmma.cuh"

PART = "kgen/attention/wgmma_tile.cuh"  # the tile's products, where the ordering rules live

# P packed into A inside the P V loop, after wgmma.fence: each wgmma_rs reads registers written
# inside the window (the body before the fix).
FENCED_P = ("""  wgmma_fence_operand(pa);
  wg_batch(o, [&] {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) wgmma_rs<T, N, 1>(o, pa[kk], wg_desc_plus(dv, kk * 16 * 128), 1);
  });""", """  wg_batch(o, [&] {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) pa[kk][j] = pack2<T>(p[8 * kk + 2 * j + 1], p[8 * kk + 2 * j]);
      wgmma_rs<T, N, 1>(o, pa[kk], wg_desc_plus(dv, kk * 16 * 128), 1);
    }
  });""")
# A batch's wait dropped: the softmax reads S (and the next tile's rescale O) with no wait for the
# wgmma that writes it.
NO_WAIT = ("""  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(acc);""", """  wgmma_commit();
  wgmma_fence_operand(acc);""")


def _hopper_source(config: dict | None = None) -> str:
    """llama3_8b_prefill retargeted to sm_90 alone (the Hopper body), the body and its wgmma tile part
    copied in as kernel code."""
    spec = load_spec(ROOT / "specs" / "llama3_8b_prefill.yaml").with_overrides(targets=["sm_90"])
    source = render(spec, config).source
    for header in (HEADER, PART):  # the body includes the part
        include = f'#include "{header}"\n'
        assert source.count(include) == 1
        source = source.replace(include, kgen_headers()[header].replace("#pragma once", ""))
    return source


def _checked(source: str, cache: ArtifactCache):
    art = compile_cubin(source, "sm_90", cache=cache)
    return art, check_ptx(compile_ptx(source, "sm_90", cache=cache)), check_sass(sass_text(art.cubin, CUOBJDUMP))


@needs_cuobjdump
@pytest.mark.parametrize("config", [None, {"warps": 8, "kv_tile": 128}], ids=["spec-defaults", "two-consumers-kt128"])
def test_the_hopper_body_keeps_the_rules(config):
    art, ptx, sass = _checked(_hopper_source(config), ArtifactCache())
    assert art.arch == "sm_90a"
    assert ptx == [] and sass == [], [str(p) for p in ptx + sass]
    assert all(r.advisories == [] for r in art.resources.values()), art.log


@needs_cuobjdump
def test_p_written_after_the_fence_is_caught():
    source = _hopper_source()
    assert source.count(FENCED_P[0]) == 1
    art, ptx, sass = _checked(source.replace(*FENCED_P), ArtifactCache())
    assert ptx and all("after the wgmma.fence" in p.message and "cvt.rn.f16x2.f32" in p.message for p in ptx), ptx
    assert any("split a batch" in p.message for p in sass), [str(p) for p in sass]
    # and ptxas says so itself: it injected the arrives the source lacked
    assert any(a.code in ("C7519", "C7520") for r in art.resources.values() for a in r.advisories), art.log


@needs_cuobjdump
def test_s_read_before_its_wait_is_caught():
    source = _hopper_source()
    assert source.count(NO_WAIT[0]) == 1
    art, ptx, _ = _checked(source.replace(*NO_WAIT), ArtifactCache())
    assert ptx and all("before a wgmma.wait_group completed it" in p.message for p in ptx), ptx


def test_the_ptx_rules_on_hand_written_text():
    """The two windows on a few lines of PTX: an access before the fence is fine, one between fence and
    wgmma or between wgmma and its wait is not; same-shape wgmmas chaining one accumulator are."""
    def ptx(*body: str) -> str:
        return ".visible .entry k(\n)\n{\n" + "\n".join(body) + "\n}\n"
    w = "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, %rd1, p, 1, 1, 1;"
    good = ptx("mov.b32 %r1, 0;", "wgmma.fence.sync.aligned;", w, w, "wgmma.commit_group.sync.aligned;",
               "wgmma.wait_group.sync.aligned 0;", "add.f32 %f5, %f1, %f2;")
    assert check_ptx(good) == []
    late = check_ptx(ptx("wgmma.fence.sync.aligned;", "mov.b32 %r2, 0;", w, "wgmma.commit_group.sync.aligned;",
                         "wgmma.wait_group.sync.aligned 0;"))
    assert len(late) == 1 and "%r2" in late[0].message and "PTX line 5" == late[0].where
    early_read = check_ptx(ptx("wgmma.fence.sync.aligned;", w, "wgmma.commit_group.sync.aligned;",
                               "add.f32 %f5, %f1, %f2;", "wgmma.wait_group.sync.aligned 0;"))
    assert len(early_read) == 1 and "before a wgmma.wait_group" in early_read[0].message
    # wait_group 1 with one group committed after w's: w's group is complete
    pipelined = ptx("wgmma.fence.sync.aligned;", w, "wgmma.commit_group.sync.aligned;", "wgmma.fence.sync.aligned;",
                    w.replace("%f1, %f2, %f3, %f4", "%f9, %f10, %f11, %f12").replace("%r1, %r2, %r3, %r4",
                                                                                     "%r5, %r6, %r7, %r8"),
                    "wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 1;", "add.f32 %f5, %f1, %f2;",
                    "wgmma.wait_group.sync.aligned 0;")
    assert check_ptx(pipelined) == []
    assert len(check_ptx(pipelined.replace("wait_group.sync.aligned 1;", "wait_group.sync.aligned 2;"))) == 1
    assert "no wgmma.fence" in check_ptx(ptx(w, "wgmma.commit_group.sync.aligned;",
                                             "wgmma.wait_group.sync.aligned 0;"))[0].message
