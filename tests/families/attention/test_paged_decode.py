"""The paged-decode family on the CPU backend: the attention features each verified,
split-KV with the LSE return, the tail_masking contract, and every refused argument
(the message names the argument and what would be accepted)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import assert_lse_matches, inline_provided, reference_check

import kgen
from kgen.compile.nvrtc import compile_cubin
from kgen.families.attention.decode import PAGED_DECODE
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.decode_geometry import decode_geometry
from kgen.families.base import resolve_config
from kgen.formats.dtypes import dtype
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

ROOT = Path(__file__).resolve().parents[3]
BASE = {
    "kgen": 1, "name": "fam_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 6, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _build(config=None, verify=False, **overrides):
    return kgen.build(_spec(**overrides), backend="cpu", config=config, archs=[], verify=verify, seed=77)


@pytest.mark.parametrize("overrides,config", [
    ({"attention.sliding_window": 40}, None),
    ({"attention.sliding_window": 40}, {"partition_size": 32}),  # the window starts mid-partition
    ({"attention.logits_soft_cap": 3.0, "attention.softmax_scale": 0.3}, None),
    ({"attention.alibi": True}, None),
    ({"attention.alibi": True, "attention.logits_soft_cap": 8.0, "attention.sliding_window": 100,
      "kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "kv_cache.layout": "vllm", "kv_cache.order": None},
     {"partition_size": 64}),
    ({"tail_masking": False}, None),
    ({"tail_masking": False, "attention.sliding_window": 20}, {"partition_size": 48}),
], ids=["window", "window-split", "softcap", "alibi", "all-int8-vllm-split", "no-tail-mask", "no-tail-mask-window-split"])
def test_feature_verifies(overrides, config):
    kernel = _build(config, verify=True, **overrides)
    assert kernel.report.passed, kernel.report.summary()
    names = {c.name for c in kernel.report.cases}
    if config:
        assert {"len_P-1", "len_P", "len_P+1", "len_2P+1"} <= {n.removesuffix("(rounded)") for n in names}


@pytest.mark.parametrize("partition_size", [0, 32])
def test_return_lse_matches_the_reference(partition_size):
    kernel = _build({"partition_size": partition_size})
    spec = kernel.spec
    args = make_decode_case(spec, [1, 31, 32, 33, 97], np.random.default_rng(8))
    plain = kernel(**args)
    assert isinstance(plain, np.ndarray)
    out, lse = kernel(**args, return_lse=True)
    assert lse.shape == (5, 6) and lse.dtype == np.float32
    assert_lse_matches(spec, args, lse)
    check = reference_check(spec, args, out)
    assert check.passed, (check.max_error, check.bound)


def test_tail_masking_false_refuses_a_partial_last_block():
    kernel = _build(tail_masking=False)
    args = make_decode_case(kernel.spec, [32, 16], np.random.default_rng(1))
    kernel(**args)
    args["seq_lens"] = np.asarray([32, 17], dtype=np.int32)
    with pytest.raises(kgen.ArgumentError, match=r"seq_lens\[1\] = 17 is not a multiple of block_size 16.*tail_masking: false"):
        kernel(**args)


def test_fp8_needs_sm89_in_the_spec():
    text = """
