"""ptxas as a witness (kgen/compile/advisories.py, kgen/compile/nvrtc.py): its numbered performance
advisories and the local memory of its resource report become Advisory(code, message, kernel) on
the kernel they are about, from real compiles of kernels that draw them, and reach Kernel.resources,
Kernel.advisories and the build's manifest."""

from __future__ import annotations

import json

import pytest
from conftest import SPILLY_PREFILL, tiny_decode

import kgen
from kgen.cache import ArtifactCache
from kgen.compile.advisories import SPILL, STACK, advisories_of, numbered_advisories
from kgen.compile.nvrtc import compile_cubin, parse_ptxas_report, resources_as_dict
from kgen.generated import write_generated

HEAD = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "kgen/platform.cuh"
#include "kgen/mma.cuh"
#include "kgen/hopper.cuh"
"""
# A's registers written between wgmma.fence and the wgmma that reads them, in a branch on the thread
# index: what the Hopper prefill body did. ptxas fences them itself and serialises (C7520).
WGMMA_A_AFTER_FENCE = r"""
extern "C" __global__ void late_a(const float* in, float* out, int n) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  const unsigned long long db = kgen::wgmma_desc(smem, 16, 1024, 128);
  if (threadIdx.x / 128 < n) {
    kgen::wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
      const unsigned a[4] = {kgen::pack2<__half>(in[kk], in[kk + 1]), kgen::pack2<__half>(in[kk + 2], in[kk + 3]),
                             kgen::pack2<__half>(in[kk + 4], in[kk + 5]), kgen::pack2<__half>(in[kk + 6], in[kk + 7])};
      kgen::wgmma_rs<__half, 64, 1>(d, a, db + 64 * kk, 1);
    }
    kgen::wgmma_commit();
    kgen::wgmma_wait<0>();
  }
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}
"""
# The same products with A written before the fence, in uniform control flow: nothing to say.
WGMMA_A_BEFORE_FENCE = r"""
extern "C" __global__ void early_a(const float* in, float* out) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  const unsigned long long db = kgen::wgmma_desc(smem, 16, 1024, 128);
  unsigned a[4][4];
  for (int kk = 0; kk < 4; ++kk)
    for (int j = 0; j < 4; ++j) a[kk][j] = kgen::pack2<__half>(in[kk + 2 * j], in[kk + 2 * j + 1]);
  kgen::wgmma_fence_operand(a);
  kgen::wgmma_fence_operand(d);
  kgen::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) kgen::wgmma_rs<__half, 64, 1>(d, a[kk], db + 64 * kk, 1);
  kgen::wgmma_commit();
  kgen::wgmma_wait<0>();
  kgen::wgmma_fence_operand(d);
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}
"""
# A local array indexed by a run-time value lives in local memory: a stack frame.
STACK_FRAME = r"""
extern "C" __global__ void on_stack(const int* in, int* out, int n) {
  int buf[64];
  for (int i = 0; i < 64; ++i) buf[i] = 0;
  for (int i = 0; i < n; ++i) buf[in[i] & 63] += i;
  out[threadIdx.x] = buf[in[threadIdx.x] & 63];
}
"""


def test_serialised_wgmma_is_an_advisory_on_its_kernel(tmp_path):
    art = compile_cubin(HEAD + WGMMA_A_AFTER_FENCE, "sm_90a", cache=ArtifactCache(tmp_path))
    advice = art.resources["late_a"].advisories
    assert advice and all(a.kernel == "late_a" for a in advice), art.log
    assert any(a.code == "C7520" and "serialized" in a.message for a in advice), art.log
    # every numbered line of ptxas's own log became one, and nothing else did
    assert sorted(a.code for _, a in numbered_advisories(art.log)) == sorted(a.code for a in advice)


def test_a_written_before_the_fence_draws_none(tmp_path):
    art = compile_cubin(HEAD + WGMMA_A_BEFORE_FENCE, "sm_90a", cache=ArtifactCache(tmp_path))
    assert art.resources["early_a"].advisories == [], art.log
    assert "(C75" not in art.log


def test_a_stack_frame_is_local_memory(tmp_path):
    art = compile_cubin(HEAD + STACK_FRAME, "sm_80", cache=ArtifactCache(tmp_path))
    res = art.resources["on_stack"]
    assert res.stack_frame > 0
    assert [a.code for a in res.advisories] == [STACK]
    assert f"{res.stack_frame} bytes stack frame" in res.advisories[0].message


def test_the_log_s_forms():
    """ptxas's layout: a numbered advisory names its function (before or after the entry's own lines);
    spills and the stack come from the entry's resource report."""
    log = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 12 by compiler to allow use of "
           "registers in GMMA in function 'a'\n"
           "ptxas info    : Compiling entry function 'a' for 'sm_90a'\n"
           "ptxas info    : Function properties for a\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 32 bytes smem\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_90a'\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 40 registers\n")
    res = parse_ptxas_report(log)
    assert [(a.code, a.kernel) for a in res["a"].advisories] == [("C7519", "a"), (SPILL, "a"), (STACK, "a")]
    assert res["a"].advisories[0].message.startswith("warpgroup.arrive is injected")
    assert res["b"].advisories == []
    flat = advisories_of({"sm_90": resources_as_dict(res)})
    assert {(f["arch"], f["kernel"], f["code"]) for f in flat} == {("sm_90", "a", "C7519"), ("sm_90", "a", SPILL),
                                                                   ("sm_90", "a", STACK)}


@pytest.mark.parametrize("arch", ["sm_80"])
def test_a_built_kernel_carries_them_into_its_resources_and_manifest(tmp_path, arch):
    """A clean kernel: an empty list per kernel, in Kernel.resources and in the manifest written."""
    kern = kgen.build(tiny_decode(), backend="cpu", archs=[arch], seed=1)
    assert kern.advisories == []
    assert all(figures["advisories"] == [] for figures in kern.resources[arch].values())
    path = write_generated(kern, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert all(r["advisories"] == [] for r in manifest["cubins"][arch]["resources"].values())


def test_a_spilling_build_reports_its_local_memory():
    kern = kgen.build(kgen.spec_from_dict(SPILLY_PREFILL), backend="cpu", verify=False)
    res = kern.resources["sm_80"]["spilly_prefill"]
    assert res["spill_stores"] > 0 and res["stack_frame"] > 0
    assert [(a["code"], a["kernel"]) for a in res["advisories"]] == [(SPILL, "spilly_prefill"), (STACK, "spilly_prefill")]
    assert [(a["arch"], a["code"]) for a in kern.advisories] == [("sm_80", SPILL), ("sm_80", STACK)]
    assert f"{res['spill_stores']} bytes spill stores" in res["advisories"][0]["message"]
