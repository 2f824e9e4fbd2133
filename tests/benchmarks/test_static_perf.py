"""The static performance model (kgen/perf/model.py, benchmarks/static_perf.py) on a real kgen
cubin and on small SASS listings, and benchmarks/gpu_decode.py's refusal without a GPU and its CPU
dry run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sass_tools import CUOBJDUMP, listing, needs_sass

import kgen.bench.decode
from benchmarks import gpu_decode
from benchmarks import static_perf as sp
from benchmarks.flashinfer_geometry import flashinfer_split
from benchmarks.tables import fmt_cell
from kgen.compile.nvrtc import compile_cubin
from kgen.perf import model as pm
from kgen.render import render
from kgen.runtime.cuda import gpu_available
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]

LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"


def test_serial_loop_keeps_one_load_in_flight():
    """K, wait, V, wait: two DRAM trips per iteration for 32 bytes = 16 bytes in flight."""
    fn = pm.parse_sass(listing("k", [
        ("MOV R1, R1", 7, 0),
        ("LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", 0, 0),
        ("FFMA R8, R4, R4, R8", 7, 0b01),
        ("LDG.E.128.CONSTANT R12, desc[UR4][R2.64+0x10]", 1, 0),
        ("FFMA R8, R12, R12, R8", 7, 0b10),
        ("@P0 BRA 0x10", 7, 0),
        ("EXIT", 7, 0),
    ]))["k"]
    (loop, nbytes), = pm.streaming_loops(fn)
    assert (loop.start, loop.end, nbytes) == (1, 5, 32)
    mlp = pm.loop_mlp(fn, loop)
    assert mlp.latencies_per_iter == pytest.approx(2.0) and mlp.in_flight == pytest.approx(16.0)


def test_cp_async_pipeline_keeps_its_stages_in_flight():
    """One 16-byte group per iteration, waiting until 3 remain: 4 groups = 64 bytes in flight."""
    fn = pm.parse_sass(listing("k", [
        ("DEPBAR.LE SB0, 0x3", 7, 0),
        ("LDS R4, [R0]", 2, 0),
        ("FFMA R8, R4, R4, R8", 7, 0b100),
        ("LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64]", 7, 0),
        ("LDGDEPBAR", 7, 0),
        ("@P0 BRA 0x0", 7, 0),
    ]))["k"]
    (loop, _), = pm.streaming_loops(fn)
    assert pm.loop_mlp(fn, loop).in_flight == pytest.approx(64.0)


def test_occupancy_follows_the_sm90_rules():
    assert pm.occupancy(128, 75, 128 + 2048) == pm.Occupancy(6, 24, "registers")  # 80 regs/thread, 6 warps/SMSP
    assert pm.occupancy(128, 56, 9216).blocks == 9
    assert pm.occupancy(128, 32, 288 + 131072) == pm.Occupancy(1, 4, "shared memory")
    assert pm.occupancy(1024, 16, 0) == pm.Occupancy(2, 64, "threads")
    assert pm.occupancy(128, 32, 228 * 1024).blocks == 0  # over the per-block limit: does not launch


def test_flashinfer_split_heuristic():
    # 1 x 32768 tokens in 16-token pages, 8 KV heads, 9 blocks/SM: fill 1188 blocks with 147 chunks of 14 pages
    assert flashinfer_split([2048], 8, 16, 9) == (True, 14, 147)
    assert flashinfer_split([256] * 256, 8, 16, 9) == (False, 256, 256)  # 2048 blocks fill the GPU already


def test_estimate_counts_grid_fill_and_caps_at_copy_bandwidth():
    small = pm.estimate_seconds(64 * 4096 * 4096, 8, 128, 16.0, 6)
    full = pm.estimate_seconds(64 * 4096 * 4096, 1024, 128, 16.0, 6)
    deep = pm.estimate_seconds(64 * 4096 * 4096, 1024, 128, 1024.0, 6)
    assert small.fraction < full.fraction < deep.fraction <= 1.0
    assert (full.resident, full.waves) == (792, 2)


def _pipelined(body: list[str]) -> pm.SassFunction:
    """A cp.async loop (one 16-byte group per iteration, 4 in flight: 64 bytes per thread) with `body`
    between the copy and the backward branch, then a short epilogue."""
    rows = [("DEPBAR.LE SB0, 0x3", 7, 0), ("LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64]", 7, 0),
            ("LDGDEPBAR", 7, 0), *((text, 7, 0) for text in body), ("@P0 BRA 0x0", 7, 0),
            ("STG.E desc[UR4][R6.64], R8", 7, 0), ("EXIT", 7, 0)]
    return pm.parse_sass(listing("k", rows))["k"]


def _estimate(fn: pm.SassFunction, blocks: int = 4096, threads: int = 128, per_sm: int = 8) -> pm.Estimate:
    in_flight, _ = pm.thread_in_flight(fn)
    return pm.estimate_seconds(64 * 4096 * 4096, blocks, threads, in_flight, per_sm, work=pm.kernel_work(fn))


def test_work_counts_of_a_loop():
    """Per iteration: 3 + 4 + 1 warp-instructions; 16 stream bytes per thread (the 4-byte LDG is a table
    read); LDGSTS.128 + LDS.128 + LDS.64 + LDS = 4 + 4 + 2 + 1 wavefronts; two HMMA.16816 = 8192 FLOP."""
    fn = _pipelined(["LDG.E.CONSTANT R9, desc[UR4][R4.64]", "LDS.128 R4, [R0]", "LDS.64 R4, [R0]",
                     "LDS R4, [R0]", "HMMA.16816.F32 R12, R4, R6, R12", "HMMA.16816.F32 R16, R4, R6, R16"])
    w = pm.kernel_work(fn)
    assert (w.loop_instrs, w.loop_bytes, w.fixed_instrs) == (10, 16, 2)
    assert w.instrs_per_byte == pytest.approx(10 / 512) and w.wavefronts_per_byte == pytest.approx(11 / 512)
    assert w.flop_per_byte == pytest.approx(8192 / 512)
    # ldmatrix .x4, .x2.trans, .x1 as nvdisasm prints them on sm_90
    assert [pm.smem_wavefronts(pm.Instr(0, "", op, "R4, [R0]")) for op in
            ("LDSM.16.M88.4", "LDSM.16.MT88.2", "LDSM.16.M88")] == [4, 2, 1]
    assert pm.issue_bound_fraction(w) == pytest.approx(132 * 4 * 1.98e9 / (4.3e12 * 10 / 512))


def test_bandwidth_binds_a_short_deep_loop():
    e = _estimate(_pipelined(["FFMA R8, R4, R4, R8"] * 8))
    assert e.bound == "bandwidth" and e.fraction > 0.95


def test_issue_binds_a_long_loop():
    """300 warp-instructions per 512 bytes: 0.59 per byte against 0.243 at full bandwidth."""
    e = _estimate(_pipelined(["FFMA R8, R4, R4, R8"] * 300))
    assert e.bound == "issue"
    assert e.fraction == pytest.approx(pm.issue_bound_fraction(pm.Work(instrs_per_byte=303 / 512)), rel=0.03)


def test_issue_rate_drops_below_four_warps_per_sm():
    """One 32-thread block per SM: one sub-partition issues, a quarter of the rate of four warps."""
    fn = _pipelined(["FFMA R8, R4, R4, R8"] * 60)
    one = pm.wave_terms(1e9, 132, 32, 64.0, pm.kernel_work(fn))
    four = pm.wave_terms(1e9, 132, 128, 64.0, pm.kernel_work(fn))
    assert one["issue"] == pytest.approx(4 * four["issue"], rel=0.01)


def test_smem_binds_a_loop_of_wide_shared_loads():
    """40 LDS.128 per 512 bytes: 160 wavefronts, 0.31 per byte against 0.061 at full bandwidth."""
    e = _estimate(_pipelined(["LDS.128 R4, [R0]"] * 40))
    assert e.bound == "smem" and e.terms["smem"] > e.terms["issue"]


def test_tensor_binds_a_loop_of_mmas():
    """40 HMMA.16816 per 512 bytes: 320 FLOP per byte against 249 at full bandwidth."""
    e = _estimate(_pipelined(["HMMA.16816.F32 R12, R4, R6, R12"] * 40))
    assert e.bound == "tensor" and e.terms["tensor"] > max(e.terms["issue"], e.terms["smem"])


def test_latency_binds_a_serial_loop():
    fn = pm.parse_sass(listing("k", [
        ("LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", 0, 0),
        ("FFMA R8, R4, R4, R8", 7, 0b01),
        ("@P0 BRA 0x0", 7, 0),
    ]))["k"]
    assert _estimate(fn).bound == "latency"
    assert fmt_cell(_estimate(fn)).endswith("(latency)")


@needs_sass
def test_real_sass_scoreboards_and_the_llama_figures():
    """The control-word decoding on a real kgen cubin: every global load sets a scoreboard and a later
    instruction waits on it; static_perf's figures for the Llama spec hang together."""
    spec = load_spec(LLAMA)
    art = compile_cubin(render(spec).source, "sm_90")
    fn = pm.parse_sass(sp.sass_text(art.cubin, CUOBJDUMP))[spec.name]
    loads = [i for i, ins in enumerate(fn.instrs) if ins.base in ("LDG", "LD")]
    assert loads
    for i in loads:
        wbar = fn.instrs[i].wbar
        assert wbar != pm.NO_BARRIER, fn.instrs[i]
        assert any(later.wait >> wbar & 1 for later in fn.instrs[i + 1:]), fn.instrs[i]

    subject = sp.kgen_subject(LLAMA, CUOBJDUMP, None)
    fig = subject.kernels[spec.name]
    assert fig.registers == art.resources[spec.name].registers
    assert fig.ldl >= 0 and fig.stl >= 0 and fig.in_flight > 0 and fig.loops
    est, occ = subject.estimate(64, 4096)
    assert 0 < est.fraction <= 1 and occ.blocks >= 1
    assert est.blocks >= 64 * spec.attention.num_kv_heads  # at least one block per (sequence, KV head)
    assert est.bound in pm.TERMS and set(est.terms) == set(pm.TERMS)
    # the work counts: a loop of hundreds of warp-instructions streaming K and V by 16-byte cp.async copies
    w = fig.work
    assert w.loop_instrs > 100 and w.loop_bytes % 16 == 0 and w.loop_bytes > 0 and w.fixed_instrs > 0
    assert 0.05 < w.instrs_per_byte < 2 and w.wavefronts_per_byte > 0 and w.flop_per_byte >= 0
    if w.flop_per_byte == 0:  # the CUDA-core loop: no tensor term
        assert est.terms["tensor"] == 0
    # the issue ceiling caps the estimate (up to the round trips and the grid fill it does not see)
    assert est.fraction <= pm.issue_bound_fraction(w) + 1e-9
    text = sp.report([subject], [])
    assert "llama3_8b_decode" in text and "ESTIMATE" in text and f"({est.bound})" in text
    assert "warp-instr per K/V B" in text and "Targets" in text