kgen: 1
name: fp8_old
kind: paged_decode
attention: {num_q_heads: 8, num_kv_heads: 2, head_dim: 64}
kv_cache: {block_size: 16, layout: separate, dtype: fp8_e4m3, scale: per_head}
dtype: {q: fp16}
tail_masking: true
targets: [sm_80, sm_90]
"""
    with pytest.raises(kgen.SpecError, match=r"specs/x.yaml:6: kv_cache.dtype: fp8_e4m3 needs every target to be sm_89"):
        kgen.parse_spec(text, "specs/x.yaml")


# ---------------------------------------------------------------- refused arguments

@pytest.fixture(scope="module")
def fp16_kernel():
    return _build()


@pytest.fixture(scope="module")
def int8_kernel():
    return _build(**{"kv_cache.dtype": "int8", "kv_cache.scale": "per_head", "attention.alibi": True})


def _args(kernel, lens=(20, 5)):
    return make_decode_case(kernel.spec, list(lens), np.random.default_rng(3))


def _refused(kernel, args, pattern):
    with pytest.raises(kgen.ArgumentError, match=pattern):
        kernel(**args)


def test_scales_missing_for_a_quantized_cache(int8_kernel):
    args = _args(int8_kernel)
    del args["v_scale"]
    _refused(int8_kernel, args, r"v_scale: required for a int8 cache with scale 'per_head' \(fp32, shape \[2\]\)")


def test_scales_given_for_a_float_cache(fp16_kernel):
    args = _args(fp16_kernel)
    args["k_scale"] = np.ones(2, np.float32)
    _refused(fp16_kernel, args, r"k_scale: a fp16 cache takes no scales")


@pytest.mark.parametrize("bad", [np.ones(3, np.float32), np.ones((2, 1), np.float32), np.ones(2, np.float64)])
def test_scale_of_wrong_shape_or_dtype(int8_kernel, bad):
    args = _args(int8_kernel)
    args["k_scale"] = bad
    _refused(int8_kernel, args, r"k_scale: expected (shape \[2\]|dtype fp32)")


@pytest.mark.parametrize("name,change,pattern", [
    ("q", lambda a: a.astype(np.float32), r"q: expected dtype fp16, got fp32"),
    ("q", lambda a: a[:, :4], r"q: expected shape \[2, 6, 64\]"),
    ("q", lambda a: a[None], r"q: expected shape \[num_seqs, 6, 64\]"),
    ("q", lambda a: a[..., ::-1], r"q: the last dimension must be contiguous"),
    ("k_cache", lambda a: a.astype(np.float32), r"k_cache: expected dtype fp16"),
    ("v_cache", lambda a: a[:, :, :1], r"v_cache: expected shape"),
    ("block_tables", lambda a: a.astype(np.float32), r"block_tables: expected dtype int32, got fp32"),
    ("block_tables", lambda a: np.asfortranarray(np.concatenate([a, a], 1)[:, ::2]), r"block_tables: must be C-contiguous"),
    ("seq_lens", lambda a: a[:1], r"seq_lens: expected shape \[2\]"),
    ("out", lambda a: a.astype(np.float32), r"out: expected dtype fp16"),
    ("q", lambda a: a.tolist(), r"q: expected a numpy array, a torch tensor or a CuPy array, got list"),
])
def test_wrong_argument_is_named(fp16_kernel, name, change, pattern):
    args = _args(fp16_kernel)
    args[name] = change(args[name])
    _refused(fp16_kernel, args, pattern)


def test_missing_unknown_and_foreign_arguments(fp16_kernel, int8_kernel):
    args = _args(fp16_kernel)
    del args["block_tables"]
    _refused(fp16_kernel, args, r"missing argument 'block_tables'")
    args = _args(fp16_kernel)
    _refused(fp16_kernel, args | {"kv_cache": args["k_cache"]}, r"kv_cache: not an argument of layout 'separate'")
    _refused(fp16_kernel, args | {"window": 3}, r"unknown argument\(s\): window")
    _refused(fp16_kernel, args | {"alibi_slopes": np.ones(6, np.float32)}, r"alibi_slopes: given, but the spec has alibi: false")
    args = _args(int8_kernel)
    del args["alibi_slopes"]
    _refused(int8_kernel, args, r"alibi_slopes: required \(spec has alibi: true\), fp32 shape \[6\]")


def test_pool_strides_must_keep_vector_alignment(fp16_kernel):
    args = _args(fp16_kernel)
    k = args["k_cache"]
    big = np.zeros(k.shape[:-1] + (k.shape[-1] + 4,), k.dtype)  # rows 68 elements apart: not 8-aligned
    big[..., :64] = k
    args["k_cache"] = big[..., :64]
    _refused(fp16_kernel, args, r"k_cache: strides \[.*\] must be multiples of 8 elements \(16 bytes\)")
    args = _args(fp16_kernel)
    flat = np.zeros(args["v_cache"].size + 1, np.float16)
    shifted = flat[1:].reshape(args["v_cache"].shape)  # 2 bytes past an aligned address
    shifted[...] = args["v_cache"]
    args["v_cache"] = shifted
    _refused(fp16_kernel, args, r"v_cache: data pointer must be 16-byte aligned")


def test_padded_pool_with_aligned_strides_is_accepted(fp16_kernel):
    args = make_decode_case(fp16_kernel.spec, [20, 5], np.random.default_rng(4), padded=True)
    assert not args["k_cache"].flags.c_contiguous
    check = reference_check(fp16_kernel.spec, args, fp16_kernel(**args))
    assert check.passed, (check.max_error, check.bound)


def test_block_table_entry_outside_the_pool(fp16_kernel):
    args = _args(fp16_kernel)
    n = args["k_cache"].shape[0]
    args["block_tables"][0, 1] = n
    _refused(fp16_kernel, args, rf"block_tables\[0, 1\] = {n}: not a block of the pool \(0..{n - 1}\)")
    args["block_tables"][0, 1] = -1
    _refused(fp16_kernel, args, r"block_tables\[0, 1\] = -1")


@pytest.mark.parametrize("length", [-1, 1000])
def test_seq_len_outside_the_table_capacity(fp16_kernel, length):
    """0 is a padded row (test_a_padded_row_reads_nothing_and_writes_zeros); below it or past the
    table's capacity is refused."""
    args = _args(fp16_kernel)
    cap = args["block_tables"].shape[1] * 16
    args["seq_lens"][1] = length
    _refused(fp16_kernel, args, rf"seq_lens\[1\] = {length}: must be in 0..{cap}")


