"""One tuning measurement: (spec, config, bucket) in, plain data out.

`run_task(task)` takes and returns JSON-able dicts, so the same function runs in
this process or as a task on a cluster engine (kgen/tune/ray_executor.py). It builds the
config (cached like any build), refuses it when it exceeds the target archs'
resources, prunes it when ptxas drew a performance advisory for one of its cubins
(serialised wgmma, spills, local memory: status "pruned", the advisory as the reason), times it on fresh random inputs, and re-verifies the output of the timed
launches as its family's verification does: a fast but wrong config scores inf. The
family supplies the benchmark inputs of each (batch, context) bucket (docs/tuning.md).

Timing: on CUDA, device events around each launch, warm-up, inputs rotated and L2
flushed (a buffer twice the L2 size is overwritten) between launches; on the CPU
backend the same loop with a wall clock (`clock: "cpu-wall"`): fine for testing the
tuner and for CPU users, meaningless as a GPU ranking.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from kgen.arrays import args_to_backend, to_numpy
from kgen.bodies import spec_for_arch
from kgen.build import build, compile_cubins
from kgen.compile.advisories import advisories_of, describe
from kgen.compile.nvrtc import resources_as_dict
from kgen.errors import CompileError, KgenError, KgenUserError
from kgen.families.registry import family_for
from kgen.plan.arch import launch_problems
from kgen.render import render
from kgen.runtime.cuda import is_device_error
from kgen.spec.models import spec_from_dict

BUDGET = "not_run"  # the status of a task the tuning budget did not reach (not a measurement)
PRUNED = "pruned"  # the status of a config whose cubin drew a ptxas advisory (kgen/compile/advisories.py)
ROTATE = 2  # input sets cycled between launches (defeats caches holding the last launch's data)
WARMUP = 2
MIN_REPS, MAX_REPS = 3, 10_000

_KERNELS: OrderedDict[tuple, Any] = OrderedDict()  # in-process builds: one per (spec, config, backend)
_KERNEL_SLOTS = 16


def make_task(spec, config: dict, bucket: tuple[int, int], backend: str, measure_s: float, seed: int,
              deadline: float | None = None) -> dict:
    """One measurement as plain data; `deadline` (time.time() epoch): the run's budget ends then."""
    return {"spec": spec.canonical(), "config": dict(config), "batch": int(bucket[0]), "context": int(bucket[1]),
            "backend": backend, "measure_s": float(measure_s), "seed": int(seed), "deadline": deadline}


def failed(task: dict, status: str, reason: str, compile_s: float = 0.0) -> dict:
    return {"config": task["config"], "batch": task["batch"], "context": task["context"], "status": status,
            "reason": reason, "median_s": math.inf, "min_s": math.inf, "max_s": math.inf, "reps": 0,
            "compile_s": round(compile_s, 3)}


def _spent(task: dict) -> bool:
    return task.get("deadline") is not None and time.time() >= task["deadline"]


def resource_problems(kernel) -> list[str]:
    """Reasons the config cannot launch on one of the spec's target archs: each kernel's ptxas
    figures with the family's block size and dynamic shared memory, against the arch table as the
    CUDA launcher launches it (kgen.plan.arch.launch_problems: it opts in to dynamic shared memory
    past 48 KiB, up to the arch's limit)."""
    out = []
    family = family_for(kernel.spec)
    for arch, kernels in kernel.resources.items():  # each arch's cubin holds its own body (kgen/bodies.py)
        for decl in family.kernels(spec_for_arch(kernel.spec, arch), kernel.config):
            res = kernels.get(decl.name, {})
            out += launch_problems(arch, decl.name, decl.block, res.get("registers", 0), res.get("static_smem", 0),
                                   decl.smem, decl.launch_registers)
    return out


def _kernel(spec, config: dict, backend: str):
    key = (spec.spec_hash(), json.dumps(config, sort_keys=True), backend)
    if key in _KERNELS:
        _KERNELS.move_to_end(key)
        return _KERNELS[key]
    try:
        kernel = build(spec, backend=backend, verify=False, config=config)
    except (CompileError, KgenUserError) as e:
        kernel = e  # a failed compile is a result too: don't retry it per bucket
    _KERNELS[key] = kernel
    while len(_KERNELS) > _KERNEL_SLOTS:
        _KERNELS.popitem(last=False)
    return kernel


def _advisories(spec, config: dict) -> list[dict] | Exception:
    """ptxas's advisories for the config's cubins (every target arch), before anything else is built for
    it: the build that follows finds the cubins in the cache. A compile error comes back as the exception
    (the build reports it)."""
    try:
        rendered = render(spec, config)
        cubins = compile_cubins(spec, rendered)
    except (CompileError, KgenUserError) as e:
        return e
    return advisories_of({arch: resources_as_dict(a.resources) for arch, a in cubins.items()})


class _WallTimer:
    clock = "cpu-wall"

    def time(self, launch) -> float:
        start = time.perf_counter()
        launch()
        return time.perf_counter() - start


