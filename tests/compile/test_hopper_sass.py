"""kgen's Hopper wrappers (templates/common/hopper.cuh) compile with NVRTC for sm_90a, as a kernel
includes them ("kgen/hopper.cuh"), into the instructions they name: SYNCS (mbarrier), UBLKCP
(cp.async.bulk), HGMMA and WARPGROUP (wgmma). No GPU needed."""

from __future__ import annotations

import re

import pytest

from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import CompileError
from kgen.perf.sass import find_cuobjdump, sass_text

HEAD = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "kgen/platform.cuh"
#include "kgen/mma.cuh"
#include "kgen/hopper.cuh"
"""
SYNC_AND_COPIES = r"""
extern "C" __global__ void copies(const unsigned char* src, int* out) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  __shared__ unsigned long long bar;
  if (threadIdx.x == 0) {
    kgen::mbar_init(&bar, 2);
    kgen::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    kgen::mbar_arrive_expect_tx(&bar, 256);
    kgen::bulk_copy_g2s(smem, src, 256, &bar);
  }
  if (threadIdx.x == 32) {
    kgen::mbar_expect_tx(&bar, 16);
    kgen::mbar_complete_tx(&bar, 16);
    kgen::mbar_arrive(&bar, 1);
  }
  kgen::mbar_wait(&bar, 0);
  int r = smem[threadIdx.x] + kgen::mbar_test_wait(&bar, 1) + kgen::mbar_try_wait(&bar, 0);
  out[threadIdx.x] = r;
  __syncthreads();
  if (threadIdx.x == 0) kgen::mbar_inval(&bar);
}
"""
WGMMA = r"""
extern "C" __global__ void products(const unsigned* ain, float* out) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  float d[128], e[32], f[96], h[48];
  for (int i = 0; i < 128; ++i) d[i] = 0.f;
  for (int i = 0; i < 32; ++i) e[i] = 0.f;
  for (int i = 0; i < 96; ++i) f[i] = 0.f;
  for (int i = 0; i < 48; ++i) h[i] = 0.f;
  const unsigned a[4] = {ain[threadIdx.x], ain[threadIdx.x + 1], ain[threadIdx.x + 2], ain[threadIdx.x + 3]};
  const unsigned long long da = kgen::wgmma_desc(smem, 16, 1024, 128), db = kgen::wgmma_desc(smem + 8192, 16, 1024, 128);
  kgen::wgmma_fence();
  kgen::wgmma_ss<__half, 256, 0, 0>(d, da, db, 0);
  kgen::wgmma_ss<__nv_bfloat16, 256, 0, 1>(d, da, db, 1);
  kgen::wgmma_rs<__half, 64, 1>(e, a, db, 0);
  kgen::wgmma_ss<__nv_bfloat16, 192, 1, 1>(f, da, db, 0);
  kgen::wgmma_rs<__nv_bfloat16, 96, 0>(h, a, db, 0);
  kgen::wgmma_commit();
  kgen::wgmma_wait<0>();
  for (int i = 0; i < 128; ++i) out[threadIdx.x * 160 + i] = d[i];
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 160 + 128 + i] = e[i] + f[i] + f[i + 64] + h[i] + h[i + 16];
}
"""

CUOBJDUMP = find_cuobjdump()
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump (nvidia-cuda-cuobjdump wheel) is absent")


def _opcodes(source: str, arch: str, tmp_path) -> set[str]:
    art = compile_cubin(HEAD + source, arch, cache=ArtifactCache(tmp_path))
    return set(re.findall(r"\b([A-Z][A-Z0-9]+(?:\.[A-Za-z0-9_]+)*)\b", sass_text(art.cubin, CUOBJDUMP)))


@needs_cuobjdump
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
def test_mbarrier_and_bulk_copies_compile_to_syncs_and_ublkcp(tmp_path, arch):
    ops = _opcodes(SYNC_AND_COPIES, arch, tmp_path)
    heads = {op.split(".")[0] for op in ops}
    assert {"SYNCS", "UBLKCP"} <= heads, sorted(heads)
    assert any(op.startswith("SYNCS.PHASECHK") for op in ops)  # the try_wait / test_wait


@needs_cuobjdump
def test_wgmma_compiles_to_hgmma_for_sm_90a(tmp_path):
    ops = _opcodes(WGMMA, "sm_90a", tmp_path)
    assert {"HGMMA.64x256x16.F32", "HGMMA.64x256x16.F32.BF16", "HGMMA.64x64x16.F32", "HGMMA.64x192x16.F32.BF16",
            "HGMMA.64x96x16.F32.BF16"} <= ops, sorted(o for o in ops if o.startswith("HGMMA"))
    assert {"WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE"} <= ops


def test_wgmma_for_plain_sm_90_is_refused_by_name(tmp_path):
    with pytest.raises(CompileError, match=r"wgmma needs the arch-specific target sm_90a"):
        compile_cubin(HEAD + WGMMA, "sm_90", cache=ArtifactCache(tmp_path))
