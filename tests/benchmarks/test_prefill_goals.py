"""Issue 22's goals in benchmarks/static_prefill.py: the pure judgements on constructed estimates
(each able to fail), the comparison rules on stand-in kernels, and one real kgen kernel through them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from sass_tools import CUOBJDUMP, needs_sass

from benchmarks import static_prefill as sp
from kgen.perf import prefill_model as pf

ROOT = Path(__file__).resolve().parents[2]


def _est(seconds: float, fraction: float = 0.5) -> pf.PrefillEstimate:
    return pf.PrefillEstimate(seconds, 1e12, 1e12 / seconds, fraction, "tensor", 1, 132)


def test_peak_goal_takes_the_best_kgen_kernel():
    g = sp.peak_goal({"kgen a": _est(1, 0.50), "kgen b": _est(1, 0.61)}, "GQA 4, fp16")
    assert (g.kernel, g.met, g.verdict) == ("kgen b", True, "met") and g.figure.startswith("61%")
    g = sp.peak_goal({"kgen a": _est(1, 0.59), "kgen b": None}, "GQA 4, fp16")
    assert (g.kernel, g.verdict) == ("kgen a", "MISSED")
    assert sp.peak_goal({"kgen a": None}, "GQA 4, fp16").verdict == "n/a"


def test_versus_goal_needs_every_shape():
    assert sp.speed_ratio(_est(1.0), _est(2.0)) == 2.0 and sp.speed_ratio(None, _est(1)) is None
    g = sp.versus_goal("g", "kgen", "w", "fi", {"a": 1.2, "b": 0.9, "c": 1.0})
    assert g.verdict == "MISSED" and "worst 0.90x at b; 1 of 3" in g.figure
    assert sp.versus_goal("g", "kgen", "w", "fi", {"a": 1.2, "b": 0.996}).verdict == "met"  # prints as 1.00x
    assert sp.versus_goal("g", "kgen", "w", "fi", {"a": 0.99, "b": 1.5}).verdict == "MISSED"
    part = sp.versus_goal("g", "kgen", "w", "fi", {"a": 1.2, "b": None})
    assert part.verdict == "n/a" and "(1 n/a)" in part.figure
    assert sp.versus_goal("g", "kgen", "w", "fi", {"a": 0.5, "b": None}).verdict == "MISSED"
    assert sp.versus_goal("g", "kgen", "w", "fi", {"a": None}).verdict == "n/a"


def test_mixed_goal_against_the_sum_of_its_parts():
    assert sp.mixed_goal("k", "w", _est(1.09), [_est(0.5), _est(0.5)]).verdict == "met"
    g = sp.mixed_goal("k", "w", _est(1.2), [_est(0.5), _est(0.5)])
    assert g.verdict == "MISSED" and g.figure.endswith("= 1.20x")
    assert sp.mixed_goal("k", "w", _est(0.7), [_est(0.5), _est(0.5)]).verdict == "met"  # faster mixed
    assert sp.mixed_goal("k", "w", _est(1.0), [_est(0.5), None]).verdict == "n/a"
    assert sp.mixed_shape() == (sp.SHAPES[-1][0], sp.MIXED)
    chunks, decodes = sp.mixed_parts(sp.MIXED)
    assert chunks == [(256, 4096)] * 8 and decodes == [(1, 4096)] * 56
    assert sorted(chunks + decodes) == sorted(sp.MIXED)


class _Stand:
    """A kernel row with a fixed time per query token: its estimate needs no SASS."""

    def __init__(self, label: str, mma: str, per_token: float):
        self.label, self.work, self.per_token = label, SimpleNamespace(mma={mma: 1}), per_token

    def estimate(self, seqs, num_q_heads, num_kv_heads, pipes=None):
        return _est(self.per_token * sum(q for q, _ in seqs), fraction=0.3 if self.per_token > 1 else 0.7)


def test_goals_compare_each_kgen_kernel_with_flashinfer_on_its_path():
    """A kgen wgmma row (twice as fast as FlashInfer's wgmma kernel) is judged against that one, the
    mma.sync row against FlashInfer's mma.sync kernel; the best-per-shape row and one mixed row per kgen
    kernel appear; the peak goal takes the faster kgen kernel."""
    kernels = [_Stand("kgen mma", "HMMA.16816", 4.0), _Stand("kgen hopper", "HGMMA.64x128x16", 1.0),
               _Stand("FlashInfer sm80", "HMMA.16816", 2.0), _Stand("FlashInfer sm90", "HGMMA.64x96x16", 2.0)]
    spec = SimpleNamespace(attention=SimpleNamespace(num_q_heads=32, num_kv_heads=8))
    rows, ratio_rows = sp.goals({("GQA 4 (x)", "fp16"): (spec, kernels)})
    by = {(g.goal.split()[0], g.kernel, g.against): g for g in rows}
    assert by[("prompt", "kgen hopper", "-")].verdict == "met"  # 0.7 of the peak, the better of the two
    assert by[("every", "kgen mma", "FlashInfer sm80")].verdict == "MISSED"
    assert by[("every", "kgen hopper", "FlashInfer sm90")].verdict == "met"
    assert ("every", "kgen hopper", "FlashInfer sm80") not in by
    best = [g for g in rows if g.kernel == "best kgen sm_90 kernel per shape"]
    assert len(best) == 1 and best[0].verdict == "met"
    assert {g.kernel for g in rows if g.goal.startswith("mixed")} == {"kgen mma", "kgen hopper"}
    assert [r[3] for r in ratio_rows] == ["0.50x (MISSED)", "2.00x", "2.00x"]  # prompt 512 column


def test_a_kgen_kernel_without_flashinfer_on_its_path_is_not_judged():
    spec = SimpleNamespace(attention=SimpleNamespace(num_q_heads=32, num_kv_heads=8))
    rows, _ = sp.goals({("GQA 4 (x)", "fp8_e4m3"): (spec, [_Stand("kgen hopper", "HGMMA.64x128x16", 1.0),
                                                          _Stand("FlashInfer sm80", "HMMA.16816", 2.0)])})
    (versus,) = [g for g in rows if g.goal.startswith("every")]
    assert versus.verdict == "n/a" and "no FlashInfer wgmma kernel" in versus.against
    assert not [g for g in rows if g.goal.startswith("prompt")]  # the peak goal is for fp16 KV


@needs_sass
def test_real_kgen_kernel_goals():
    """llama3_8b_prefill through the model: the mixed goal's parts are the kernel's own estimates of the
    chunks and of the decode rows, planned apart; every goal row is judged from finite figures."""
    from kgen.cache import ArtifactCache
    from kgen.spec.models import load_spec

    spec = load_spec(ROOT / "specs" / "llama3_8b_prefill.yaml")
    k = sp.kgen_kernel(spec, CUOBJDUMP, ArtifactCache(), "kgen llama3_8b_prefill")
    mix = [(64, 256)] * 2 + [(1, 256)] * 4
    mixed = k.estimate(mix, 32, 8)
    parts = [k.estimate(p, 32, 8) for p in sp.mixed_parts(mix)]
    g = sp.mixed_goal(k.label, "GQA 4, fp16", mixed, parts)
    ratio = mixed.seconds / (parts[0].seconds + parts[1].seconds)
    assert g.figure.endswith(f"= {ratio:.2f}x") and g.met == (ratio <= 1.10) and pf.finite(mixed)
    rows, _ = sp.goals({("GQA 4 (x)", "fp16"): (spec, [k])})
    assert [g.goal.split()[0] for g in rows] == ["prompt", "every", "mixed"]
    peak = rows[0]
    assert peak.met == (k.estimate([(4096, 4096)], 32, 8).fraction >= 0.60)
    assert rows[1].verdict == "n/a"  # no FlashInfer row in this group
    assert rows[2].met is not None