@pytest.mark.parametrize("bad,pattern", [
    (np.ones(5, np.float32), r"alibi_slopes: expected shape \[6\], got \[5\]"),
    (np.ones(6, np.float16), r"alibi_slopes: expected dtype fp32, got fp16"),
    (np.ones(12, np.float32)[::2], r"alibi_slopes: must be C-contiguous"),
])
def test_alibi_slopes_of_wrong_shape_dtype_or_layout(int8_kernel, bad, pattern):
    _refused(int8_kernel, _args(int8_kernel) | {"alibi_slopes": bad}, pattern)


def test_per_token_scale_of_wrong_shape():
    kernel = _build(**{"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"})
    args = _args(kernel)
    args["v_scale"] = args["v_scale"].transpose(0, 2, 1)  # HND order given to an NHD cache
    _refused(kernel, args, r"v_scale: expected shape \[\d+, 16, 2\]")


# ---------------------------------------------------------------- the pipelined main loop
# (templates/common/paged_decode.cuh): tunables, geometry, and the cp.async contract

@pytest.mark.parametrize("overrides,config", [
    ({}, {"stages": 1}),
    ({}, {"stages": 3, "threads": 256}),
    ({}, {"stages": 4, "threads": 64}),
    ({}, {"heads_per_thread": 2}),  # 3 query heads: the second head set has one real head
    ({"attention.num_q_heads": 16}, {"threads": 64}),  # GQA 8 on 8 row groups
    ({"kv_cache.layout": "vllm", "kv_cache.order": None, "kv_cache.block_size": 4}, {"stages": 3}),  # 8-byte V copies
    ({"kv_cache.layout": "vllm", "kv_cache.order": None, "kv_cache.block_size": 1, "kv_cache.dtype": "bf16",
      "dtype.q": "bf16"}, None),  # 2-byte V pieces: plain copies
    ({"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_token_head", "attention.head_dim": 72}, {"stages": 3}),
    ({"kv_cache.dtype": "fp32", "dtype.q": "fp32", "attention.head_dim": 512, "kv_cache.order": "HND"}, None),
], ids=["stages1", "stages3-256", "stages4-64", "heads2", "gqa8-64", "vllm-b4", "vllm-b1-bf16", "fp8-hd72",
        "fp32-hd512"])
