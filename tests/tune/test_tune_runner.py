"""Tuning on the CPU backend with real builds and launches: measurement, persistence,
the per-bucket kernel, and the Ray executor on a local Ray cluster."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import SPILLY_PREFILL, reference_check, tiny_decode

from kgen.build import build
from kgen.errors import KernelRuntimeError, KgenUserError
from kgen.families.attention.decode import PAGED_DECODE
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.prefill import PAGED_PREFILL
from kgen.families.base import resolve_config
from kgen.plan import arch as arch_table
from kgen.spec.models import load_spec, spec_from_dict
from kgen.tune import measure as tune_measure
from kgen.tune.measure import make_task, run_task
from kgen.tune.results import (
    TuningWarning,
    device_info,
    load_results,
    read_results,
    results_path,
    save_results,
)
from kgen.tune.runner import tune_spec
from kgen.tune.tuned import TunedKernel, _nearest, tuned_from_manifest

TUNING = {"params": {"threads": [32, 64, 2048], "partition_size": [0, 32]},
          "constraints": ["threads >= 32 * group_size"], "defaults": {"threads": 64, "partition_size": 0},
          "buckets": {"batch": [1, 3], "context": [16, 100]}}
FAST = {"budget_s": 30, "measure_s": 0.002}


@pytest.fixture(scope="module")
def spec():
    return tiny_decode("tiny_tune", tuning=TUNING)


@pytest.fixture(scope="module")
def tuned(spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("tuning")
    return root, tune_spec(spec, backend="cpu", seed=3, root=root, **FAST)


def test_every_config_is_timed_on_every_bucket(tuned):
    _, results = tuned
    assert results["strategy"] == "exhaustive" and results["clock"] == "cpu-wall"
    assert len(results["space"]["configs"]) == 2 and len(results["space"]["pruned"]) == 4
    seen = {(m["config"]["partition_size"], m["batch"], m["context"]) for m in results["measurements"]}
    assert seen == {(p, b, c) for p in (0, 32) for b in (1, 3) for c in (16, 100)}
    for m in results["measurements"]:
        assert m["status"] == "ok", m
        assert m["reps"] >= 3 and m["min_s"] <= m["median_s"] <= m["max_s"]
        assert m["max_error"] <= m["bound"]


def test_winner_is_the_fastest_per_bucket(tuned):
    _, results = tuned
    for name, config in results["winners"].items():
        b, c = (int(x) for x in name.split("x"))
        times = {json.dumps(m["config"], sort_keys=True): m["median_s"] for m in results["measurements"]
                 if (m["batch"], m["context"]) == (b, c)}
        assert times[json.dumps(config, sort_keys=True)] == min(times.values())
    assert results["default_winner"] in results["space"]["configs"]


def test_results_round_trip_and_record_the_environment(spec, tuned):
    root, results = tuned
    info = device_info("cpu")
    path = results_path(spec, info, root)
    assert read_results(path) == json.loads(json.dumps(results))
    assert results["device"]["name"] == info["name"] and results["spec_hash"] == spec.spec_hash()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_results(spec, "cpu", root=root)["winners"] == results["winners"]


def test_results_for_another_spec_are_not_used(spec, tuned):
    root, _ = tuned
    changed = spec.with_overrides(**{"attention.softmax_scale": 0.5})
    with pytest.warns(TuningWarning, match="spec hash differs"):
        assert load_results(changed, "cpu", root=root) is None


def test_results_for_another_device_are_not_used(spec, tuned, tmp_path):
    _, results = tuned
    other = json.loads(json.dumps(results))
    other["device"]["name"] = "Some Other CPU"
    save_results(other, results_path(spec, device_info("cpu"), tmp_path))
    with pytest.warns(TuningWarning, match="device name"):
        assert load_results(spec, "cpu", root=tmp_path) is None


def test_corrupt_results_warn_and_fall_back(spec, tmp_path):
    path = results_path(spec, device_info("cpu"), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "winners": ')
    with pytest.warns(TuningWarning, match="corrupt tuning results"):
        assert load_results(spec, "cpu", root=tmp_path) is None
    path.write_text('{"format": 1}')
    with pytest.raises(KgenUserError, match="missing kgen_version"):
        read_results(path)


def test_measurement_rejects_a_fast_but_wrong_kernel(spec):
    config = {"threads": 64, "partition_size": 0}
    good = tune_measure._kernel(spec, config, "cpu")

    class Wrong:  # the real kernel, its output corrupted after every launch
        config, resources, spec = good.config, good.resources, good.spec

        def bind(self, **args):
            call = good.bind(**args)
            launch = call.launch

            def corrupted():
                launch()
                call.result[0, 0, 0] += 1.0

            call.launch = corrupted
            return call

    key = next(k for k, v in tune_measure._KERNELS.items() if v is good)
    tune_measure._KERNELS[key] = Wrong()
    try:
        result = run_task(make_task(spec, config, (2, 40), "cpu", 0.001, seed=5))
    finally:
        tune_measure._KERNELS[key] = good
    assert result["status"] == "wrong" and math.isinf(result["median_s"])
    assert "does not match the reference" in result["reason"]


def _tiny_register_file(monkeypatch):
    """Every arch of the table with 64 registers per block: no config fits."""
    for arch, lim in list(arch_table.ARCH_LIMITS.items()):
        monkeypatch.setitem(arch_table.ARCH_LIMITS, arch, dataclasses.replace(lim, regs_per_block=64))


def test_resource_overflow_scores_inf_with_the_reason(spec, monkeypatch):
    _tiny_register_file(monkeypatch)
    result = run_task(make_task(spec, {"threads": 64, "partition_size": 0}, (1, 16), "cpu", 0.001, seed=1))
    assert result["status"] == "resources" and "registers x 64 threads > 64" in result["reason"]


def test_every_config_failing_is_an_error_not_a_silent_default(spec, monkeypatch, tmp_path):
    _tiny_register_file(monkeypatch)
    with pytest.raises(KernelRuntimeError, match="every config failed"):
        tune_spec(spec, backend="cpu", seed=1, root=tmp_path, save=True, **FAST)
    assert not list(tmp_path.rglob("*.json"))


def test_compile_failure_scores_inf_and_the_run_goes_on(spec, monkeypatch, tmp_path):
    real = PAGED_DECODE.template_context

    def broken(spec_, config, kernels):  # partition 32 renders a kernel NVRTC rejects (a constant that does not parse)
        ctx = real(spec_, config, kernels)
        return {**ctx, "softmax_scale": "1.0f +"} if config["partition_size"] == 32 else ctx

    monkeypatch.setattr(PAGED_DECODE, "template_context", broken)
    tune_measure._KERNELS.clear()
    try:
        results = tune_spec(spec, backend="cpu", seed=2, root=tmp_path, **FAST)
    finally:
        tune_measure._KERNELS.clear()
    bad = [m for m in results["measurements"] if m["config"]["partition_size"] == 32]
    assert bad and all(m["status"] == "compile_failed" and m["reason"] for m in bad)
    assert all(w == {"threads": 64, "partition_size": 0, "stages": 0, "heads_per_thread": 0, "mma_min_group": -1}
               for w in results["winners"].values())


def test_tasks_are_plain_data_for_any_executor(spec, tmp_path):
    shipped = []

    def remote_like(tasks):  # what a cluster engine does: serialize, run elsewhere, send back
        shipped.extend(tasks)
        return [json.loads(json.dumps(run_task(json.loads(json.dumps(t))))) for t in tasks]

    results = tune_spec(spec, backend="cpu", seed=4, root=tmp_path, executor=remote_like, **FAST)
    assert len(shipped) == len(results["measurements"]) == 8
    assert len({t["seed"] for t in shipped}) == 8  # fresh inputs per measurement
    assert set(results["winners"]) == {"1x16", "1x100", "3x16", "3x100"}


def test_ray_executor_without_ray_says_how_to_install_it(spec, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the extra
    with pytest.raises(KgenUserError, match=r"pip install 'kgen\[ray\]'"):
        tune_spec(spec, backend="cpu", seed=4, root=tmp_path, executor="ray", **FAST)


@pytest.fixture
def local_ray(monkeypatch):
    """A local Ray cluster of two CPUs (Ray is in the test extra), shut down afterwards.
    Token authentication is off: it would write a token into the user's ~/.ray."""
    import ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    yield ray
    ray.shutdown()


