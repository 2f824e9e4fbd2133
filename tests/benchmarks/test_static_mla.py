"""benchmarks/static_mla.py: MLA's FLOP and latent bytes by hand, the balanced CTA split, FlashInfer's
restated shared memory, and (when flashinfer-python and nvcc are here) its real MLA kernel through the
model: a one-CTA-per-SM kernel whose estimate cannot beat the copy bandwidth or the tensor peak."""

from __future__ import annotations

import pytest
from sass_tools import needs_sass

from benchmarks import static_mla as sm
from kgen.cache import ArtifactCache


def test_flop_and_bytes_by_hand():
    # one sequence, 2 keys: 128 heads x 2 keys x (576 + 512) multiply-adds x 2 FLOP
    assert sm.mla_flop(1, 2) == 2 * 128 * 2 * 1088
    assert sm.latent_bytes(3, 10) == 3 * 10 * 576 * 2


def test_balanced_split_spreads_every_tile():
    ctas = sm.balanced(batch=2, context=130, kv_tile=64, row_tiles=2, ctas=4, per_seq=1)
    # 2 sequences x 2 row tiles x (ceil(130 / 64) = 3 tiles + 1 of overhead) = 16 tiles over 4 CTAs
    assert ctas == [4.0] * 4


def test_flashinfer_smem_restated_from_its_struct():
    # Q 64 x 576, two stages of 64 x 576, the P/kpe union 64 x 64: bf16
    assert sm.fi_mla_smem() == 64 * 576 * 2 + 2 * 64 * 576 * 2 + 64 * 64 * 2


@needs_sass
def test_flashinfer_mla_kernel_through_the_model():
    nvcc = sm.find_nvcc()
    if nvcc is None or sm.flashinfer_data() is None:
        pytest.skip("nvcc or flashinfer-python (headers) is not here")
    k = sm.flashinfer_mla(nvcc, sm.find_cuobjdump(), ArtifactCache())
    assert k.work.mma_flop > 0 and k.work.mma.get("HMMA.16816", 0) > 0  # its main loop is on tensor cores
    assert k.occ.blocks == 1  # ~229 KB of shared memory: one CTA per SM
    for b, c in ((1, 1024), (128, 32768)):
        e = k.estimate(b, c)
        assert 0 < e.fraction <= 1.0
        assert sm.latent_bytes(b, c) / e.seconds <= sm.DEV.copy_bw * (1 + 1e-9)


@needs_sass
def test_kgen_mla_decode_through_the_model():
    """kgen's DeepSeek-V3 spec, mma.sync body (path 1): its SASS main loop is nested in the tile loop (a
    k16 or column loop), so a tile takes several of its iterations; the estimate stays under both limits."""
    k = sm.kgen_mla(sm.find_cuobjdump(), ArtifactCache(), path=1)
    assert k.work.mma.get("HMMA.16816", 0) > 0
    assert 0 < k.unroll() < 1  # the loop found holds part of a tile's FLOP
    assert k.ctas(2, 4096) and all(t >= 1 for t in k.ctas(2, 4096))
    for b, c in ((1, 1024), (64, 4096)):
        e = k.estimate(b, c)
        assert 0 < e.fraction <= 1.0
        assert sm.latent_bytes(b, c) / e.seconds <= sm.DEV.copy_bw * (1 + 1e-9)


@needs_sass
def test_kgen_hopper_mla_decode_through_the_model():
    """The body sm_90 builds for the spec (the Hopper one): its main loop is the tile loop, one tile an
    iteration, S in wgmma m64n32k16 (36 k16 steps at 576, a warpgroup's 32 keys) and P V in m64n256k16
    (4 steps of 16 keys, a warpgroup's 256 columns); 64 heads a CTA: two row blocks a sequence."""
    k = sm.kgen_mla(sm.find_cuobjdump(), ArtifactCache())
    assert k.work.mma == {"HGMMA.64x32x16": 576 // 16, "HGMMA.64x256x16": 64 // 16}
    assert k.unroll() == pytest.approx(1.0)
    assert (k.rows, k.kv_tile, k.threads) == (64, 64, 256)
    assert len(k.ctas(3, 4096)) % (3 * 2) == 0  # 128 heads / 64 x 3 sequences x the plan's partitions
    for b, c in ((1, 1024), (64, 4096)):
        e = k.estimate(b, c)
        assert 0 < e.fraction <= 1.0
        assert sm.latent_bytes(b, c) / e.seconds <= sm.DEV.copy_bw * (1 + 1e-9)
