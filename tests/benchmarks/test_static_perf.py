"""The static performance model (kgen/perf/model.py, benchmarks/static_perf.py) on a real kgen
cubin and on small SASS listings, and benchmarks/gpu_decode.py's refusal without a GPU and its CPU
dry run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kgen.compile.nvrtc import compile_cubin
from kgen.perf import model as pm
from kgen.render import render
from kgen.runtime.cuda import gpu_available
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_decode  # noqa: E402
import static_perf as sp  # noqa: E402

LLAMA = ROOT / "specs" / "llama3_8b_decode.yaml"
GPU_SCRIPT = ROOT / "benchmarks" / "gpu_decode.py"


def _sass_tools() -> str | None:
    """cuobjdump, when it can disassemble here (it needs nvdisasm beside it or on PATH)."""
    tool = sp.find_cuobjdump()
    if tool is None:
        return None
    probe = subprocess.run([tool, "-sass", str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                           env=sp.cuobjdump_env(tool))
    return None if "nvdisasm" in probe.stderr else tool


CUOBJDUMP = _sass_tools()
needs_sass = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump with nvdisasm is not installed "
                                "(the test extra's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)")


def _listing(name: str, rows: list[tuple[str, int, int]]) -> str:
    """A cuobjdump-style listing: (instruction, scoreboard set, wait mask) per row, 16 bytes apart."""
    lines = ["\tcode for sm_90", f"\t\tFunction : {name}"]
    for i, (text, wbar, wait) in enumerate(rows):
        hi = ((wait << 11) | (wbar << 5)) << 41
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;    /* 0x0000000000000000 */")
        lines.append(f"                                                      /* 0x{hi:016x} */")
    return "\n".join(lines) + "\n"


def test_serial_loop_keeps_one_load_in_flight():
    """K, wait, V, wait: two DRAM trips per iteration for 32 bytes = 16 bytes in flight."""
    fn = pm.parse_sass(_listing("k", [
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
    fn = pm.parse_sass(_listing("k", [
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
    assert pm.flashinfer_split([2048], 8, 16, 9) == (True, 14, 147)
    assert pm.flashinfer_split([256] * 256, 8, 16, 9) == (False, 256, 256)  # 2048 blocks fill the GPU already


def test_estimate_counts_grid_fill_and_caps_at_copy_bandwidth():
    small = pm.estimate_seconds(64 * 4096 * 4096, 8, 128, 16.0, 6)
    full = pm.estimate_seconds(64 * 4096 * 4096, 1024, 128, 16.0, 6)
    deep = pm.estimate_seconds(64 * 4096 * 4096, 1024, 128, 1024.0, 6)
    assert small.fraction < full.fraction < deep.fraction <= 1.0
    assert (full.resident, full.waves) == (792, 2)


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
    text = sp.report([subject], [])
    assert "llama3_8b_decode" in text and "ESTIMATE" in text


def test_doc_markers_keep_the_hand_written_text(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Perf\n\nprose before\n\n{sp.DOC_BEGIN}\nold table\n{sp.DOC_END}\n\nprose after\n")
    sp.write_doc(doc, "new table\n")
    assert doc.read_text() == f"# Perf\n\nprose before\n\n{sp.DOC_BEGIN}\nnew table\n{sp.DOC_END}\n\nprose after\n"


def _gpu_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU_SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
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


def test_gpu_script_cpu_dry_run_agrees_with_sdpa():
    """The whole pipeline on the CPU (kgen's CPU backend, torch SDPA on the gathered K/V)."""
    pytest.importorskip("torch")
    run = _gpu_script("--cpu-dry-run", "--no-verify", "--shapes", "2x40")
    assert run.returncode == 0, run.stderr[-2000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| llama3_8b_decode"))
    diff = float(row.strip("| \n").split("|")[-1])
    assert diff < 1e-2  # fp16 output against SDPA on the same K/V