@pytest.mark.full  # ~23 s starting a local Ray cluster; the local executor is the default tier's
def test_ray_executor_measures_on_a_local_cluster(tmp_path, local_ray):
    spec = tiny_decode("tiny_ray", tuning={"params": {"threads": [64], "partition_size": [0, 32]},
                                           "constraints": ["threads >= 32 * group_size"],
                                           "buckets": {"batch": [1], "context": [16]}})
    tune_measure._KERNELS.clear()
    results = tune_spec(spec, backend="cpu", seed=4, root=tmp_path, executor="ray", **FAST)
    assert local_ray.is_initialized()
    assert [(m["status"], m["config"]["partition_size"]) for m in results["measurements"]] == [("ok", 0), ("ok", 32)]
    assert set(results["winners"]) == {"1x16"} and results["winners"]["1x16"] in results["space"]["configs"]
    assert not tune_measure._KERNELS, "the kernels were built in this process, not in Ray workers"


def test_nearest_bucket_is_nearest_in_log_space():
    axis = [1, 8, 64, 256]
    assert [_nearest(axis, v) for v in (1, 2, 3, 4, 9, 100, 200, 5000)] == [1, 1, 8, 8, 8, 64, 256, 256]


def test_tuned_kernel_picks_the_bucket_config_and_stays_correct(spec, tuned):
    _, results = tuned
    forced = json.loads(json.dumps(results))  # two different winners, to see the switch
    forced["winners"] = {"1x16": {"threads": 64, "partition_size": 0}, "1x100": {"threads": 64, "partition_size": 32},
                         "3x16": {"threads": 64, "partition_size": 0}, "3x100": {"threads": 64, "partition_size": 32}}
    kern = TunedKernel(spec, forced, "cpu")
    assert len(kern.variants) == 2
    assert kern.select(1, 16).config["partition_size"] == 0
    assert kern.select(2, 96).config["partition_size"] == 32
    rng = np.random.default_rng(0)
    for lens in ([5, 17, 3], [90, 70]):
        args = make_decode_case(spec, lens, rng)
        assert reference_check(spec, args, kern(**args), "tuned").passed


