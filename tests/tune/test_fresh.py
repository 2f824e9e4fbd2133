"""kgen.tune.fresh: a measurement in a spawned process (the CUDA tuner's), whose crash, error or
hang is that config's failed result while the run goes on."""

from __future__ import annotations

import pytest
from conftest import tiny_decode

from kgen.runtime.cuda import gpu_available
from kgen.tune.fresh import TIMEOUT, run_in_fresh_process
from kgen.tune.measure import make_task

CONFIG = {"threads": 64, "partition_size": 0}


def test_a_measurement_runs_in_its_own_process_and_returns_its_result():
    result = run_in_fresh_process(make_task(tiny_decode(), CONFIG, (2, 40), "cpu", 0.001, seed=5))
    assert result["status"] == "ok" and result["reps"] >= 3 and result["max_error"] <= result["bound"], result


def test_a_measurement_past_its_limit_is_killed_and_the_next_one_runs():
    task = make_task(tiny_decode(), CONFIG, (2, 40), "cpu", 0.001, seed=5)
    stopped = run_in_fresh_process(task, timeout_s=0.2)  # a spawned Python does not even start in 0.2 s
    assert stopped["status"] == TIMEOUT and "killed after" in stopped["reason"], stopped
    assert run_in_fresh_process(task)["status"] == "ok"


@pytest.mark.skipif(gpu_available(), reason="shows the failure where no GPU is usable")
def test_an_error_in_the_measurements_process_is_its_result_not_an_exception():
    result = run_in_fresh_process(make_task(tiny_decode(), CONFIG, (2, 40), "cuda", 0.001, seed=5))
    assert result["status"] != "ok" and "no usable CUDA GPU" in result["reason"], result
