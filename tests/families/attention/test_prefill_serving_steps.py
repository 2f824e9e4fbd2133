"""Prefill's serving_steps (kgen/families/attention/prefill_cases.py run_case): 24 .. 40 consecutive
launches in one process, a prompt prefilled chunk by chunk beside decode rows, each launch judged. A
kernel that goes wrong only from some launch on (as one that counts its launches would) fails at that
step, and the note names it (kgen's own kernels pass every step: their whole matrices are verified by
tests/families/attention/test_paged_prefill.py)."""

from __future__ import annotations

import numpy as np

import kgen
from kgen.families.registry import family_for
from kgen.verify.runner import verify

TINY_PREFILL = {
    "kgen": 1, "name": "steps_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
SEED = 4242


class WrongFromLaunch:
    """kgen's verified kernel, made wrong from launch `first` on (a test double of the kernel under
    verification: the verifier cannot tell it from a hand-written kernel that counts launches)."""

    def __init__(self, kernel, first: int):
        self.kernel, self.first, self.calls = kernel, first, 0

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, **call):
        result = self.kernel(**call)
        self.calls += 1
        if self.calls >= self.first:
            call["out"][...] = call["out"] * np.float16(1.5)  # on the CPU backend: the caller's numpy array
        return result


def test_prefill_serving_steps_judge_every_launch():
    spec = kgen.spec_from_dict(TINY_PREFILL)
    kernel = kgen.build(spec, backend="cpu", archs=[], verify=False)
    steps = {c.name: c for c in family_for(spec).cases(spec, kernel.config, np.random.default_rng(SEED))}
    steps = steps["serving_steps"].params["steps"]
    assert 24 <= steps <= 40
    # launches 1 .. 20 right (each judged and passed: the run stops at its first failing step), then wrong
    bad = verify(WrongFromLaunch(kernel, 21), seed=SEED, cases=["serving_steps"])
    assert not bad.passed
    assert bad.cases[0].note.startswith(f"step 21 of {steps}"), bad.cases[0].note