def test_manifest_hook_warns_on_a_foreign_device(spec, tuned):
    _, results = tuned
    base = build(spec, backend="cpu", verify=False, config=results["default_winner"])
    assert isinstance(tuned_from_manifest(base, results, "cpu"), TunedKernel)
    foreign = json.loads(json.dumps(results))
    foreign["device"]["name"] = "NVIDIA H100"
    with pytest.warns(TuningWarning, match="ignoring the manifest's tuning results"):
        kern = tuned_from_manifest(base, foreign, "cpu")
    assert kern.config == {"threads": 64, "partition_size": 0, "stages": 0, "heads_per_thread": 0, "mma_min_group": -1}  # untuned defaults
    assert tuned_from_manifest(base, None, "cpu") is base


# ---- kinds other than decode tune on their own family's benchmark inputs ----------------------
CACHE_SPECS = {"cache_write": "specs/cache_write_fp8_e4m3.yaml", "copy_blocks": "specs/copy_blocks_fp16.yaml"}
SMALL = {"attention.head_dim": 64, "attention.num_kv_heads": 2, "attention.num_q_heads": 2}


def cache_spec(kind, tuning):
    return load_spec(CACHE_SPECS[kind]).with_overrides(tuning=tuning, **SMALL)


@pytest.mark.parametrize("kind", sorted(CACHE_SPECS))
def test_cache_kinds_tune_on_their_own_inputs(kind, tmp_path):
    spec = cache_spec(kind, {"params": {"threads": [64, 128]}})  # no constraints
    results = tune_spec(spec, backend="cpu", seed=6, root=tmp_path, buckets={"batch": [1, 3], "context": [16, 40]},
                        **FAST)
    assert len(results["measurements"]) == 8
    for m in results["measurements"]:
        assert m["status"] == "ok", m
        assert m["max_error"] == 0 and m["bound"] == 0  # bit-exact: every written byte checked
    assert {m["config"]["threads"] for m in results["measurements"]} == {64, 128}


