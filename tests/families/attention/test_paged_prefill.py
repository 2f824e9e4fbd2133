"""The paged-prefill family on the CPU backend: the verification matrix over cache formats and
attention options, decode equivalence against the decode kernel, tiles outside every row's window
never read, the example specs (verified, no spills, HMMA in the sm_90 cubin of the fp16 spec),
`kgen abi`, and every refused argument (the message names the argument and the sequence)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import full_tier_except, inlined_prefill_kernel, run_kgen

import kgen
from kgen.compile.nvrtc import compile_cubin
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.attention.prefill_cases import check, make_prefill_case, references
from kgen.render import render
from kgen.verify.untrusted.handwritten import kernel_from_source

ROOT = Path(__file__).resolve().parents[3]
SPECS = ROOT / "specs"
EXAMPLES = ["llama3_8b_prefill", "prefill_fp8_e4m3", "prefill_sliding_window", "gpt_oss_20b_prefill"]

BASE = {
    "kgen": 1, "name": "fam_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 6, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _build(config=None, verify=False, **overrides):
    return kgen.build(_spec(**overrides), backend="cpu", config=config, archs=[], verify=verify, seed=1234)


def _check(spec, args, out, name="call"):
    ref, lowp = references(spec, args)
    return check(name, spec, args, out, ref, lowp)[0]


# ---- the matrix over formats and options --------------------------------------------------------
@pytest.mark.parametrize("overrides,config", [
    ({}, None),
    ({"attention.causal": False, "attention.alibi": True}, None),
    ({"attention.sliding_window": 40, "attention.logits_soft_cap": 5.0, "attention.alibi": True}, None),
    ({"dtype.q": "bf16", "kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor"}, {"warps": 2, "kv_tile": 32}),
    ({"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "kv_cache.layout": "vllm",
      "kv_cache.order": None, "kv_cache.block_size": 8}, None),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head", "kv_cache.layout": "fused",
      "kv_cache.order": "HND"}, None),
    ({"dtype.q": "fp32", "kv_cache.dtype": "fp32", "attention.head_dim": 40}, None),  # fp32 FMA path, D % 16 = 8
    ({"attention.num_q_heads": 8, "attention.num_kv_heads": 1, "kv_cache.block_size": 1, "tail_masking": False},
     {"warps": 1, "kv_tile": 16}),
    ({"attention.sliding_window": 30}, {"partition_size": 48, "warps": 2, "kv_tile": 16}),  # split-KV + window
    ({"attention.head_dim": 264, "attention.num_q_heads": 2}, None),  # head_dim sliced over grid z
    ({}, {"m_tiles": 1}),  # 16 rows a warp (the automatic choice here is 2)
    ({"attention.sliding_window": 30, "attention.alibi": True},
     {"partition_size": 48, "warps": 2, "kv_tile": 32, "m_tiles": 2}),  # 2 m tiles: split-KV, window, ALiBi
    ({"dtype.q": "fp32", "kv_cache.dtype": "fp32", "attention.head_dim": 40}, {"m_tiles": 2}),  # FMA path, 2 m tiles
], ids=["fp16", "noncausal-alibi", "window-softcap-alibi", "bf16-e5m2", "int8-vllm-b8", "e4m3-fused-hnd",
        "fp32-d40", "mqa-b1-no-tail-mask", "split-window", "d264-slices", "fp16-m1", "split-window-m2",
        "fp32-d40-m2"])
def test_feature_verifies(overrides, config):
    kernel = _build(config, verify=True, **overrides)
    assert kernel.report.passed, kernel.report.summary()
    names = {c.name for c in kernel.report.cases}
    assert {"chunk_1", "chunk_15", "chunk_16", "chunk_17", "chunk_64", "whole_prompt", "inside_blocks",
            "mixed_batch", "mixed_batch_lse", "decode_equivalence", "padded_pool"} <= names
    if overrides.get("attention.sliding_window"):
        assert {"window_crossing", "window_from_empty"} <= names
    if config and config.get("partition_size"):
        assert {"partition_edges", "split_prefix_3P"} <= names


def test_the_matrix_catches_a_wrong_mask():
    """The non-causal kernel, verified against the causal spec's contract (as a hand-written kernel
    would be), fails the chunks but not decode equivalence (a q_len = 1 row sees every key anyway)."""
    abi = PAGED_PREFILL.abi_config(_spec())  # the single-pass ABI launch a hand-written kernel implements
    wrong = kernel_from_source(_spec(), render(_spec(**{"attention.causal": False}), abi).source,
                               backend="cpu", archs=[])
    report = kgen.verify(wrong, seed=5)
    assert not report.passed
    failed = {c.name for c in report.failed_cases}
    assert "chunk_16" in failed and "decode_equivalence" not in failed


def test_per_row_bounds_catch_one_wrong_row():
    spec = _spec()
    kernel = _build()
    args = make_prefill_case(spec, [70, 40], [30, 40], np.random.default_rng(2))
    out = kernel(**args)
    assert _check(spec, args, out).passed
    out[17, 3] += np.float16(0.01)  # one (token, head) row off by far less than the case's largest error
    result = _check(spec, args, out)
    assert not result.passed and result.first_failure["token"] == 17 and result.first_failure["head"] == 3
    assert result.first_failure["sequence"] == 0


# ---- decode equivalence, q_len = 0, LSE ---------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"attention.sliding_window": 20, "attention.alibi": True}])
def test_q_len_1_gives_the_decode_kernels_numbers(overrides):
    prefill = _build(**overrides)
    decode_spec = kgen.spec_from_dict({**BASE, "name": "fam_prefill_as_decode", "kind": "paged_decode"}
                                      ).with_overrides(**overrides)
    decode = kgen.build(decode_spec, backend="cpu", archs=[], verify=False)
    lens = [1, 15, 16, 17, 33, 200]
    args = make_decode_case(decode_spec, lens, np.random.default_rng(4))
    d_out, d_lse = decode(**args, return_lse=True)
    p_args = dict(args, q_indptr=np.arange(len(lens) + 1, dtype=np.int32), out=np.full_like(args["out"], np.nan))
    p_out, p_lse = prefill(**p_args, return_lse=True)
    ref, lowp = references(prefill.spec, p_args)
    for out, lse in ((d_out, d_lse), (p_out, p_lse)):
        assert all(r.passed for r in check("decode", prefill.spec, p_args, out, ref, lowp, lse))
    diff = np.abs(p_out.astype(np.float64) - d_out.astype(np.float64))
    assert diff.max() <= 2 * np.abs(lowp.out - ref.out).max() + 2 * np.finfo(np.float16).eps * np.abs(ref.out).max()
    np.testing.assert_allclose(p_lse, d_lse, rtol=1e-5, atol=1e-5)


def test_a_small_chunk_over_a_32k_prefix_splits_over_kv():
    """16 new tokens over a 32K-token prefix: split into 2K-key partitions merged by log-sum-exp
    (with the LSE), next to a single-token sequence and one long chunk in the same launch."""
    overrides = {"attention.num_q_heads": 4, "attention.num_kv_heads": 1, "kv_cache.block_size": 64}
    spec = _spec(**overrides)
    kernel = _build({"partition_size": 2048}, **overrides)
    assert kernel.kernel_names == ["fam_prefill", "fam_prefill_merge"]
    args = make_prefill_case(spec, [32768 + 16, 3000, 700], [16, 1, 700], np.random.default_rng(11))
    out, lse = kernel(**args, return_lse=True)
    ref, lowp = references(spec, args)
    assert all(r.passed for r in check("call", spec, args, out, ref, lowp, lse))


def test_sequences_without_query_rows():
    spec = _spec()
    kernel = _build()
    rng = np.random.default_rng(6)
    args = make_prefill_case(spec, [20, 0, 35, 9], [4, 0, 0, 9], rng)
    out, lse = kernel(**args, return_lse=True)
    assert out.shape == (13, 6, 64) and lse.shape == (13, 6)
    assert _check(spec, args, out).passed
    empty = make_prefill_case(spec, [0, 12], [0, 0], rng)  # no query row at all: nothing is launched
    assert kernel(**empty).shape == (0, 6, 64)


# The block's key tiles (attention/visibility.cuh, which both prefill bodies start from): a tile the
# causal diagonal crosses, or one the window's edge crosses, taken for a full tile (no mask) must fail.
# The window's (~17 s) runs by default; the diagonal's (~35 s) in the full tier.
@pytest.mark.parametrize("old,new,overrides", full_tier_except([
    ("a = WINDOW > 0 ? min(ntiles, (max(0, pos_last - WINDOW + 1 - lo) + KT - 1) / KT) : 0;",
     "a = WINDOW > 0 ? min(ntiles, max(0, pos_last - WINDOW + 1 - lo) / KT) : 0;", {"attention.sliding_window": 40}),
    ("b = full_end > lo ? min(ntiles, (full_end - lo) / KT) : 0;",
     "b = full_end > lo ? min(ntiles, (full_end - lo + KT - 1) / KT) : 0;", {}),
], {0}), ids=["window_edge_tile_unmasked", "diagonal_tile_unmasked"])
def test_a_crossed_tile_taken_for_full_fails_verification(old, new, overrides):
    mutant = inlined_prefill_kernel(_spec(**overrides), {"partition_size": 0, "path": 1}, [(old, new)],
                                    parts=("kgen/attention/visibility.cuh",))  # path 1: the mma.sync body
    assert not kgen.verify(mutant, seed=5).passed


def test_tiles_before_every_rows_window_are_never_read():
    """Blocks wholly before the window of the chunk's first row point at a NaN block: a kernel that
    loaded them (even masked, 0 * NaN) would produce NaN; their table entries may even be invalid."""
    W = 32
    spec = _spec(**{"attention.sliding_window": W})
    kernel = _build(**{"attention.sliding_window": W})
    args = make_prefill_case(spec, [300], [40], np.random.default_rng(7))
    ref = _check(spec, args, kernel(**args))  # the reference reads the real table
    assert ref.passed
    first_seen = 300 - 40 - W + 1
    for entry in (int(args["block_tables"][0, -1]), 10**6):  # the spare column's poisoned block; no block at all
        tampered = dict(args, block_tables=args["block_tables"].copy(), out=np.full_like(args["out"], np.nan))
        tampered["block_tables"][0, : first_seen // 16] = entry
        np.testing.assert_array_equal(kernel(**tampered), kernel(**args))


# ---- example specs, tensor cores, ABI --------------------------------------------------------------
# llama3_8b_prefill by default (its formats and options verify by default in test_feature_verifies); the
# other examples (~30 s each) in the full tier.
@pytest.mark.parametrize("name", [n if n == "llama3_8b_prefill" else pytest.param(n, marks=pytest.mark.full)
                                  for n in EXAMPLES])
def test_example_spec_builds_verifies_and_does_not_spill(name):
    spec = kgen.load_spec(SPECS / f"{name}.yaml")
    assert spec.kind == "paged_prefill"
    kernel = kgen.build(spec, backend="cpu", archs=sorted(set(spec.targets) | {"sm_90"}), seed=4242)
    assert kernel.report.passed, kernel.report.summary()
    for res in kernel.resources["sm_90"].values():
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["registers"] > 0, res


def _sass_tools() -> tuple[str, str] | None:
    """(cuobjdump, nvdisasm directory) from the NVIDIA wheels or PATH; None when either is missing."""
    found = []
    for dist, exe in (("nvidia-cuda-cuobjdump", "cuobjdump"), ("nvidia-cuda-nvdisasm", "nvdisasm")):
        try:
            files = importlib.metadata.distribution(dist).files or []
            paths = [str(f.locate()) for f in files if f.name == exe]
        except importlib.metadata.PackageNotFoundError:
            paths = []
        path = paths[0] if paths else shutil.which(exe) or (
            os.path.join(os.environ["NVDISASM_PATH"], exe) if exe == "nvdisasm" and os.environ.get("NVDISASM_PATH")
            else None)
        if not path or not os.path.exists(path):
            return None
        found.append(path)
    return found[0], os.path.dirname(found[1])


def _sass(spec, arch: str = "sm_90") -> str:
    tools = _sass_tools()
    if tools is None:
        pytest.skip("cuobjdump -sass needs the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels")
    cubin = compile_cubin(render(spec, None, arch).source, arch).cubin  # the body `arch` gets
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kgen-prefill-{os.getpid()}-{spec.name}.cubin"
    path.write_bytes(cubin)
    try:
        run = subprocess.run([tools[0], "-sass", str(path)], capture_output=True, text=True,
                             env={**os.environ, "NVDISASM_PATH": tools[1], "PATH": tools[1] + os.pathsep +
                                  os.environ.get("PATH", "")})
    finally:
        path.unlink()
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_fp16_spec_runs_on_tensor_cores():
    """The mma.sync body (sm_80's; sm_90 gets the Hopper body, test_prefill_wgmma.py)."""
    sass = _sass(kgen.load_spec(SPECS / "llama3_8b_prefill.yaml"), "sm_80")
    assert len(re.findall(r"\bHMMA\.16816\.F32\b", sass)) >= 32, "no mma.sync m16n8k16 with fp32 accumulation"
    assert re.search(r"\bLDSM\.16\.M88\.4\b", sass), "no ldmatrix.x4"
    assert re.search(r"\bLDSM\.16\.MT88\.4\b", sass), "no ldmatrix.x4.trans (V)"


def test_fp32_q_stays_off_the_tensor_cores():
    """fp32 q keeps fp32 accuracy: its products are FMAs, not fp16/bf16 MMAs."""
    sass = _sass(_spec(**{"dtype.q": "fp32"}))
    assert "HMMA" not in sass and "FFMA" in sass


def test_a_spec_targeting_turing_and_hopper_builds_for_both_and_verifies():
    """Each target gets its own body (kgen/bodies.py): sm_75's products are fp32 FMAs through a P tile,
    sm_90's the Hopper wgmma body; the CPU backend verifies both."""
    kernel = kgen.build(_spec(targets=["sm_75", "sm_90"]), backend="cpu", archs=["sm_75", "sm_90"], verify=True,
                        seed=1234)
    assert kernel.report is not None and kernel.report.passed, kernel.report
    bodies = {arch: r.body for arch, r in kernel.artifacts["bodies"].items()}
    assert bodies == {"sm_75": "fma", "sm_90": "wgmma"}
    names = {c.name.split("]")[0] + "]" for c in kernel.report.cases}
    assert names == {"[sm_75 fma]", "[sm_90 wgmma]"}
    assert "HGMMA" in _sass(_spec(targets=["sm_75", "sm_90"]))
    assert "HMMA" not in _sass(_spec(targets=["sm_75", "sm_90"]), "sm_75")


def test_kgen_abi_prints_the_prefill_contract():
    run = run_kgen("abi", str(SPECS / "llama3_8b_prefill.yaml"))
    assert run.returncode == 0, run.stderr
    text = run.stdout
    for needle in ("abi: 1", "q_indptr", "[num_seqs + 1]", "[num_q_tokens, 32, 128]", "p = seq_lens[s] - q_len + j",
                   "q_tiles = ceil(num_q_tokens * 4 / 64) + num_seqs"):
        assert needle in text, needle
    spec = kgen.load_spec(SPECS / "llama3_8b_prefill.yaml")
    declaration = text[text.index('extern "C"'):].split(";")[0]
    # the generated single-pass kernel (the ABI launch: the mma.sync geometry) has exactly the printed signature
    assert declaration in render(spec, {"partition_size": 0}, "sm_80").source
    # and which body kgen's own kernel gives each target
    assert "sm_80: mma.sync (not the Hopper body: no wgmma before sm_90)" in text
    assert "sm_90: wgmma (Hopper body: head_dim 128, fp16 q" in text


# ---- refused arguments --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel():
    return _build()


@pytest.fixture
def good(kernel):
    return make_prefill_case(kernel.spec, [20, 30, 9], [4, 30, 2], np.random.default_rng(3))


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a["q_indptr"].__setitem__(0, 1), r"q_indptr\[0\] = 1: must be 0"),
    (lambda a: a.__setitem__("q_indptr", np.asarray([0, 10, 4, 36], np.int32)),
     r"q_indptr\[2\] = 4 < q_indptr\[1\] = 10: q_indptr must be non-decreasing \(sequence 1"),
    (lambda a: a["q_indptr"].__setitem__(3, 35), r"q_indptr\[3\] = 35: must equal the number of query rows, "
                                                 r"q.shape\[0\] = 36"),
    (lambda a: a.__setitem__("q_indptr", np.asarray([0, 4, 13, 36], np.int32)),
     r"sequence 2: q_len = q_indptr\[3\] - q_indptr\[2\] = 23 is larger than seq_lens\[2\] = 9"),
    (lambda a: a.__setitem__("q_indptr", np.asarray([0, 4, 34], np.int32)), r"q_indptr: expected shape \[4\]"),
    (lambda a: a.__setitem__("q_indptr", a["q_indptr"].astype(np.float32)), r"q_indptr: expected dtype int32"),
    (lambda a: a.pop("q_indptr"), r"missing argument 'q_indptr'"),
    (lambda a: a["seq_lens"].__setitem__(1, 10**6), r"seq_lens\[1\] = 1000000: must be in 0\.\."),
    (lambda a: a["block_tables"].__setitem__((1, 1), -1), r"block_tables\[1, 1\] = -1: not a block of the pool"),
    (lambda a: a.__setitem__("out", a["out"][:, :, :32]), r"out: expected shape \[36, 6, 64\]"),
])
def test_bad_arguments_are_refused_with_a_message(kernel, good, mutate, message):
    mutate(good)
    with pytest.raises(kgen.ArgumentError, match=message):
        kernel(**good)


def test_causal_on_a_decode_spec_and_a_window_without_causal_are_spec_errors():
    with pytest.raises(kgen.SpecError, match="attention.causal"):
        kgen.spec_from_dict({**BASE, "kind": "paged_decode", "attention": {**BASE["attention"], "causal": True}})
    with pytest.raises(kgen.SpecError, match="a sliding window needs causal attention"):
        kgen.spec_from_dict({**BASE, "attention": {**BASE["attention"], "causal": False, "sliding_window": 8}})


def test_bad_configs_are_refused():
    with pytest.raises(kgen.KgenUserError, match="warps must be 0 .automatic. or one of 1, 2, 4, 8"):
        _build({"warps": 3})
    with pytest.raises(kgen.KgenUserError, match="partition_size must be 0 or a positive multiple of 16"):
        _build({"partition_size": 40})
