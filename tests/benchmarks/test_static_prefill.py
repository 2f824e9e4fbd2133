"""The prefill model (kgen/perf/prefill_model.py, benchmarks/static_prefill.py): its terms on small
hand-written SASS listings (tensor-, MUFU- and issue-bound), the FLOP count and CTA tiles of tiny
shapes computed by hand, FlashInfer's re-stated tile rules, and one real kgen prefill cubin."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from sass_tools import CUOBJDUMP, listing, needs_sass

from benchmarks import flashinfer_geometry as fi
from benchmarks import static_prefill as sp
from kgen.perf import model as pm
from kgen.perf import prefill_model as pf

ROOT = Path(__file__).resolve().parents[2]

DEV = dataclasses.replace(pm.H200, clock_hz=1.83e9)
PIPES = pf.PIPES["sm_90"]
LOOP_END = ("@P0 BRA 0x0", 7, 0)


def _loop(body: list[str]) -> pm.SassFunction:
    """A function whose whole body is one loop (the branch back to 0x0), then EXIT."""
    return pm.parse_sass(listing("k", [(b, 7, 0) for b in body] + [LOOP_END, ("EXIT", 7, 0)]))["k"]


def _bound(fn: pm.SassFunction, warps: int = 4, k: int = 1) -> tuple[str, dict]:
    w = pf.tile_work(fn, DEV)
    terms = pf.cta_terms(w, 100, warps, k, DEV, PIPES)
    return max(terms, key=terms.get), terms


def test_tensor_bound_tile():
    """8 HMMA.16816 and one LDSM.x4 per iteration: 8 x 4096 FLOP per warp; 4 warps x 8 HMMA need 32 clocks
    of an SM's tensor pipe per iteration, against 4 x 10 / 4 = 10 issue clocks and 4 x 4 = 16 smem clocks."""
    fn = _loop(["HMMA.16816.F32 R0, R4, R8, R0"] * 8 + ["LDSM.16.M88.4 R4, [R2]"])
    w = pf.tile_work(fn, DEV)
    assert w.mma == {"HMMA.16816": 8} and w.mma_flop == 8 * 4096
    assert (w.instrs, w.ldsm, w.wavefronts, w.fixed_instrs) == (10, 4, 4, 1)
    bound, t = _bound(fn)
    clk = DEV.clock_hz
    assert bound == "tensor"
    assert t["tensor"] == pytest.approx(100 * 4 * 8 * 4096 / (4096 * clk))
    assert t["issue"] == pytest.approx((100 * 4 * 10 + 4 * 1) / (4 * clk))
    assert t["smem"] == pytest.approx(100 * 4 * 4 / clk)


def test_mufu_bound_tile():
    """8 MUFU.EX2 per warp-iteration: 4 warps x 8 x 32 lanes / 16 per clock = 64 clocks; one HMMA: 4 clocks."""
    fn = _loop(["MUFU.EX2 R1, R1"] * 8 + ["HMMA.16816.F32 R0, R4, R8, R0", "FFMA R1, R2, R3, R1", "MUFU.RCP R5, R5"])
    w = pf.tile_work(fn, DEV)
    assert (w.mufu, w.mufu_other, w.fp32) == (8, 1, 1)
    bound, t = _bound(fn)
    assert bound == "mufu"
    assert t["mufu"] == pytest.approx(100 * 4 * 9 * 32 / (16 * DEV.clock_hz))


def test_issue_bound_tile_and_sharing():
    """1 HMMA + 40 integer instructions: issue binds (41 + branch per warp, 4 per SM per clock). Two CTAs
    sharing the SM take twice as long each; a 2-warp CTA alone issues at 2 per clock, not 4."""
    fn = _loop(["HMMA.16816.F32 R0, R4, R8, R0"] + ["IADD3 R1, R1, 0x1, RZ"] * 40)
    bound, t1 = _bound(fn)
    assert bound == "issue"
    w = pf.tile_work(fn, DEV)
    t2 = pf.cta_terms(w, 100, 4, 2, DEV, PIPES)
    assert t2["issue"] == pytest.approx(2 * t1["issue"]) and t2["tensor"] == pytest.approx(2 * t1["tensor"])
    t_small = pf.cta_terms(w, 100, 2, 1, DEV, PIPES)
    assert t_small["issue"] == pytest.approx(t1["issue"])  # half the warps at half the issue rate