@pytest.mark.parametrize("kind", sorted(CACHE_SPECS))
def test_cache_kind_measurement_rejects_a_wrong_write(kind):
    spec = cache_spec(kind, {"params": {"threads": [64]}})
    config = {"threads": 64}
    good = tune_measure._kernel(spec, config, "cpu")

    class Wrong:  # the real kernel binding a copy of the K pool: V is written right, K untouched
        config, resources, spec = good.config, good.resources, good.spec

        def bind(self, **args):
            return good.bind(**{**args, "k_cache": args["k_cache"].copy()})

    key = next(k for k, v in tune_measure._KERNELS.items() if v is good)
    tune_measure._KERNELS[key] = Wrong()
    try:
        result = run_task(make_task(spec, config, (2, 40), "cpu", 0.001, seed=5))
    finally:
        tune_measure._KERNELS[key] = good
    assert result["status"] == "wrong" and "element(s) wrong" in result["reason"], result


# ---- prefill, and the budget ------------------------------------------------------------------

PREFILL = {"kgen": 1, "name": "tiny_tune_prefill", "kind": "paged_prefill",
           "attention": {"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 128},
           "kv_cache": {"block_size": 16, "layout": "separate", "dtype": "fp16"},
           "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_80", "sm_90"],
           "tuning": {"params": {"warps": [2, 4], "kv_tile": [64], "stages": [2], "partition_size": [0]},
                      "defaults": {"warps": 4, "kv_tile": 64, "stages": 2, "partition_size": 0},
                      "buckets": {"batch": [1], "context": [40]}}}


def test_a_prefill_spec_tunes(tmp_path):
    """Every config of a head_dim 128 prefill space needs more than 48 KiB of dynamic shared memory
    (78,336 and 87,040 bytes): the launcher opts in, and so does the tuner's resource check (it
    refused them all, "every config failed")."""
    from kgen.families.attention.prefill import PAGED_PREFILL

    spec = spec_from_dict(PREFILL)
    assert [d.smem for d in PAGED_PREFILL.kernels(spec, resolve_config(PAGED_PREFILL, spec, {"warps": 4}))][0] == 87_040
    results = tune_spec(spec, backend="cpu", seed=6, root=tmp_path, budget_s=600, measure_s=0.001)
    assert [(m["config"]["warps"], m["status"]) for m in results["measurements"]] == [(4, "ok"), (2, "ok")]
    assert results["complete"] and results["not_run"] == 0
    assert results["winners"]["1x40"] in results["space"]["configs"]
    assert results["default_winner"] == results["winners"]["1x40"]


def test_a_tiny_budget_returns_promptly_with_what_was_done(spec, tmp_path):
    """The budget bounds the whole run: past it no measurement starts (compiles included), and the
    results say how many were not run; the winners come from what was measured."""
    seen = []

    def slow_progress(record, state):  # each measurement takes at least 0.4 s of the budget
        seen.append((record["status"], state["elapsed_s"]))
        time.sleep(0.4)

    tune_measure._KERNELS.clear()
    started = time.perf_counter()
    results = tune_spec(spec, backend="cpu", seed=7, root=tmp_path, budget_s=1.0, measure_s=0.001,
                        strategy="exhaustive", progress=slow_progress)
    took = time.perf_counter() - started
    done, not_run = len(results["measurements"]), results["not_run"]
    assert done >= 1 and not_run >= 1 and done + not_run == 8, (done, not_run)
    assert not results["complete"] and [s for s, _ in seen].count("not_run") == not_run
    # the first measurement may compile (a few seconds); nothing starts after the budget
    assert took < 1.0 + max(r["compile_s"] for r in results["measurements"]) + 0.4 * done + 10
    measured = {json.dumps(m["config"], sort_keys=True) for m in results["measurements"] if m["status"] == "ok"}
    assert all(json.dumps(w, sort_keys=True) in measured for w in results["winners"].values() if w is not None)
    assert results["measurements"][0]["config"] == results["space"]["defaults"]  # the default is timed first


