"""kern.audit(rate): sampled shadow checks in service (kgen/audit.py), on the CPU backend: the
float64 reference and the verifier's bound."""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest
from conftest import ROOT, tiny_decode, write_spec

import kgen
from kgen.errors import AuditWarning
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.prefill_cases import make_prefill_case
from kgen.render import render
from kgen.verify.untrusted.handwritten import kernel_from_source

DECODE = textwrap.dedent("""\
    kgen: 1
    name: tiny_audit
    kind: paged_decode
    attention: {num_q_heads: 4, num_kv_heads: 2, head_dim: 32}
    kv_cache: {block_size: 8, layout: separate, order: NHD, dtype: fp16}
    dtype: {q: fp16}
    tail_masking: true
    targets: [sm_90]
""")


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return kgen.load_spec(write_spec(tmp_path_factory.mktemp("audit"), DECODE))


@pytest.fixture(scope="module")
def good(spec):
    return kgen.build(spec, backend="cpu", verify=False)


@pytest.fixture(scope="module")
def wrong(spec):
    """kgen's source with the tail mask dropped, built through the hand-written path WITHOUT
    verification: the kind of kernel an audit exists to catch."""
    source = render(spec, {"partition_size": 0}).source.replace("TAIL_MASK = true", "TAIL_MASK = false")
    kern = kernel_from_source(spec, source, backend="cpu", archs=[])
    yield kern
    kern.module.close()


def batch(spec, seed: int, lens=(3, 9, 17)):
    """One call's arguments; the slots past each length hold NaN (the ABI's garbage), so a kernel
    that reads them writes NaN."""
    args = make_decode_case(spec, list(lens), np.random.default_rng(seed))
    args.pop("out")
    return args


def test_rate_1_checks_every_call_and_returns_the_kernels_own_output(spec, good):
    audited = good.audit(rate=1.0, seed=3)
    for i in range(3):
        args = batch(spec, i)
        got = audited(**args)
        np.testing.assert_array_equal(got, good(**args))  # the audited kernel's own output
    s = audited.stats
    assert (s.calls, s.checked, s.mismatches) == (3, 3, 0)
    assert 0 < s.worst_error <= s.worst_bound and 0 < s.worst_ratio <= 1
    assert list(s.checked_calls) == [1, 2, 3]


def test_rate_0_checks_nothing(spec, good):
    audited = good.audit(rate=0)
    for i in range(4):
        audited(**batch(spec, i))
    assert (audited.stats.calls, audited.stats.checked, audited.stats.mismatches) == (4, 0, 0)


def test_audited_kernel_is_the_same_callable(spec, good):
    audited = good.audit(0.5, seed=1)
    assert audited.spec is good.spec and audited.backend == "cpu" and audited.config == good.config
    args = batch(spec, 0)
    plan = audited.plan(args["seq_lens"])
    out, lse = audited(**args, plan=plan, return_lse=True)
    assert out.shape == args["q"].shape and lse.shape == args["q"].shape[:2]


def test_wrong_kernel_caught_at_rate_1_raise(spec, wrong):
    audited = wrong.audit(rate=1.0, seed=0)
    with pytest.raises(kgen.AuditError) as info:
        audited(**batch(spec, 1))
    assert "tiny_audit call 1" in str(info.value) and info.value.result is not None
    assert not info.value.result.passed
    assert (audited.stats.checked, audited.stats.mismatches) == (1, 1)


def test_wrong_kernel_caught_at_rate_1_warn_and_output_returned(spec, wrong):
    audited = wrong.audit(rate=1.0, on_mismatch="warn", seed=0)
    args = batch(spec, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = audited(**args)
    assert [w.category for w in caught] == [AuditWarning]
    assert "disagrees with the trusted recomputation" in str(caught[0].message)
    assert not np.isfinite(out.astype(np.float32)).all()  # the caller gets the audited (wrong) output
    assert (audited.stats.calls, audited.stats.checked, audited.stats.mismatches) == (1, 1, 1)
    assert audited.stats.worst_ratio == float("inf")


def test_same_seed_checks_the_same_calls(spec, good):
    runs = []
    for _ in range(2):
        audited = good.audit(rate=0.3, seed=1234)
        for i in range(20):
            audited(**batch(spec, i % 3, lens=(2,)))
        runs.append(list(audited.stats.checked_calls))
    assert runs[0] == runs[1] and 0 < len(runs[0]) < 20
    other = good.audit(rate=0.3, seed=99)
    for i in range(20):
        other(**batch(spec, i % 3, lens=(2,)))
    assert list(other.stats.checked_calls) != runs[0]


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), "0.1", True, None])
def test_rate_outside_0_1_is_refused(good, rate):
    with pytest.raises(ValueError, match=r"audit rate must be a number in \[0, 1\]"):
        good.audit(rate)


def test_on_mismatch_must_be_raise_or_warn(good):
    with pytest.raises(ValueError, match="on_mismatch must be one of raise, warn"):
        good.audit(0.1, on_mismatch="ignore")


def test_prefill_audit(tmp_path):
    spec = kgen.load_spec(write_spec(tmp_path, DECODE.replace("tiny_audit", "tiny_audit_prefill")
                                     .replace("paged_decode", "paged_prefill")))
    kern = kgen.build(spec, backend="cpu", verify=False)
    audited = kern.audit(1.0, seed=0)
    args = make_prefill_case(spec, [9, 20], [3, 20], np.random.default_rng(0))
    args.pop("out", None)
    audited(**args, return_lse=True)
    assert (audited.stats.checked, audited.stats.mismatches) == (1, 0)


def test_cache_kinds_are_refused_with_a_reason(tmp_path):
    spec = kgen.load_spec(ROOT / "specs" / "cache_write_fp8_e4m3.yaml")
    kern = kgen.build(spec, backend="cpu", verify=False)
    with pytest.raises(kgen.UnsupportedError, match="cannot be audited yet"):
        kern.audit(0.5)


def test_cuda_audit_never_waits_and_keeps_what_its_side_stream_reads(strict_cuda):
    """The CUDA path (DeviceShadow) against the strict driver model: an audited call adds no host
    sync (the copy of the figures to pinned memory is asynchronous), nothing the side stream reads
    is freed before its event, and the comparisons judge a correct kernel's calls as passed."""
    from kgen.arrays import args_to_backend
    from kgen.audit import DeviceShadow
    from kgen.build import build
    from kgen.verify.runner import verify as run_verify

    spec = tiny_decode()
    kern = build(spec, backend="cuda", verify=False)
    trusted = build(spec, backend="cuda", verify=False)
    trusted.report = run_verify(trusted, cases=["len_B+1", "mixed_batch"])  # a real verification, two cases
    shadow = DeviceShadow(kern, trusted=trusted)
    for number, lens in enumerate(([5, 40], [17], [33, 2, 64]), start=1):
        arguments = args_to_backend(make_decode_case(spec, lens, np.random.default_rng(number)), "cuda")
        before = len(strict_cuda.syncs)  # the inputs' copies to the device are the test's
        shadow.submit(number, None, arguments, kern(**arguments))
        assert strict_cuda.syncs[before:] == [], f"call {number} waited: {strict_cuda.syncs[before:]}"
    assert len(shadow.pending) == 3
    verdicts = list(shadow.completed(wait=True))
    assert [n for n, _ in verdicts] == [1, 2, 3] and all(r.passed for _, r in verdicts), verdicts
