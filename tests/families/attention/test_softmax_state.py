"""The attention kernels' one online-softmax state (templates/common/softmax.cuh), on the CPU backend.

Decode and prefill main loops, token-group/warp/partition merges and the LSE all go through SoftmaxState:
here its add/merge/lse are checked against float64 softmax, including the empty state
(a row that sees no key: factors 0, never NaN; LSE -inf).
"""

from __future__ import annotations

import numpy as np
import pytest

from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

KERNEL = r"""
#include "kgen/platform.cuh"
#include "kgen/softmax.cuh"

// out: [0..3) all logits added one by one (m, l, lse); [3..6) first half merged with second
// half (m, l, lse); [6..8) that merge's factors; [8..13) empty (+) empty (m, l, lse, factors);
// [13] its inv_sum; [14] empty (+) half: this side's factor; [15..15+D) softmax(logits) @ v
// through add(), [15+D..15+2D) the same through two halves and merge().
extern "C" __global__ void softmax_state(const float* logits, const float* v, int n, int d, float* out) {
  using kgen::SoftmaxFactors;
  using kgen::SoftmaxState;
  float acc[16] = {}, acc_b[16] = {}, acc_c[16] = {};
  SoftmaxState a = SoftmaxState::empty(), b = SoftmaxState::empty(), c = SoftmaxState::empty();
  for (int i = 0; i < n; ++i) {
    const SoftmaxFactors f = a.add(logits[i]);
    for (int j = 0; j < d; ++j) acc[j] = acc[j] * f.self + f.other * v[i * d + j];
    SoftmaxState& half = i < n / 2 ? b : c;
    float* h = i < n / 2 ? acc_b : acc_c;
    const SoftmaxFactors g = half.add(logits[i]);
    for (int j = 0; j < d; ++j) h[j] = h[j] * g.self + g.other * v[i * d + j];
  }
  out[0] = a.m; out[1] = a.l; out[2] = a.lse();
  SoftmaxState bc = b;
  const SoftmaxFactors f = bc.merge(c);
  out[3] = bc.m; out[4] = bc.l; out[5] = bc.lse(); out[6] = f.self; out[7] = f.other;
  SoftmaxState e = SoftmaxState::empty();
  const SoftmaxFactors fe = e.merge(SoftmaxState::empty());
  out[8] = e.m; out[9] = e.l; out[10] = e.lse(); out[11] = fe.self; out[12] = fe.other; out[13] = e.inv_sum();
  SoftmaxState e2 = SoftmaxState::empty();
  out[14] = e2.merge(b).self;
  for (int j = 0; j < d; ++j) {
    out[15 + j] = acc[j] * a.inv_sum();
    out[15 + d + j] = (acc_b[j] * f.self + acc_c[j] * f.other) * bc.inv_sum();
  }
}
"""


@pytest.fixture(scope="module")
def mod() -> CpuModule:
    return CpuModule.from_source(KERNEL, ["softmax_state"])  # kgen's provided headers, as a kernel includes them


def run(mod, logits: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.full(15 + 2 * v.shape[1], np.nan, np.float32)
    mod.launch(Launch("softmax_state", (1, 1, 1), (1, 1, 1), 0,
                      [logits.astype(np.float32), v.astype(np.float32), np.int32(len(logits)), np.int32(v.shape[1]),
                       out]))
    return out.astype(np.float64)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_add_and_merge_match_float64_softmax(mod, scale):
    rng = np.random.default_rng(1)
    n, d = 37, 16
    logits = (rng.standard_normal(n) * scale).astype(np.float32).astype(np.float64)
    v = rng.standard_normal((n, d)).astype(np.float32).astype(np.float64)
    out = run(mod, logits, v)
    m = logits.max()
    lse = m + np.log(np.exp(logits - m).sum())
    p = np.exp(logits - lse)
    for base in (0, 3):  # one by one, and two halves merged
        assert out[base] == np.float32(m)
        np.testing.assert_allclose(out[base + 1], np.exp(logits - m).sum(), rtol=1e-5)
        np.testing.assert_allclose(out[base + 2], lse, rtol=1e-6, atol=1e-6)
    mb = logits[: n // 2].max()
    np.testing.assert_allclose(out[6:8], [np.exp(mb - m), np.exp(logits[n // 2:].max() - m)], rtol=1e-6)
    np.testing.assert_allclose(out[15:15 + d], p @ v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[15 + d:], p @ v, rtol=1e-5, atol=1e-6)


def test_empty_state_merges_without_nan_and_has_lse_minus_inf(mod):
    out = run(mod, np.array([0.5, -1.0]), np.ones((2, 1)))
    assert out[8] == -np.inf and out[9] == 0.0 and out[10] == -np.inf  # a row that sees no key
    assert out[11] == 0.0 and out[12] == 0.0  # no exp(-inf - -inf) = NaN
    assert out[13] == 0.0  # its output is 0, not 0/0
    assert out[14] == 0.0  # an empty state weighs nothing against a non-empty one
