"""Optional executor: run tuning measurements as Ray tasks (`pip install 'kgen[ray]'`).

Each (spec, config, bucket) measurement is one task over plain data (kgen/tune_measure.py),
so Ray only schedules: one task per GPU on the CUDA backend (num_gpus=1, so two timings
never share a device), one per CPU otherwise. Results come back as the same dicts the
local executor produces and are merged into the same JSON. kgen connects to a running
cluster when RAY_ADDRESS is set (Ray's own convention), else starts a local instance.
"""

from __future__ import annotations

from kgen.optional import require


def require_ray():
    return require("ray", "the ray executor", "pip install 'kgen[ray]' (or use --executor local)")


def ray_map(tasks: list[dict]) -> list[dict]:
    """Run `run_task` on every task through Ray; results in task order."""
    ray = require_ray()
    from kgen.tune.measure import run_task

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    gpu = bool(tasks) and tasks[0]["backend"] == "cuda"
    remote = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1, max_retries=0)(run_task)
    return ray.get([remote.remote(t) for t in tasks])