def test_pipeline_configs_verify(overrides, config):
    kernel = _build(config, verify=True, **overrides)
    assert kernel.report.passed, kernel.report.summary()


@pytest.mark.parametrize("config", [{"stages": 3}, {"partition_size": 32, "heads_per_thread": 3}])
def test_pipeline_verifies_in_race_mode(config):
    spec = _spec(**{"kv_cache.layout": "vllm", "kv_cache.order": None})
    kernel = kgen.build(spec, backend="cpu", config=config, archs=[], race_check=True, seed=5)
    assert kernel.report.passed, kernel.report.summary()


WAIT = "cp_async_wait<(STAGES >= 2 ? STAGES - 2 : 0)>();"


# By default at 2 stages; at 3 in the full tier.
@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.full)])
@pytest.mark.parametrize("mid,old,new,must_fail", [
    ("waits_one_group_short", WAIT, "cp_async_wait<(STAGES >= 2 ? STAGES - 1 : 0)>();", {"len_1", "long"}),
    ("never_waits", WAIT, "", {"len_1", "long"}),
    # one token: each lane reads only its own copy of it, so only longer contexts can show this one
    ("no_barrier_after_the_wait", "__syncthreads();  // everybody's have", "// (barrier dropped) everybody's have",
     {"long"}),
])
def test_reading_a_tile_before_its_copies_land_fails_verification(stages, mid, old, new, must_fail):
    """The CPU backend lands a cp.async copy only at its wait (issue leaves NaN): a kernel that reads
    a tile before its own wait, or before the barrier after everybody's, fails the case matrix."""
    spec = _spec()
    rendered = render(spec, {"stages": stages})
    source = inline_provided(inline_provided(rendered.source), "kgen/attention/stage_ring.cuh")  # body and ring as kernel code
    assert source.count(old) == 1
    good = kernel_from_source(spec, source, backend="cpu", config=rendered.config, archs=[])
    assert verify(good, seed=3).passed
    mutant = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    report = verify(mutant, seed=3)
    assert not report.passed, mid
    # A hand-written source runs with race detection, which stops the matrix at the first case
    # with a race (reading a buffer before its copies land, or before the barrier, is one);
    # where it sees none, the NaN an unlanded copy leaves fails the cases themselves.
    failed, summary = {c.name for c in report.failed_cases}, report.summary()
    assert must_fail <= failed or (failed and "shared-memory race on __shared__ 'smem'" in summary), summary


def test_bundled_specs_keep_64_bytes_in_flight_per_thread():
    """While a tile is computed, each thread has requested >= 64 bytes of the next (fp16 and narrower)."""
    for path in sorted(ROOT.joinpath("specs").glob("*.yaml")):
        spec = kgen.load_spec(path)
        if spec.kind != "paged_decode" or spec.kv_cache.layout == "mla":  # mla: its own body (test_mla.py)
            continue
        config = resolve_config(PAGED_DECODE, spec, None)
        geo, problems = decode_geometry(spec, config)
        assert not problems
        kv = spec.kv_cache
        assert geo.bytes_in_flight >= 64, (spec.name, geo)
        assert geo.tile_tokens * 2 * dtype(kv.dtype).bytes_for(spec.attention.head_dim) >= 64 * geo.threads


@pytest.mark.parametrize("overrides,config,pattern", [
    ({}, {"stages": 5}, r"stages must be 0 \(auto\) or 1 to 4 \(got 5\)"),
    ({}, {"heads_per_thread": 4}, r"heads_per_thread must be 0 \(auto\) or 1 to the GQA group 3 \(got 4\)"),
    ({"attention.num_q_heads": 12}, {"threads": 32, "heads_per_thread": 1, "mma_min_group": 0},
     r"threads 32 make 4 row groups of 8 lanes, fewer than the 6 that heads_per_thread 1 needs"),
])
def test_bad_pipeline_configs_are_refused(overrides, config, pattern):
    with pytest.raises(kgen.KgenUserError, match=pattern):
        render(_spec(**overrides), config)


