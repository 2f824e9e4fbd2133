"""One measurement in a fresh process (the CUDA backend's tuning): a config whose kernel faults
leaves a lost CUDA context behind, and one that hangs never returns; in a process of its own
either is a failed measurement and the tuning run goes on in a clean one.

The process is spawned, never forked (a forked CUDA context is unusable), runs
kgen.tune.measure.run_task and sends its result back; past `timeout_s` it is killed.
"""

from __future__ import annotations

import multiprocessing
import time

from kgen.tune.measure import failed, run_task

TIMEOUT = "timeout"
COMPILE_ALLOWANCE_S = 120.0  # NVRTC and the process's start-up (CuPy, kgen) before the first launch


def time_limit(task: dict) -> float:
    """Seconds a measurement may take: its start-up and compile, its timing, a margin."""
    return COMPILE_ALLOWANCE_S + 4.0 * float(task["measure_s"]) + 10.0


def run_in_fresh_process(task: dict, timeout_s: float | None = None) -> dict:
    """run_task(task) in a spawned process: its result; a failed result (status "launch_failed")
    when the process ends without one (a crash) or reports an error of its own, and status
    "timeout" when it is still running after `timeout_s` (default: time_limit(task))."""
    limit = time_limit(task) if timeout_s is None else float(timeout_s)
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(task, send), daemon=True)
    started = time.perf_counter()
    child.start()
    send.close()
    try:
        if receive.poll(limit):
            try:
                return receive.recv()
            except EOFError:  # the process died without an answer
                child.join(5)
                return failed(task, "launch_failed", f"the measurement's process ended without a result "
                                                     f"(exit code {child.exitcode})")
        return failed(task, TIMEOUT, f"killed after {time.perf_counter() - started:.0f} s (limit {limit:.0f} s): "
                                     "the kernel or its compile did not finish")
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()


def _child(task: dict, send) -> None:
    try:
        result = run_task(task)
    except BaseException as e:  # noqa: BLE001 - a CUDA error (a fault, a lost context) is this config's verdict
        result = failed(task, "launch_failed", f"{type(e).__name__}: {e}"[:300])
    send.send(result)
    send.close()