def test_a_budget_spent_before_anything_was_timed_says_so(spec, tmp_path):
    with pytest.raises(KernelRuntimeError, match=r"budget of 1e-06 s was spent before any config was timed"):
        tune_spec(spec, backend="cpu", seed=8, root=tmp_path, budget_s=1e-6, measure_s=0.001)
    assert not list(tmp_path.rglob("*.json"))


def test_a_measurement_running_past_the_budget_is_stopped(spec, tmp_path, monkeypatch):
    """A CPU-backend launch cannot be interrupted in-process: the measurement runs in a child that is
    stopped at the deadline, and counts as not run."""
    real = tune_measure.run_task

    def slow(task):  # a launch of minutes, as a large prefill bucket on the fiber runtime
        if task["config"]["partition_size"] == 32:
            time.sleep(60)
        return real(task)

    for config in ({"threads": 64, "partition_size": 0}, {"threads": 64, "partition_size": 32}):
        tune_measure._kernel(spec, config, "cpu")  # compiled before the clock starts (the disk cache)
    monkeypatch.setattr(tune_measure, "run_task", slow)
    started = time.perf_counter()
    results = tune_spec(spec, backend="cpu", seed=9, root=tmp_path, budget_s=6.0, measure_s=0.001,
                        strategy="exhaustive")
    assert time.perf_counter() - started < 6.0 + tune_measure.GRACE_S + 5
    assert {m["config"]["partition_size"] for m in results["measurements"]} <= {0}
    assert results["not_run"] >= 1 and not results["complete"]


# ---- ptxas advisories prune ----------------------------------------------------------------------------
SPILLY = {k: v for k, v in SPILLY_PREFILL.items() if k != "tuning"}
SPILLING = {"warps": 8, "kv_tile": 128, "m_tiles": 2}
CLEAN = {"warps": 2, "kv_tile": 16, "m_tiles": 1}


def test_a_config_that_draws_an_advisory_is_pruned_with_it():
    spec = spec_from_dict(SPILLY)
    config = resolve_config(PAGED_PREFILL, spec, SPILLING)
    result = run_task(make_task(spec, config, (1, 64), "cpu", 0.001, seed=1))
    assert result["status"] == "pruned" and math.isinf(result["median_s"]) and result["reps"] == 0, result
    assert result["reason"].startswith("ptxas advisory: sm_80 spilly_prefill: spill ") and "stack frame" in result["reason"]


def test_a_space_pruned_whole_by_ptxas_is_an_error_naming_the_advisory(tmp_path):
    spec = spec_from_dict({**SPILLY, "tuning": {"params": {k: [v] for k, v in SPILLING.items()}}})
    with pytest.raises(KernelRuntimeError, match=r"(?s)every config failed.*pruned: ptxas advisory: sm_80 spilly_prefill: "
                                                 r"spill"):
        tune_spec(spec, backend="cpu", buckets={"batch": [1], "context": [32]}, budget_s=60, root=tmp_path)


def test_ptxas_pruned_configs_are_recorded_as_pruned_not_dropped(tmp_path):
    spec = spec_from_dict({**SPILLY, "tuning": {"params": {k: [CLEAN[k], SPILLING[k]] for k in CLEAN},
                                                "constraints": ["kv_tile == 8 * warps * m_tiles"]}})
    results = tune_spec(spec, backend="cpu", buckets={"batch": [1], "context": [32]}, budget_s=300, root=tmp_path)
    pruned = {tuple(sorted((k, p["config"][k]) for k in CLEAN)): p["reason"] for p in results["space"]["pruned"]}
    spilling = tuple(sorted(SPILLING.items()))
    assert pruned[spilling].startswith("ptxas advisory: sm_80 spilly_prefill: spill")
    assert all(tuple(sorted((k, c[k]) for k in CLEAN)) != spilling for c in results["space"]["configs"])
    assert {k: results["default_winner"][k] for k in CLEAN} == CLEAN
    assert any(m["status"] == "pruned" for m in results["measurements"])