def test_shared_memory_limit_is_refused():
    spec = _spec(**{"kv_cache.dtype": "fp32", "dtype.q": "fp32", "attention.head_dim": 512})
    with pytest.raises(kgen.KgenUserError, match=r"stages 4 of \d+ tokens need \d+ bytes of shared memory, more than "
                                                 r"49152"):
        render(spec, {"stages": 4, "threads": 512})


def test_registers_do_not_grow_with_the_gqa_group():
    """One query head per thread: the sm_90 registers of GQA 1, 4 and 16 stay within a few of each other."""
    regs = {}
    for group in (1, 4, 16):
        spec = _spec(**{"attention.num_q_heads": 2 * group, "attention.head_dim": 128})
        rendered = render(spec, {"heads_per_thread": 1, "threads": 256, "mma_min_group": 0})  # the CUDA-core body
        res = compile_cubin(rendered.source, "sm_90").resources[spec.name]
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, res
        regs[group] = res.registers
    assert max(regs.values()) - min(regs.values()) <= 16 and max(regs.values()) <= 80, regs


@pytest.mark.parametrize("threads,stages", [(128, 3), (256, 3), (512, 1)])
def test_auto_stages_take_the_deepest_pipeline_that_fits(threads, stages):
    """stages 0 (the default): 3 where the static shared memory allows, else fewer."""
    spec = kgen.load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")
    geo, problems = decode_geometry(spec, resolve_config(PAGED_DECODE, spec, {"threads": threads, "stages": 0}))
    assert not problems and geo.stages == stages
    if stages < 3:  # one stage more than auto chose does not fit
        deeper, why = decode_geometry(spec, resolve_config(PAGED_DECODE, spec, {"threads": threads,
                                                                               "stages": stages + 1}))
        assert deeper is None and "shared memory" in why[0]


class _PaddedRowsWrong:
    """A kernel that gets the real rows right and writes `value` into the padded ones."""

    def __init__(self, kernel, value: float):
        self.kernel, self.value = kernel, value

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, **arguments):
        out = self.kernel(**arguments)
        out[np.asarray(arguments["seq_lens"]) == 0] = self.value
        return out


def test_a_padded_row_reads_nothing_and_writes_zeros():
    """CUDA graphs pad a decode batch with rows of seq_len 0 (vLLM's full graphs): the checked path
    takes them, the kernel writes zeros there (lse -inf), and the verifier's padded_rows case fails a
    kernel that writes anything else."""
    from conftest import tiny_decode

    from kgen.families.attention.decode_cases import padded_rows_lengths, run_case
    from kgen.families.base import Case
    from kgen.families.registry import family_for

    spec = tiny_decode()
    kern = kgen.build(spec, backend="cpu", verify=False)
    lens = padded_rows_lengths(spec)
    host = make_decode_case(spec, lens, np.random.default_rng(0))
    out, lse = kern(**host, return_lse=True)
    assert np.all(out[1] == 0) and np.all(out[3] == 0) and np.all(np.isneginf(lse[[1, 3]]))
    assert reference_check(spec, host, out).passed
    (case,) = [c for c in family_for(spec).cases(spec, kern.config, np.random.default_rng(1)) if c.name == "padded_rows"]
    assert 0 in case.params["seq_lens"]
    assert all(r.passed for r in run_case(kern, case, np.random.default_rng(2)))
    for wrong in (np.nan, 1e-3):
        results = run_case(_PaddedRowsWrong(kern, wrong), Case(case.name, case.params, case.sizes),
                           np.random.default_rng(2))
        assert not all(r.passed for r in results), wrong
