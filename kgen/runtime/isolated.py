"""Untrusted kernels run in a child process: a crash, an abort or a hang is a KernelRuntimeError that
names the signal or the timeout, never a dead or hung caller (docs/verification.md).

`Child` is the process mechanics shared by both backends: one long-lived child per module,
serving launch requests over a Unix socket (kgen.runtime._wire), restarted after a crash. It
starts with an empty environment, in a fresh scratch directory (removed when it ends), in its own
process group (a hang is ended by killing the whole group), with no descriptor but /dev/null,
its stderr file and the socket. `IsolatedCpuModule` is the CPU backend on top of it: arrays are
shared through memfds (kgen.runtime.shared), mapped in the child at the addresses they have here,
so the child writes the caller's arrays directly and addresses inside pointer tables hold.

Limits of one launch (`Limits`):
  wall time  = scale * (floor_s + grid_threads * thread_s + data_bytes * byte_s)
               grid_threads = blocks * threads per block; data_bytes = the committed bytes of the
               arrays it receives (a sparse pool counts only its touched pages). The defaults,
               15 s + 1 ms per thread + 200 ns per byte (5 MB/s), leave a wide margin over
               what the CPU backend needs on a loaded 2-core machine (about 100 MB/s).
               On an oversubscribed machine (1-minute load average above the CPU count) the wall
               limit of a CPU launch is stretched by load / CPUs, at most MAX_LOAD_STRETCH times
               (load_stretch): a correct kernel that gets a fraction of a core is not killed for it.
  CPU time   = RLIMIT_CPU, wall time (unstretched) * workers + 1 s from the launch on (SIGXCPU
               past it): the limit that still holds if the parent stops watching.
  memory     = RLIMIT_AS, the child's address space with the arrays mapped + memory_bytes + per
               worker thread 136 MiB (thread stack, malloc arena) and its fiber stacks. A kernel that
               asks for more gets NULL from malloc or std::bad_alloc.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kgen.compile.host import HostArtifact
from kgen.errors import ArgumentError, KernelRuntimeError
from kgen.runtime import _wire
from kgen.runtime.base import Launch, check_kernel
from kgen.runtime.cpu import _SCALAR_CTYPES, _as_numpy, _by_value, _dims, _scalar
from kgen.runtime.race_report import describe
from kgen.runtime.shared import SharedBuffer, Staging
from kgen.settings import KGEN_SIMT_STACK, KGEN_SIMT_THREADS

MiB, GiB = 1 << 20, 1 << 30
CPU_CHILD = Path(__file__).with_name("_isolated_child.py")
DEFAULT_FIBER_STACK = 64 * 1024  # the SIMT runtime's default (templates/simt/kgen_simt_launch.h)
PER_WORKER_BYTES = 136 * MiB  # an OS thread's stack (8 MiB) and its malloc arena (up to 128 MiB reserved)
STDERR_NAME = "stderr.txt"
_SIGNATURE = re.compile(r"((p|[iu][1248]|f[48]|b\d{1,4})(,(p|[iu][1248]|f[48]|b\d{1,4}))*)?\Z")
_SIGNAL_MEANING = {
    "SIGSEGV": "invalid memory access", "SIGBUS": "bus error: misaligned or unbacked memory access",
    "SIGABRT": "aborted", "SIGFPE": "arithmetic exception, e.g. integer division by zero",
    "SIGILL": "illegal instruction", "SIGKILL": "killed", "SIGXCPU": "CPU-time limit exceeded",
    "SIGXFSZ": "file-size limit exceeded", "SIGTRAP": "trap",
}


MAX_LOAD_STRETCH = 8.0


def load_stretch() -> float:
    """How much longer than on an idle machine a launch may take here: the 1-minute load average
    per CPU, between 1 and MAX_LOAD_STRETCH (1 where the OS gives no load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, min(MAX_LOAD_STRETCH, load / (os.cpu_count() or 1)))


@dataclass(frozen=True)
class Limits:
    """The limits of one launch in the child (formulas in the module docstring)."""

    # Generous on purpose: a correct kernel must never be killed. A straightforward hand-written
    # kernel under race detection on a loaded 2-core machine streams ~10 MB/s of KV (the 32K-token
    # case: ~64-128 MB); a hang costs one limit, once (the runner stops at the first verdict).
    floor_s: float = 15.0
    thread_s: float = 1e-3
    byte_s: float = 200e-9
    scale: float = 1.0
    memory_bytes: int = 2 * GiB
    startup_s: float = 60.0

    def wall_seconds(self, grid: Sequence[int], block: Sequence[int], data_bytes: int) -> float:
        threads = math.prod(grid) * math.prod(block)
        return self.scale * (self.floor_s + threads * self.thread_s + data_bytes * self.byte_s)

    def memory_headroom(self, workers: int, threads_per_block: int, fiber_stack: int) -> int:
        page = os.sysconf("SC_PAGE_SIZE")
        return self.memory_bytes + workers * (PER_WORKER_BYTES + threads_per_block * (fiber_stack + page))


