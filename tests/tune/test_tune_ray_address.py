"""`kgen tune --ray-address`: the sweep joins an existing Ray cluster instead of starting one.

The cluster is a local one this test starts (and stops) with ray.init, advertising one CPU more than
the machine has: a `kgen tune` process that started its own instance would see os.cpu_count()."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import TINY_DECODE, run_kgen, write_spec

TUNING = {"params": {"threads": [64], "partition_size": [0, 32]}, "constraints": ["threads >= 32 * group_size"],
          "buckets": {"batch": [1], "context": [16]}}


@pytest.fixture
def cluster(monkeypatch):
    """A running local Ray cluster; yields its address. Token authentication is off: it would write a
    token into the user's ~/.ray."""
    import ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cpus = (os.cpu_count() or 1) + 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    yield ray.get_runtime_context().gcs_address, cpus
    ray.shutdown()


def test_tune_joins_the_cluster_at_ray_address(tmp_path, cluster):
    address, cpus = cluster
    write_spec(tmp_path, yaml.safe_dump({**TINY_DECODE, "name": "tiny_ray_address", "tuning": TUNING}), "tiny.yaml")
    r = run_kgen("tune", "tiny.yaml", "--backend", "cpu", "--ray-address", address, "--measure-s", "0.002",
                 "--seed", "1", "--json", cwd=tmp_path, env={"KGEN_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert f"ray: joined the cluster at {address}: {cpus} CPUs, 0 GPUs" in r.stderr
    results = json.loads(r.stdout)
    assert [(m["status"], m["config"]["partition_size"]) for m in results["measurements"]] == [("ok", 0), ("ok", 32)]
    saved = list((tmp_path / "cache" / "tuning" / "tiny_ray_address").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["winners"]["1x16"] in results["space"]["configs"]
