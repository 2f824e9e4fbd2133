"""Optional executor: run tuning measurements as Ray tasks (`pip install 'kgen[ray]'`).

Each (spec, config, bucket) measurement is one task over plain data (kgen/tune/measure.py),
so Ray only schedules: one task per GPU on the CUDA backend (num_gpus=1, so two timings
never share a device), one per CPU otherwise. Results come back as the same dicts the
local executor produces and are merged into the same JSON. kgen joins the cluster given to
connect() (`kgen tune --ray-address`), else the one RAY_ADDRESS names (Ray's own convention),
else starts a local instance; a caller that ran ray.init() itself keeps its cluster.
"""

from __future__ import annotations

from kgen.errors import KgenUserError
from kgen.tune.measure import run_task


def require_ray():
    try:
        import ray
    except ImportError:
        raise KgenUserError("the ray executor needs Ray, which is not installed: "
                            "pip install 'kgen[ray]' (or use --executor local)") from None
    return ray


def connect(address: str | None = None):
    """Ray, joined to the cluster at `address` ("host:port", "ray://host:port", "auto"; None:
    RAY_ADDRESS, else a new local instance) unless this process already joined one."""
    ray = require_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise KgenUserError(f"cannot reach the Ray cluster at {address}: {e}") from None
    return ray


def ray_map(tasks: list[dict]) -> list[dict]:
    """Run `run_task` on every task through Ray; results in task order."""
    ray = connect()
    gpu = bool(tasks) and tasks[0]["backend"] == "cuda"
    remote = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1, max_retries=0)(run_task)
    return ray.get([remote.remote(t) for t in tasks])