def test_hgmma_flop_and_main_loop_choice():
    """HGMMA.64x128x16: 2 x 64 x 128 x 16 per warpgroup, a quarter per warp; the main loop is the one holding
    the MMAs, not the one with more instructions."""
    rows = [("IADD3 R1, R1, 0x1, RZ", 7, 0)] * 6 + [("@P0 BRA 0x0", 7, 0)]
    rows += [("HGMMA.64x128x16.F32 gdesc[UR4], R0, UR8", 7, 0), ("@P1 BRA 0x70", 7, 0), ("EXIT", 7, 0)]
    fn = pm.parse_sass(listing("k", rows))["k"]
    lp = pf.main_loop(fn)
    assert (lp.start, lp.end) == (7, 8)
    w = pf.tile_work(fn, DEV)
    assert w.mma == {"HGMMA.64x128x16": 1} and w.mma_flop == 2 * 64 * 128 * 16 // 4


def test_causal_flop_by_hand():
    """Prompt of 4: rows see 1, 2, 3, 4 keys = 10 pairs; a chunk of 2 at the end of 5 keys: 4 + 5 = 9."""
    assert pf.visible_pairs(4, 4) == 10 and pf.visible_pairs(2, 5) == 9
    assert pf.visible_pairs(3, 3, causal=False) == 9 and pf.visible_pairs(4, 4, window=2) == 1 + 2 + 2 + 2
    assert pf.causal_flop([(4, 4), (2, 5)], 128, 2) == 4 * 128 * 2 * (10 + 9)


def test_kgen_ctas_by_hand():
    """32-token prompt, GQA 4, 64 packed rows a block (4 warps: 16 tokens), 16-key tiles: the last tile first
    (tokens 16..31: keys 0..31, 2 tiles), then tokens 0..15 (1 tile), then the spare block; per KV head."""
    assert pf.kgen_ctas([(32, 32)], 4, 2, 64, 16) == [2, 1, 0] * 2
    # split in 16-key partitions: partition 1 holds keys 16.. (the last: to the end); the first tile sees none
    assert pf.kgen_ctas([(32, 32)], 4, 1, 64, 16, partitions=2, partition_tokens=16) == [1, 1, 0, 1, 0, 0]