class _CudaTimer:
    clock = "cuda-events"

    def __init__(self):
        import cupy

        self.cupy = cupy
        l2 = cupy.cuda.Device().attributes.get("L2CacheSize", 64 << 20)
        self.flush = cupy.empty(2 * l2 // 4, dtype=cupy.int32)
        self.start, self.stop = cupy.cuda.Event(), cupy.cuda.Event()

    def time(self, launch) -> float:
        self.flush.fill(0)  # evict the previous launch's data from L2 (not timed)
        self.start.record()
        launch()
        self.stop.record()
        self.stop.synchronize()
        return self.cupy.cuda.get_elapsed_time(self.start, self.stop) / 1e3


GRACE_S = 2.0  # what a bounded measurement may take past the deadline (its result on the way back)


def run_bounded(task: dict) -> dict:
    """run_task in a forked child that is stopped when the run's deadline passes: a CPU-backend
    launch of a large bucket (or a compile) takes minutes and cannot be interrupted in-process.
    A measurement stopped this way is not run (status BUDGET), like one that never started. The
    child shares this process's state (builds in memory, monkeypatches); its builds reach the
    parent through the disk cache. Without a deadline, or where fork is unsafe (a CUDA context:
    use run_task), this is run_task."""
    if task.get("deadline") is None:
        return run_task(task)
    if _spent(task):
        return failed(task, BUDGET, "the tuning budget was spent before it started")
    started = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_bounded_child, args=(task, send), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(max(0.0, task["deadline"] - time.time()) + GRACE_S):
            try:
                return receive.recv()
            except EOFError:  # the child died without an answer (a crash in a launch)
                child.join(5)
                return failed(task, "launch_failed", f"the measurement's process ended (exit code {child.exitcode})")
        return failed(task, BUDGET, f"stopped when the tuning budget ran out, {time.perf_counter() - started:.1f} s "
                                    "into the measurement")
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()


def _bounded_child(task: dict, send) -> None:
    try:
        result = run_task(task)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, never raised in a fork
        result = failed(task, "launch_failed", f"{type(e).__name__}: {e}"[:300])
    try:
        send.send(result)
        send.close()
    finally:
        os._exit(0)  # no atexit handlers of the parent's (Ray, rich, temp dirs) in a fork


def run_task(task: dict) -> dict:
    """Measure one (config, bucket); never raises for a bad config (status + reason instead).
    Past the task's deadline nothing starts (status BUDGET); one that starts compiles, then times
    at least one launch and re-verifies it even when the deadline passes meanwhile."""
    if _spent(task):
        return failed(task, BUDGET, "the tuning budget was spent before it started")
    spec = spec_from_dict(task["spec"], filename="<tuning task>")
    backend = task["backend"]
    compile_started = time.perf_counter()
    advisories = _advisories(spec, task["config"])
    if isinstance(advisories, list) and advisories:  # ptxas serialised, spilled or used local memory
        return failed(task, PRUNED, "ptxas advisory: " + describe(advisories), time.perf_counter() - compile_started)
    kernel = _kernel(spec, task["config"], backend)
    compile_s = time.perf_counter() - compile_started
    if isinstance(kernel, Exception):
        first = str(kernel).strip().splitlines()[0] if str(kernel).strip() else type(kernel).__name__
        return failed(task, "compile_failed", first[:300], compile_s)
    problems = resource_problems(kernel)
    if problems:
        return failed(task, "resources", "; ".join(problems), compile_s)
    rng = np.random.default_rng(task["seed"])
    benches = [family_for(spec).bench(spec, kernel.config, (task["batch"], task["context"]), rng)
               for _ in range(ROTATE)]
    sets = [args_to_backend(b.args, backend) for b in benches]
    timer = _CudaTimer() if backend == "cuda" else _WallTimer()
    times: list[float] = []
    try:
        # Bound once, before any timing: the timed region holds the launches only (no argument
        # checks, planning or scratch allocation, which cost more than a decode kernel runs).
        calls = [kernel.bind(**args) for args in sets]
        for i in range(WARMUP):
            calls[i % ROTATE].launch()
        last = 0
        started = time.perf_counter()
        while len(times) < MAX_REPS and (not times or not _spent(task) and (
                len(times) < MIN_REPS or time.perf_counter() - started < task["measure_s"])):
            last = len(times) % ROTATE
            times.append(timer.time(calls[last].launch))
    except KgenError as e:
        return failed(task, "launch_failed", str(e).splitlines()[0][:300], compile_s)
    except Exception as e:
        if not is_device_error(e):
            raise
        # A fault on the GPU: this process's CUDA context is lost (the CUDA tuner runs each
        # measurement in a fresh process, kgen.tune.fresh).
        return failed(task, "launch_failed", f"{type(e).__name__}: {e}"[:300], compile_s)
    # Re-verify what the timed launches wrote, as the family judges it.
    check = benches[last].check({name: to_numpy(sets[last][name]) for name in benches[last].outputs})
    if not check.passed:
        return failed(task, "wrong", f"output does not match the reference: error {check.max_error:.3g} > "
                                     f"bound {check.bound:.3g} {check.note}".strip(), compile_s)
    return {"config": task["config"], "batch": task["batch"], "context": task["context"], "status": "ok",
            "reason": "", "median_s": float(np.median(times)), "min_s": float(min(times)),
            "max_s": float(max(times)), "reps": len(times), "clock": timer.clock, "compile_s": round(compile_s, 3),
            "max_error": check.max_error, "bound": check.bound}
