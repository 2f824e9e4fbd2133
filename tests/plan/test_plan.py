"""kern.plan and kern(..., plan=plan) (kgen/plan/plan.py, kgen/kernel.py) on the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, reference_check, tiny_decode

import kgen
from kgen.errors import ArgumentError, KgenUserError
from kgen.families.attention.decode_cases import make_decode_case
from kgen.plan import DEFAULT_SMS


@pytest.fixture(scope="module")
def kern():
    return kgen.build(tiny_decode(), backend="cpu", verify=False, config={"partition_size": 64})


def call_args(spec, lens, seed=0):
    args = make_decode_case(spec, lens, np.random.default_rng(seed))
    args.pop("out")
    return args


def test_plan_lists_every_launch_with_its_geometry(kern):
    plan = kern.plan(np.array([2000, 5, 300], dtype=np.int64))
    assert plan.num_sms == DEFAULT_SMS and plan.num_seqs == 3
    P, parts = plan.sizes["partition_tokens"], plan.sizes["max_partitions"]
    assert P % 16 == 0 and P >= 64 and parts == -(-2000 // P) > 1
    main, merge = plan.launches
    assert (main.kernel, main.grid, main.block) == ("tiny_decode", (2, 3, parts), (128, 1, 1))
    assert main.smem_bytes == kern._family.kernels(kern.spec, kern.config)[0].smem
    assert (merge.kernel, merge.grid) == ("tiny_decode_merge", (4, 3, 1))


def test_a_batch_that_fills_the_gpu_has_one_launch(kern):
    plan = kern.plan([100] * 200)
    assert plan.sizes["max_partitions"] == 1 and [ln.kernel for ln in plan.launches] == ["tiny_decode"]


def test_num_sms_changes_the_split(kern):
    small, big = kern.plan([4096], num_sms=4), kern.plan([4096], num_sms=132)
    assert small.sizes["max_partitions"] < big.sizes["max_partitions"]


@pytest.mark.parametrize("lens", [[700, 33, 1500], [1, 64, 65], [129]])
def test_planned_call_gives_the_reference(kern, lens):
    args = call_args(kern.spec, lens)
    plan = kern.plan(lens, partition_tokens=64)  # partitions at the granule: many boundaries
    out = kern(**args, plan=plan)
    result = reference_check(kern.spec, args, out)
    assert result.passed, result.note
    # the plan's scratch is made once and reused by later calls
    scratch = dict(plan.workspace)
    out2 = kern(**args, plan=plan)
    assert np.array_equal(np.asarray(out2), np.asarray(out)) and plan.workspace == scratch


def test_plan_for_the_largest_batch_serves_smaller_and_longer_calls(kern):
    """A plan made once (e.g. before CUDA-graph capture) stays correct for fewer sequences and
    for lengths past the ones it was made for (the last partition takes the rest)."""
    plan = kern.plan([256] * 4, partition_tokens=64)
    for lens in ([256, 10, 200], [1000, 3], [256] * 4):
        args = call_args(kern.spec, lens, seed=len(lens))
        result = reference_check(kern.spec, args, kern(**args, plan=plan))
        assert result.passed, (lens, result.note)


def test_bad_plans_are_refused(kern):
    args = call_args(kern.spec, [100, 100, 100])
    with pytest.raises(ArgumentError, match="made for at most 2 sequences, the call has 3"):
        kern(**args, plan=kern.plan([100, 100]))
    other = kgen.build(tiny_decode("other_decode"), backend="cpu", verify=False)
    with pytest.raises(ArgumentError, match="made for kernel 'other_decode', not 'tiny_decode'"):
        kern(**args, plan=other.plan([100, 100, 100]))
    with pytest.raises(ArgumentError, match="expected a kgen Plan"):
        kern(**args, plan={"partition_tokens": 64})
    with pytest.raises(ArgumentError, match="multiple of 16 of at least the config's partition_size 64"):
        kern.plan([100], partition_tokens=48)
    with pytest.raises(ArgumentError, match="1-d array of lengths >= 0"):
        kern.plan([[1, 2]])
    with pytest.raises(ArgumentError, match="num_sms: must be >= 1"):
        kern.plan([1], num_sms=0)


def test_single_pass_config_plans_one_launch():
    kern = kgen.build(tiny_decode("single_pass"), backend="cpu", verify=False, config={"partition_size": 0})
    plan = kern.plan([32768])
    assert plan.sizes["max_partitions"] == 1 and len(plan.launches) == 1
    with pytest.raises(ArgumentError, match="never splits"):
        kern.plan([100], partition_tokens=64)


def test_kinds_without_lengths_have_no_plan():
    kern = kgen.build(kgen.load_spec(ROOT / "specs" / "copy_blocks_fp16.yaml"), backend="cpu", verify=False)
    with pytest.raises(KgenUserError, match="no call-time plan"):
        kern.plan([1, 2])


@pytest.mark.gpu
def test_a_planned_call_captures_in_a_cuda_graph():
    """kern(..., plan=plan) does no host work that a capture would break (no planning, no value
    reads, the plan's scratch made at the warm-up call), and the replay gives the warm-up's output."""
    torch = pytest.importorskip("torch")
    kern = kgen.build(tiny_decode("graph_decode"), backend="cuda", verify=False, config={"partition_size": 64})
    lens = [900, 70, 2000]
    args = {n: torch.from_numpy(v).cuda() for n, v in call_args(kern.spec, lens).items()}
    plan = kern.plan(lens, partition_tokens=64)
    out = torch.empty_like(args["q"])
    kern(**args, out=out, plan=plan)  # warm-up: makes the plan's scratch
    want = out.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(**args, out=out, plan=plan)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert reference_check(kern.spec, {n: v.cpu().numpy() for n, v in args.items()}, want.cpu().numpy()).passed