def test_flashinfer_rules():
    """fp16 d128, 128-row tiles: 4 Q warps x 2 MMA rows, NUM_MMA_KV 4 (8 / NUM_MMA_Q caps the smem bound 10):
    64-key tiles, 32 KB Q + 4 x 8 KB K/V; one 2048-token prompt of GQA 4 fills 64 q tiles x 8 heads, no split."""
    t = fi.flashinfer_traits(128, 128, 2)
    assert (t["NUM_MMA_Q"], t["NUM_WARPS_Q"], t["NUM_WARPS_KV"], t["NUM_MMA_KV"], t["CTA_TILE_KV"]) == (2, 4, 1, 4, 64)
    assert t["smem"] == 128 * 128 * 2 + 4 * 8192 and t["threads"] == 128
    assert fi.flashinfer_cta_tile_q(65, 128) == 128 and fi.flashinfer_cta_tile_q(64, 128) == 64
    ctas, chunks = fi.flashinfer_ctas([(2048, 2048)], 4, 8, 16, t, 132)
    assert len(ctas) == 64 * 8 and chunks == 0
    assert ctas[:2] == [-(-(0 + 128 // 4) // 64), -(-(256 // 4) // 64)]  # q tile 0 sees 32 keys, tile 1: 64
    # a short prompt is split: 512 tokens x 4 = 16 q tiles <= 264 / 8 = 33: chunks of 16 pages (256 tokens)
    ctas, chunks = fi.flashinfer_ctas([(512, 512)], 4, 8, 16, t, 132)
    assert chunks == 2 and len(ctas) == 16 * 2 * 8


def test_list_scheduling_and_bandwidth_floor():
    """132 SMs x 1 slot: 264 equal CTAs take two CTA times; the DRAM floor binds when the bytes are large."""
    fn = _loop(["HMMA.16816.F32 R0, R4, R8, R0"] * 8)
    w = pf.tile_work(fn, DEV)
    one = max(pf.cta_terms(w, 10, 4, 1, DEV, PIPES).values()) + 2 * PIPES.tile_latency_s
    e = pf.launch_estimate([10] * 264, w, 4, 1, 1e9, 0.0, DEV, PIPES, 989.4e12)
    assert e.seconds == pytest.approx(2 * one) and e.bound == "tensor" and e.resident == 132
    e = pf.launch_estimate([10] * 264, w, 4, 1, 1e9, 1e12, DEV, PIPES, 989.4e12)
    assert e.bound == "bandwidth" and e.seconds == pytest.approx(1e12 / DEV.copy_bw)


@needs_sass
def test_real_kgen_prefill_cubin_through_the_model():
    """llama3_8b_prefill (fp16, 4 warps of 2 m tiles, 32-key tiles) on sm_90: 128 HMMA.16816 per warp per
    iteration = 32 rows x 32 keys x 128 x 4 FLOP; a 64-token causal prompt: FLOP by hand, numbers finite, a bound named."""
    from kgen.cache import ArtifactCache
    from kgen.spec.models import load_spec

    spec = load_spec(ROOT / "specs" / "llama3_8b_prefill.yaml")
    k = sp.kgen_kernel(spec, CUOBJDUMP, ArtifactCache(), "kgen")
    assert k.work.mma.get("HMMA.16816") == 128 and k.work.mma_flop == 4 * 32 * 32 * 128 == k.expected_flop()
    assert k.work.mufu > 0 and k.work.fp32 > 0 and k.work.ldsm > 0
    e = k.estimate([(64, 64)], 32, 8)
    assert e.flop == 4 * 128 * 32 * (64 * 65 // 2)
    assert pf.finite(e) and e.seconds > 0 and e.bound in (*pf.PREFILL_TERMS, "bandwidth")
    big = k.estimate([(4096, 4096)], 32, 8)
    assert pf.finite(big) and 0 < big.fraction < 1 and math.isfinite(big.tflops)


def test_main_loop_skips_regions_overlapping_a_shorter_mma_loop():
    """A persistent kernel's backward branches need not nest: a long region overlapping the short
    steady-state MMA loop is not the main loop, even with more MMAs in it."""
    rows = [("HMMA.16816.F32 R0, R4, R8, R0", 7, 0)] * 3                      # 0..2: peeled iteration
    rows += [("HMMA.16816.F32 R0, R4, R8, R0", 7, 0)] * 2 + [("@P0 BRA 0x30", 7, 0)]  # 3..5: steady loop
    rows += [("IADD3 R1, R1, 0x1, RZ", 7, 0), ("@P1 BRA 0x10", 7, 0), ("EXIT", 7, 0)]  # 1..7: overlaps it
    fn = pm.parse_sass(listing("k", rows))["k"]
    lp = pf.main_loop(fn)
    assert (lp.start, lp.end) == (3, 5) and pf.tile_work(fn, DEV).mma == {"HMMA.16816": 2}


def test_flashinfer_sm90_items_by_hand():
    """Two requests, the longer first; 128-token tiles from the last, one per query head (no GQA packing):
    a 200-token prompt's tiles see 200 and 128 keys = 3 and 2 iterations of 96; a 100-token chunk at the
    end of 300 keys: 300 keys = 4 iterations."""
    assert fi.flashinfer_sm90_items([(200, 200), (100, 300)], 2) == [4, 3, 2] * 2


def test_producer_instrs_charges_the_gather_loop_per_tile():
    """A warp-specialized kernel: the consumers' HGMMA loop (0x0..), then the producer's tile loop around an
    inner cp.async loop of 3 instructions with one LDGSTS: 8 copies a thread = 8 inner passes + the 2
    instructions around it, for each of the producer's 4 warps; the issue term grows by that per tile."""
    rows = [("HGMMA.64x64x16.F32 R0, gdesc[UR4], R0", 7, 0), ("@P0 BRA 0x0", 7, 0)]          # 0..1 main loop
    rows += [("IADD3 R1, R1, 0x1, RZ", 7, 0)]                                                  # 2 producer tile loop
    rows += [("LDGSTS.E.BYPASS.128 [R2], desc[UR6][R4.64]", 7, 0), ("IADD3 R2, R2, 0x10, RZ", 7, 0),
             ("@P1 BRA 0x30", 7, 0)]                                                           # 3..5 inner loop
    rows += [("@P2 BRA 0x20", 7, 0), ("EXIT", 7, 0)]                                           # 6: back to 2
    fn = pm.parse_sass(listing("k", rows))["k"]
    lp = pf.main_loop(fn)
    assert (lp.start, lp.end) == (0, 1)
    assert pf.producer_instrs(fn, lp, 8) == 4 * (3 * 8 + 2)
    w = pf.tile_work(fn, DEV)
    before = pf.cta_terms(w, 10, 4, 1, DEV, PIPES)["issue"]
    w.producer_instrs = pf.producer_instrs(fn, lp, 8)
    after = pf.cta_terms(w, 10, 4, 1, DEV, PIPES)["issue"]
    assert after == pytest.approx(before + 10 * 104 / (DEV.issue_per_sm_clock * DEV.clock_hz))


@needs_sass
def test_the_hopper_kernel_through_the_model():
    """llama3_8b_prefill targeting sm_90 alone (the wgmma path, its automatic tiles: 2 consumer warpgroups x
    128 keys): 8 HGMMA.64x128x16 (S) + 8 (P V) per warp per tile = 16 rows x 128 keys x 128 x 4 FLOP; the
    producer's gather loop charged; 384 threads, one CTA per SM."""
    from kgen.cache import ArtifactCache
    from kgen.spec.models import load_spec

    spec = load_spec(ROOT / "specs" / "llama3_8b_prefill.yaml").with_overrides(targets=["sm_90"])
    k = sp.kgen_kernel(spec, CUOBJDUMP, ArtifactCache(), "kgen hopper", sp.HOPPER_CONFIG)
    assert k.work.mma == {"HGMMA.64x128x16": 16} and k.work.mma_flop == k.expected_flop()
    assert k.threads == 384 and k.warps == 8 and k.rows == 128 and k.work.producer_instrs > 0
    big = k.estimate([(4096, 4096)], 32, 8)
    assert pf.finite(big) and 0 < big.fraction < 1


def test_serialised_wgmma_overlaps_nothing():
    """ptxas's C7520 (serialised wgmma) on a kernel's advisories: the tensor term is charged on top of the
    slowest other term instead of hiding under it (an HGMMA tile with a MUFU-heavy softmax: overlapped,
    the larger of the two; serialised, their sum)."""
    fn = _loop(["HGMMA.64x128x16.F32 R0, gdesc[UR4], R0"] * 4 + ["MUFU.EX2 R1, R1"] * 24)
    w = pf.tile_work(fn, DEV)
    terms = pf.cta_terms(w, 100, 4, 1, DEV, PIPES)
    overlapped, bound = pf.cta_seconds(terms)
    assert overlapped == max(terms.values()) and bound == max(terms, key=terms.get)
    rest = max(v for k, v in terms.items() if k != "tensor")
    assert pf.cta_seconds(terms, serialized=True)[0] == pytest.approx(terms["tensor"] + rest)
    assert not pf.serialized_wgmma([]) and not pf.serialized_wgmma([{"code": "C7519"}, {"code": "spill"}])
    assert pf.serialized_wgmma([{"code": "C7520", "message": "...", "kernel": "k"}])
    w.wgmma_serialized = True
    slow = pf.launch_estimate([100] * 132, w, 4, 1, 1e12, 0.0, DEV, PIPES, 989.4e12)
    w.wgmma_serialized = False
    fast = pf.launch_estimate([100] * 132, w, 4, 1, 1e12, 0.0, DEV, PIPES, 989.4e12)
    assert slow.seconds == pytest.approx(fast.seconds + min(terms["tensor"], rest))