def describe_exit(returncode: int) -> str:
    """'SIGSEGV (invalid memory access)' or 'exit status 3'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        meaning = _SIGNAL_MEANING.get(name)
        return f"{name} ({meaning})" if meaning else name
    return f"exit status {returncode}"


def _printable(text: str, limit: int = 2000) -> str:
    text = "".join(c if c.isprintable() or c == "\n" else "?" for c in text)
    return text[-limit:].strip()


def _remove_tree(path: str) -> None:
    """Remove a scratch directory, whatever permissions the child left on its folders (a symlink
    is never followed: rmtree does not, and only real directories are chmod'ed)."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for root, dirs, _files in os.walk(path):
        for d in dirs:
            full = os.path.join(root, d)
            if not os.path.islink(full):
                with contextlib.suppress(OSError):
                    os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)


class _State:
    """What `Child`'s finalizer needs (it must not hold the Child)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.scratch: str | None = None


def _stop(state: _State) -> None:
    proc, sock, scratch = state.proc, state.sock, state.scratch
    state.proc = state.sock = state.scratch = None
    if sock is not None:
        sock.close()
    if proc is not None:
        # Not reaped yet, so its pid still names the group: nothing of the group outlives it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if scratch is not None:
        _remove_tree(scratch)


_START_HINT = (" (the isolated process did not start: this is the environment, not the kernel; it runs this "
               "Python with -I, an empty environment but LD_LIBRARY_PATH, and this process's import path)")


class Child:
    """A child process running `script` (kgen.runtime._isolated_child or its CUDA twin) that serves
    requests over a socket; the argv is [python, *python_flags, script, SOCKET_FD, *args]."""

    def __init__(self, script: Path, args: Sequence[str], python_flags: Sequence[str] = ("-I", "-S", "-B"),
                 startup_s: float = 60.0, env: dict[str, str] | None = None,
                 start_failure: type[Exception] = KernelRuntimeError):
        self.script = script
        self.args = list(args)
        self.python_flags = list(python_flags)
        self.startup_s = startup_s
        self.env = dict(env or {})  # the child's whole environment (empty by default)
        # What a child that does not start raises: the CUDA child starts before any kernel code runs,
        # so its failure is the environment's (a ToolchainError), not the kernel's verdict.
        self.start_failure = start_failure
        self.hello: dict | None = None  # the child's first message
        self._state = _State()
        weakref.finalize(self, _stop, self._state)

    @property
    def pid(self) -> int | None:
        return self._state.proc.pid if self._state.proc is not None else None

    @property
    def scratch(self) -> str | None:
        return self._state.scratch

    def start(self, what: str) -> dict:
        """Start the child if it is not running; its hello message (a KernelRuntimeError if it dies first)."""
        if self._state.proc is not None:
            assert self.hello is not None
            return self.hello
        scratch = tempfile.mkdtemp(prefix="kgen-isolated-")
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with open(os.path.join(scratch, STDERR_NAME), "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, *self.python_flags, str(self.script), str(child.fileno()), *self.args],
                    env=self.env, cwd=scratch, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    pass_fds=(child.fileno(),), close_fds=True, start_new_session=True,
                )
        except BaseException:
            parent.close()
            _remove_tree(scratch)
            raise
        finally:
            child.close()
        self._state.proc, self._state.sock, self._state.scratch = proc, parent, scratch
        try:
            hello = self._receive(self.startup_s, f"{what}: starting its isolated process")
        except KernelRuntimeError as e:
            if self.start_failure is KernelRuntimeError:
                raise
            raise self.start_failure(f"{e}{_START_HINT}") from None
        if "error" in hello:
            self.stop()
            message = f"{what}: {_printable(str(hello['error']))}"
            raise self.start_failure(message + (_START_HINT if self.start_failure is not KernelRuntimeError else ""))
        self.hello = hello
        return hello

    def request(self, message: dict, fds: Sequence[int], timeout_s: float, what: str,
                limits_note: str = "") -> dict:
        """Send one request and wait for its reply; KernelRuntimeError if the child dies, hangs past
        `timeout_s` (it is killed) or answers nonsense."""
        sock = self._state.sock
        assert sock is not None, "start() first"
        try:
            _wire.send(sock, message, fds)
        except OSError:
            pass  # it died already: _receive reports how
        return self._receive(timeout_s, what, limits_note)

    def _receive(self, timeout_s: float, what: str, limits_note: str = "") -> dict:
        sock, proc = self._state.sock, self._state.proc
        assert sock is not None and proc is not None
        start = time.monotonic()
        try:
            return _wire.recv(sock, deadline=start + timeout_s)
        except TimeoutError:
            self.stop()
            raise KernelRuntimeError(
                f"{what} timed out after {timeout_s:.1f} s and was killed{limits_note}") from None
        except (_wire.WireError, OSError) as e:
            code = self._exit_status(max(0.5, timeout_s - (time.monotonic() - start)))
            tail = self._stderr_tail()
            self.stop()
            if code is None:
                raise KernelRuntimeError(f"{what}: its isolated process broke the protocol ({e}) and was "
                                         "killed") from None
            raise KernelRuntimeError(self._crash_message(what, code, tail, limits_note)) from None

    def _exit_status(self, wait_s: float) -> int | None:
        """The exit status (negative: signal) of a child that closed its socket, without reaping it (so
        its process group id stays reserved until stop() has killed the group); None if it lives on."""
        proc = self._state.proc
        assert proc is not None
        deadline = time.monotonic() + min(wait_s, 10.0)
        while True:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == proc.pid:
                if info.si_code == os.CLD_EXITED:
                    return info.si_status
                return -info.si_status
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def _stderr_tail(self, limit: int = 4096) -> str:
        path = os.path.join(self._state.scratch or "", STDERR_NAME)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
                return _printable(f.read().decode("utf-8", "replace"))
        except OSError:
            return ""

    @staticmethod
    def _crash_message(what: str, code: int, tail: str, limits_note: str) -> str:
        msg = f"{what} crashed its isolated process: {describe_exit(code)}"
        if "bad_alloc" in tail or "Cannot allocate memory" in tail:
            msg += " - out of memory"
        msg += limits_note  # a NULL from a refused malloc shows up as SIGSEGV: the limits help tell
        if tail:
            msg += "\nits stderr ends with:\n" + tail
        return msg

    def stop(self) -> None:
        """End the child (its whole process group) and remove its scratch directory."""
        self.hello = None
        _stop(self._state)


def _as_pointer_arg(a: Any) -> Any:
    a = _as_numpy(a)
    return int(a) if isinstance(a, np.integer) else a


class ChildModule:
    """What the isolated modules (IsolatedCpuModule, kgen.runtime.cuda.IsolatedCudaModule) share: the
    child that runs their launches and the lock that serialises its requests; `close()` ends the child."""

    isolated = True

    def __init__(self, child: Child):
        self._child = child
        self._lock = threading.Lock()

    @property
    def child(self) -> Child:
        return self._child

    def close(self) -> None:
        with self._lock:
            self._child.stop()


class IsolatedCpuModule(ChildModule):
    """Kernels of one compiled CPU artifact, each launch run in a child process with limits
    (implements runtime.base.Module). `close()` ends the child; so does garbage collection."""

    backend = "cpu"

    def __init__(self, artifact: HostArtifact, *, workers: int = 0, stack_size: int = 0,
                 limits: Limits | None = None):
        if artifact.sanitize:
            raise ValueError("IsolatedCpuModule: a sanitized artifact runs in CpuModule's own child process")
        self.artifact = artifact
        self.limits = limits or Limits()
        self.workers = workers or KGEN_SIMT_THREADS.value() or len(os.sched_getaffinity(0))
        self.stack_size = stack_size or KGEN_SIMT_STACK.value()
        super().__init__(Child(CPU_CHILD, [str(artifact.library), ",".join(artifact.kernel_names), str(self.workers),
                                           str(self.stack_size)], startup_s=self.limits.startup_s))

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return self.artifact.kernel_names

    def _signature(self, kernel: str) -> tuple[str, ...]:
        hello = self._child.start(f"kernel library {self.artifact.library.parent.name}")
        sigs = hello.get("signatures")
        raw = sigs.get(kernel) if isinstance(sigs, dict) else None
        if not isinstance(raw, str) or not _SIGNATURE.match(raw):
            self._child.stop()
            raise KernelRuntimeError(f"kernel '{kernel}': its isolated process reports no valid signature ({raw!r})")
        return tuple(c for c in raw.split(",") if c)

    def signature(self, kernel: str) -> tuple[str, ...]:
        check_kernel(kernel, self.kernel_names)
        with self._lock:
            return self._signature(kernel)

    def launch(self, launch: Launch) -> None:
        self.launch_many([launch])

    def launch_many(self, launches: Sequence[Launch]) -> None:
        """Run launches in order; arrays not in shared memory are staged once for the whole batch."""
        for ln in launches:
            check_kernel(ln.kernel, self.kernel_names)
        with self._lock:
            sigs = [self._signature(ln.kernel) for ln in launches]
            arrays = [a for ln, sig in zip(launches, sigs, strict=True)
                      for code, a in zip(sig, map(_as_pointer_arg, ln.args), strict=False)
                      if code == "p" and isinstance(a, np.ndarray)]
            arrays += [a for ln in launches for a in map(_as_pointer_arg, ln.reached) if isinstance(a, np.ndarray)]
            staging = Staging(arrays)
            try:
                for ln, sig in zip(launches, sigs, strict=True):
                    self._run(ln, sig, staging)
            except BaseException:
                with contextlib.suppress(KernelRuntimeError):
                    staging.finish()
                raise
            staging.finish()

    def _run(self, ln: Launch, sig: tuple[str, ...], staging: Staging) -> None:
        if len(ln.args) != len(sig):
            raise ArgumentError(f"kernel '{ln.kernel}' takes {len(sig)} arguments ({','.join(sig)}), "
                                f"got {len(ln.args)}")
        buffers: list[SharedBuffer] = []
        args: list[list] = []
        for i, (code, a) in enumerate(zip(sig, ln.args, strict=True)):
            if code == "p":
                args.append(self._pointer(ln.kernel, i, _as_pointer_arg(a), staging, buffers))
            elif code in _SCALAR_CTYPES:
                args.append(["v", bytes(_scalar(ln.kernel, i, code, a)).hex()])
            else:
                args.append(["v", bytes(_by_value(ln.kernel, i, code, a)).hex()])
        for a in map(_as_pointer_arg, ln.reached):
            self._pointer(ln.kernel, -1, a, staging, buffers)
        grid, block = _dims(ln.grid, "grid"), _dims(ln.block, "block")
        base = self.limits.wall_seconds(grid, block, sum(b.committed_bytes() for b in buffers))
        timeout = base * load_stretch()  # wall time stretches on an oversubscribed machine; CPU time does not
        threads = math.prod(block)
        memory = self.limits.memory_headroom(self.workers, threads, self.stack_size or DEFAULT_FIBER_STACK)
        request = {"op": "launch", "kernel": ln.kernel, "grid": grid, "block": block, "smem": int(ln.smem),
                   "args": args, "sizes": [len(b) for b in buffers], "homes": [b.home for b in buffers],
                   "cpu_seconds": math.ceil(base * self.workers) + 1, "memory_bytes": memory}
        note = f" (limits: {timeout:.1f} s, {memory / GiB:.1f} GiB of memory beyond its arrays)"
        what = f"kernel '{ln.kernel}'"
        # The arrays go to the addresses they have here; should the child's own mappings sit there,
        # a fresh child (another random layout) usually fits them, else they are mapped anywhere.
        for fixed in (True, True, False):
            if not fixed and ln.reached:
                raise KernelRuntimeError(f"{what}: its isolated process cannot map the arrays of its pointer "
                                         "table at this process's addresses")
            reply = self._child.request({**request, "fixed": fixed}, [b.fd for b in buffers], timeout, what, note)
            if not reply.get("collision"):
                break
            self._child.stop()
            self._child.start(what)
        if "ok" not in reply:
            # the runtime names code by library offsets (a race report): turn them into file:line
            raise KernelRuntimeError(describe(_printable(str(reply.get("error", reply)), 4000), self.artifact))

    @staticmethod
    def _pointer(kernel: str, i: int, a: Any, staging: Staging, buffers: list[SharedBuffer]) -> list:
        """["p", buffer index, offset] for a pointer argument (i < 0: an array of Launch.reached)."""
        if a is None or (isinstance(a, int) and not isinstance(a, bool) and a == 0):
            return ["null"]
        if not isinstance(a, np.ndarray) and (not isinstance(a, int) or isinstance(a, bool)):
            raise ArgumentError(f"kernel '{kernel}' argument {i}: expected an array (numpy or torch CPU tensor) for "
                                f"a pointer parameter, got {type(a).__name__}")
        buf, offset = staging.place(a, f"kernel '{kernel}' argument {i}")
        index = next((j for j, b in enumerate(buffers) if b is buf), None)
        if index is None:
            buffers.append(buf)
            index = len(buffers) - 1
        return ["p", index, offset]
