"""The verifier must catch broken kernels: each mutation below breaks one feature of the
rendered decode source on purpose, and the case that exercises that feature must fail
(while the cases that cannot see the bug still pass, which shows the failure is the
right one). The unmutated source passes the same matrix with the same seed."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import full_tier_except, inline_provided

import kgen
from kgen.families.attention.decode_cases import decode_case_matrix
from kgen.kernel import Kernel
from kgen.render import render
from kgen.verify.judge.bounds import check_output
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {
    "kgen": 1, "name": "mut_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
SEED = 20251


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _kernel(spec, config=None, old: str | None = None, new: str = "") -> Kernel:
    """kgen's source, with softmax.cuh (the online softmax, split-KV contract and merge body the
    decode source includes), attention/epilogue.cuh (how a row is written out: conftest's
    EDITABLE_HEADERS, with the K/V pool and the CUDA-core tile math), attention/visibility.cuh (the key rule),
    attention/stage_ring.cuh, attention/kv_format.cuh (the scales) and attention/mma_tile.cuh (the tensor-core
    tile products) copied in, and with one edit."""
    r = render(spec, config)
    src = inline_provided(inline_provided(r.source), "kgen/attention/visibility.cuh")
    src = inline_provided(src, ("kgen/attention/stage_ring.cuh", "kgen/attention/kv_format.cuh",
                                "kgen/attention/mma_tile.cuh"))
    if old is not None:
        assert src.count(old) == 1, f"mutation target not found exactly once: {old!r}"
        src = src.replace(old, new)
    return kernel_from_source(spec, src, backend="cpu", config=r.config, archs=[])


CUDA_CORES = {"mma_min_group": 0}  # the CUDA-core body (paged_decode.cuh) for any group
SINGLE_PASS = {**CUDA_CORES, "partition_size": 0}  # every length through the body's own final write

# (id, spec overrides, config, source fragment, replacement, cases that must fail, cases that must pass)
MUTATIONS = [
    ("v_scale_dropped", {"kv_cache.dtype": "int8", "kv_cache.scale": "per_head"}, CUDA_CORES,
     "{ return p * (S::TOKEN_SCALES ? ss[NT + t1 + j] : v_sc); }", "{ return p; }", {"len_1", "long"}, set()),
    ("k_scale_dropped", {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"}, CUDA_CORES,
     "ksj * Cfg::SOFTMAX_SCALE", "Cfg::SOFTMAX_SCALE", {"long"}, {"len_1"}),
    ("per_head_scale_of_head_0", {"kv_cache.dtype": "int8", "kv_cache.scale": "per_head"}, CUDA_CORES,
     "s = Scales{k_scale[kv_head], v_scale[kv_head]};", "s = Scales{k_scale[0], v_scale[0]};",
     {"len_1", "long"}, set()),
    ("per_token_scale_strides_swapped", {"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_token_head"}, CUDA_CORES,
     "? k_scale + phys * ks_s_block + kv_head * ks_s_head + slot * ks_s_token",
     "? k_scale + phys * ks_s_block + kv_head * ks_s_token + slot * ks_s_head", {"long"}, set()),
    ("merge_drops_last_partition", {}, {"partition_size": 32, "mma_min_group": 0},
     "const int num_parts = split_partitions(kv_len, partition_tokens, max_partitions);",
     "const int num_parts = min(kv_len / partition_tokens, max_partitions);",
     {"len_P+1", "len_2P+1"}, {"len_P"}),
    # (len_P is one partition: its plan does not split, so it cannot see this one)
    ("partition_end_off_by_one", {}, {"partition_size": 32, "mma_min_group": 0},
     "hi = min(hi, (part + 1) * partition_tokens);", "hi = min(hi, (part + 1) * partition_tokens - 1);",
     {"len_P+1", "len_2P+1"}, {"len_P-1", "len_P", "len_1"}),
    ("window_off_by_one", {"attention.sliding_window": 24}, CUDA_CORES,
     "max(0, pos_first - WINDOW + 1)", "max(0, pos_first - WINDOW)",  # attention/visibility.cuh
     {"len_W+1", "len_W+2B+1"}, {"len_W-1", "len_W"}),
    ("tail_mask_removed", {}, CUDA_CORES,
     "const int end = Cfg::TAIL_MASK ? seq_len : ((seq_len + B - 1) / B) * B;",
     "const int end = ((seq_len + B - 1) / B) * B;", {"len_B-1", "len_B+1"}, {"len_B"}),
    ("v_read_with_k_strides", {}, CUDA_CORES,
     "kv_head * v_s_head + slot * v_s_token + d0 / PER;",  # attention/kv_pool.cuh's V row (here: the K loop's copy)
     "kv_head * k_s_head + slot * k_s_token + d0 / PER;",
     {"padded_pool"}, {"long", "len_B+1"}),
    ("gqa_query_head_off_by_one", {}, CUDA_CORES,
     "q + seq * q_s_seq + (long long)(q_head0 + g) * q_s_head;",
     "q + seq * q_s_seq + (long long)((q_head0 + g + 1) % Cfg::NUM_Q_HEADS) * q_s_head;",
     {"long", "len_B+1"}, {"len_1"}),
    ("alibi_sign_flipped", {"attention.alibi": True}, CUDA_CORES,
     "alibi_slope * (float)(key_pos - query_pos)", "alibi_slope * (float)(query_pos - key_pos)",
     {"long"}, {"len_1"}),
    ("soft_cap_missing", {"attention.logits_soft_cap": 2.0, "attention.softmax_scale": 0.5}, CUDA_CORES,
     "if (Cfg::SOFT_CAP > 0.0f) s = Cfg::SOFT_CAP * tanhf(s / Cfg::SOFT_CAP);", "",
     {"long"}, {"len_1"}),
    ("lse_without_max", {}, None,  # SoftmaxState::lse(), the one LSE of both launch plans
     "return m + logf(l);", "return logf(l);", {"mixed_batch_lse"}, {"mixed_batch"}),
    ("split_lse_without_max", {}, {"partition_size": 32, "mma_min_group": 0},
     "return m + logf(l);", "return logf(l);", {"mixed_batch_lse"}, {"mixed_batch"}),
    ("last_output_element_unwritten", {}, CUDA_CORES,
     "for (int i = tid; i < G * DV; i += THREADS) {\n    const int g = i / DV, d = i % DV;\n    SoftmaxState blk",
     "for (int i = tid; i < G * DV - 1; i += THREADS) {\n    const int g = i / DV, d = i % DV;\n    SoftmaxState blk",
     {"len_1", "long", "mixed_batch"}, set()),
    # attention sinks (softmax.cuh's add_sink, attention/epilogue.cuh's Epilogue): once per row, at the
    # end or in the merge, as given
    ("sink_added_per_partition", {"attention.sinks": True}, {"partition_size": 32, "mma_min_group": 0},
     "    if (split) {\n      partial_element(",
     "    if (split) {\n      if (sinks != nullptr) acc *= st.add_sink(sinks[h]);\n      partial_element(",
     {"len_P+1", "len_2P+1", "long"}, {"len_1", "len_P"}),  # one partition: not split
    ("sink_forgotten_by_the_merge", {"attention.sinks": True}, {"partition_size": 32, "mma_min_group": 0},
     "sinks != nullptr ? SoftmaxState{sinks[h], 1.0f} : SoftmaxState::empty();", "SoftmaxState::empty();",
     {"len_P+1", "len_2P+1", "long"}, {"len_1", "len_P"}),
    ("sink_forgotten", {"attention.sinks": True}, SINGLE_PASS,
     "      fold_sink(st, h, acc);\n", "", {"len_1", "long"}, set()),
    ("sink_scaled_like_a_logit", {"attention.sinks": True}, SINGLE_PASS,
     "acc *= st.add_sink(sinks[h]);", "acc *= st.add_sink(sinks[h] * Cfg::SOFTMAX_SCALE);", {"len_1", "long"},
     set()),
    ("mma_sink_scaled_like_a_logit", {"attention.sinks": True}, {"mma_min_group": 4, "partition_size": 0},
     "acc *= st.add_sink(sinks[h]);", "acc *= st.add_sink(sinks[h] * Cfg::SOFTMAX_SCALE);", {"len_1", "long"},
     set()),
    # the tensor-core body (templates/common/paged_decode_mma.cuh; BASE's group 4 takes it by default)
    ("mma_tail_mask_dropped", {}, {"mma_min_group": 4},  # fp16 group 4: tensor cores on request
     "s[j][i] = seen.contains(8 * j + (i & 1)) ? y : KGEN_NEG_INF;",
     "s[j][i] = 8 * j + (i & 1) >= seen.begin ? y : KGEN_NEG_INF;",
     {"len_B-1", "len_B+1"}, {"len_B"}),
    ("mma_q_k_permutation_wrong", {"kv_cache.dtype": "int8", "kv_cache.scale": "per_head"}, None,
     "  if (!BYTES8) return k;\n", "  return k;\n", {"len_B+1", "long"}, {"len_1"}),  # one key: weight 1 whatever its logit
    ("mma_v_columns_unpermuted", {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_tensor"}, None,
     "return 32 * (nt / 4) + 16 * (k / 2) + 2 * n + k % 2;", "return 8 * nt + n;", {"len_1", "long"}, set()),
    ("mma_token_v_scale_dropped", {"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_token_head"}, None,
     "if (S::TOKEN_SCALES) s[j][i] *= ss[NT + 8 * j + 2 * t + (i & 1)] * v_inv_ref;", "",
     {"long"}, {"len_1"}),  # one key: v_ref is its own scale, and the output times v_ref is right
    # the MMA tile part both mma.sync bodies share (attention/mma_tile.cuh): P's keys 8-15 of row g given
    # to row g + 8 (a padding row of group 4), so every row's P V misses half of each warp's tokens
    ("mma_p_fragment_registers_swapped", {}, {"mma_min_group": 4},
     "  a[1] = pack2<T>(c0[2], c0[3]);\n  a[2] = pack2<T>(c1[0], c1[1]);",
     "  a[2] = pack2<T>(c0[2], c0[3]);\n  a[1] = pack2<T>(c1[0], c1[1]);", {"long", "len_B+1"}, {"len_1"}),
    ("mma_stage_refilled_without_barrier", {}, {"mma_min_group": 4},  # fp16 group 4: tensor cores on request
     "    __syncthreads();  // everybody's have; and everybody is done with tile - 1, whose stage is refilled next\n",
     "", {"len_1"}, set()),  # the race checker stops at the first case (a shared-memory race report)
]


# The default tier: a scale, the split-KV merge, the tail and window masks, the LSE, a sink, and the
# tensor-core body's pipeline (a race); the full tier has every mutation.
DEFAULT_TIER = {"v_scale_dropped", "merge_drops_last_partition", "window_off_by_one", "tail_mask_removed",
                "lse_without_max", "sink_forgotten", "mma_stage_refilled_without_barrier"}
_controls: dict[str, object] = {}  # the unmutated kernel's report, once per (spec, config): mutations share them


def _control(spec, config):
    key = repr((spec.model_dump(mode="json"), config))
    if key not in _controls:
        _controls[key] = verify(_kernel(spec, config), seed=SEED)
    return _controls[key]


@pytest.mark.parametrize("mid,overrides,config,old,new,must_fail,must_pass",
                         full_tier_except(MUTATIONS, {i for i, m in enumerate(MUTATIONS) if m[0] in DEFAULT_TIER}),
                         ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught_by_the_right_case(mid, overrides, config, old, new, must_fail, must_pass):
    spec = _spec(**overrides)
    good = _control(spec, config)
    assert good.passed, good.summary()
    report = verify(_kernel(spec, config, old, new), seed=SEED)
    failed = {c.name for c in report.failed_cases}
    assert not report.passed
    assert must_fail <= failed, f"{mid}: expected {sorted(must_fail)} to fail, failed: {sorted(failed)}"
    assert not (must_pass & failed), f"{mid}: {sorted(must_pass & failed)} cannot see this bug but failed"
    assert report.failed_cases[0].name in report.summary()


def test_case_matrix_adds_partition_and_window_lengths():
    rng = np.random.default_rng(0)
    spec = _spec(**{"attention.sliding_window": 40})
    names = {n: lens for n, lens, _ in decode_case_matrix(spec, {"partition_size": 64}, rng)}
    assert [names[k] for k in ("len_P-1", "len_P", "len_P+1", "len_2P+1")] == [[63], [64], [65], [129]]
    assert [names[k] for k in ("len_W-1", "len_W", "len_W+1")] == [[39], [40], [41]]
    assert {"len_B-1", "len_B+1", "mixed_batch", "shared_prefix", "padded_pool"} <= set(names)
    plain = {n for n, _, _ in decode_case_matrix(_spec(), {"partition_size": 0}, rng)}
    assert not any(n.startswith(("len_P", "len_W")) for n in plain)


def test_case_matrix_keeps_the_tail_masking_contract():
    spec = _spec(tail_masking=False)
    for name, lens, _ in decode_case_matrix(spec, {"partition_size": 48}, np.random.default_rng(1)):
        assert all(n % 16 == 0 and (n > 0 or name == "padded_rows") for n in lens), (name, lens)


def test_check_output_refuses_nan_and_errors_above_the_bound():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((2, 4, 32))
    lowp = ref + 1e-3 * rng.standard_normal(ref.shape)
    assert check_output("ok", [1, 2], ref.astype(np.float16), ref, lowp, "fp16").passed
    bad = ref.copy()
    bad[1, 2, 3] = np.nan
    r = check_output("nan", [1, 2], bad, ref, lowp, "fp16")
    assert not r.passed and r.nan_count == 1 and r.first_failure["head"] == 2
    off = ref.copy()
    off[0, 1, 5] += 10 * np.max(np.abs(lowp - ref))
    r = check_output("off", [1, 2], off, ref, lowp, "fp16")
    assert not r.passed and (r.first_failure["sequence"], r.first_failure["dim"]) == (0, 5)


def test_a_device_budget_runs_the_cases_past_it_on_the_host(strict_cuda):
    """Serving-time verification (kgen/vllm) between vLLM's memory profiling and its KV-cache
    allocation: huge_pool's 8.6 GB of pools for this fp16 spec would be allocated on the GPU; with a
    256 MiB budget it runs on the CPU backend's build of the same source, its verdict says so, every
    other case runs on the device, and what the run asks of the device stays far under the budget."""
    from conftest import tiny_decode

    from kgen.build import build
    from kgen.families.attention.adversarial_cases import huge_pool_bytes

    spec = tiny_decode()
    assert huge_pool_bytes(spec) > 8 * 2**30
    budget = 256 * 2**20
    kern = build(spec, backend="cuda", device_budget=budget)
    assert kern.report.passed, kern.report.summary()
    moved = [r.name for r in kern.report.cases if "run on the host" in (r.note or "")]
    assert moved == ["huge_pool"], moved
    assert "over the device budget of 256 MiB" in next(r.note for r in kern.report.cases if r.name == "huge_pool")
    sizes = [size for kind, _, size in (e for e in strict_cuda.log if e[0] == "malloc")]
    assert sizes and strict_cuda.peak_bytes < budget // 8, (max(sizes), strict_cuda.peak_bytes)