@needs_sass
def test_fp8_llama_variant_when_the_bundled_fp8_spec_is_missing():
    """Without decode_fp8_e4m3_per_head among the subjects, the fp8 row is llama3_8b_decode rendered with
    an fp8 per-head cache: the same shape, half the bytes per token; the target row compares the two."""
    subjects = [sp.kgen_subject(LLAMA, CUOBJDUMP, None)]
    label = sp.fp8_llama(subjects, ROOT / "specs", CUOBJDUMP, None)
    fp8 = sp.find(subjects, label)
    assert fp8 is not None and fp8.spec.kv_cache.dtype == "fp8_e4m3" and fp8.spec.kv_cache.scale == "per_head"
    assert fp8.kv_bytes(64, 4096) == subjects[0].kv_bytes(64, 4096) / 2
    rows = sp.target_rows(subjects, label)
    (row,) = [r for r in rows if r[0].startswith("fp8 tokens/s")]
    assert row[1] == f"{label} / kgen llama3_8b_decode" and row[3] in ("met", "MISSED")


def test_doc_markers_keep_the_hand_written_text(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Perf\n\nprose before\n\n{sp.DOC_BEGIN}\nold table\n{sp.DOC_END}\n\nprose after\n")
    sp.write_doc(doc, "new table\n")
    assert doc.read_text() == f"# Perf\n\nprose before\n\n{sp.DOC_BEGIN}\nnew table\n{sp.DOC_END}\n\nprose after\n"


def _gpu_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_decode", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.mark.skipif(gpu_available(), reason="a GPU is visible: the script would measure")
def test_gpu_script_refuses_without_a_gpu():
    run = _gpu_script("--shapes", "1x512")
    assert run.returncode == 2
    assert "no CUDA GPU" in run.stderr and "nothing was measured" in run.stderr
    assert "|" not in run.stdout  # no table: nothing invented


def test_gpu_script_arguments():
    assert _gpu_script("--help").returncode == 0
    bad = _gpu_script("--shapes", "64by4096")
    assert bad.returncode == 2 and "bad shape '64by4096'" in bad.stderr
    assert gpu_decode.parse_shapes("1x512, 64x4096") == [(1, 512), (64, 4096)]
    assert gpu_decode.parser().parse_args([]).shapes == pm.SHAPES


def test_gpu_script_times_both_decode_paths_when_the_family_has_them(monkeypatch):
    spec = load_spec(LLAMA)
    paths = gpu_decode.decode_paths(spec)
    if "mma_min_group" not in gpu_decode.family_for(spec).params:
        assert paths == [("default config (no mma_min_group in this kgen)", None)]

    class Family:
        params = {"threads": None, "mma_min_group": None}

    monkeypatch.setattr(kgen.bench.decode, "family_for", lambda s: Family)  # where the probing lives
    assert [c for _, c in gpu_decode.decode_paths(spec)] == [{"mma_min_group": 0}, {"mma_min_group": 1}]
    assert [n.split(" (")[0] for n, _ in gpu_decode.decode_paths(spec)] == ["CUDA cores", "tensor cores"]


def test_static_perf_second_path_rows_are_skipped_with_the_reason(monkeypatch):
    class Family:
        kind, params = "paged_decode", {"threads": None}

    monkeypatch.setattr(sp, "family_for", lambda s: Family)
    skipped: list[str] = []
    assert sp.mma_paths(LLAMA, load_spec(LLAMA), "cuobjdump", None, skipped) == []
    assert len(skipped) == 1 and "no `mma_min_group` parameter" in skipped[0]


def test_gpu_script_cpu_dry_run_agrees_with_sdpa():
    """The whole pipeline on the CPU (kgen's CPU backend, torch SDPA on the gathered K/V)."""
    pytest.importorskip("torch")
    run = _gpu_script("--cpu-dry-run", "--no-verify", "--shapes", "2x40")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| llama3_8b_decode")]
    paths = {row.split("|")[2].strip() for row in rows}
    expected = {n for n, _ in gpu_decode.decode_paths(load_spec(LLAMA))}
    assert paths == expected and len(rows) == len(expected)  # one row per decode path at the one shape
    for row in rows:
        diff = float(row.strip("| \n").split("|")[-1])
        assert diff < 1e-2  # fp16 output against SDPA on the same K/V


def _tile_loop() -> pm.SassFunction:
    """A tile loop as the tensor-core decode body compiles: a copy loop (two 16-byte cp.async, no wait:
    `#pragma unroll 2`) and a compute loop without reads (HMMA, FFMA) nested in the loop that waits."""
    rows = [("DEPBAR.LE SB0, 0x1", 7, 0), ("LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64]", 7, 0),
            ("LDGSTS.E.BYPASS.LTC128B.128 [R1+0x10], desc[UR4][R2.64+0x10]", 7, 0), ("@P1 BRA 0x10", 7, 0),
            ("LDGDEPBAR", 7, 0), ("HMMA.16816.F32 R12, R4, R6, R12", 7, 0), ("FFMA R8, R4, R4, R8", 7, 0),
            ("@P2 BRA 0x50", 7, 0), ("@P0 BRA 0x0", 7, 0), ("EXIT", 7, 0)]
    return pm.parse_sass(listing("k", rows))["k"]


def test_a_copy_loop_that_never_waits_is_counted_with_its_tile_loop():
    """The copy loop reads the stream but waits for nothing: the unit is the tile loop around it. Without
    a hint each nested loop counts once (9 instructions, 32 bytes); with kgen's geometry the copy loop
    runs until it has read 128 bytes (4 trips) and the compute loop 3 times: 3 + 4 x 3 + 3 x 3 = 24
    instructions and 3 HMMA per 128 bytes."""
    fn = _tile_loop()
    assert [lp for lp, _ in pm.streaming_loops(fn)] == [pm.Loop(1, 3)]
    bare = pm.kernel_work(fn)
    assert (bare.loop_instrs, bare.loop_bytes, bare.fixed_instrs) == (9, 32, 1)
    hinted = pm.kernel_work(fn, pm.TileHint(tile_bytes=128, inner_trips=3))
    assert (hinted.loop_instrs, hinted.loop_bytes) == (24, 128)
    assert hinted.flop_per_byte == pytest.approx(3 * 4096 / (32 * 128))
    in_flight, (mlp,) = pm.thread_in_flight(fn, hint=pm.TileHint(tile_bytes=128, inner_trips=3))
    assert mlp.bytes_per_iter == 128 and in_flight > 0
