"""CPU backend runtime: launch kernels of a g++-built SIMT library (kgen.compile.host).

The normal path loads the library with ctypes once per artifact and calls its C shim
`kgen_launch` directly. With `sanitize=True` the library is built with ASan/UBSan and
every launch runs in a child process (an ASan library cannot be loaded into a python
that was not started with the ASan runtime preloaded).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kgen.compile.host import HostArtifact, compile_host, compiler, rebuild_host
from kgen.errors import ArgumentError, KernelRuntimeError, ToolchainError
from kgen.optional import is_torch_tensor
from kgen.runtime.base import Launch, check_kernel
from kgen.runtime.fiber_stacks import KEEPER
from kgen.runtime.race_report import SCHEDULES, describe
from kgen.settings import (
    KGEN_CXX,
    KGEN_SIMT_STACK,
    KGEN_SIMT_THREADS,
    child_environment,
)

ERR_LEN = 4096
_SCALAR_CTYPES = {
    "i1": ctypes.c_int8, "u1": ctypes.c_uint8, "i2": ctypes.c_int16, "u2": ctypes.c_uint16,
    "i4": ctypes.c_int32, "u4": ctypes.c_uint32, "i8": ctypes.c_int64, "u8": ctypes.c_uint64,
    "f4": ctypes.c_float, "f8": ctypes.c_double,
}
_CODE_NAMES = {"p": "pointer (array)", "i1": "int8", "u1": "uint8", "i2": "int16", "u2": "uint16", "i4": "int32",
               "u4": "uint32", "i8": "int64", "u8": "uint64", "f4": "float32", "f8": "float64"}


class _Library:
    """A loaded kernel library: the ctypes handle, its entry points and kernel signatures."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        if not hasattr(self.lib, "kgen_launch"):
            raise OSError(f"{path}: not a kgen kernel library (no kgen_launch)")
        f = self.lib.kgen_launch
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_char_p, *([ctypes.c_uint] * 6), ctypes.c_size_t, ctypes.c_void_p,
                      ctypes.c_char_p, ctypes.c_size_t]
        self.launch = f
        sig = self.lib.kgen_signature
        sig.restype = ctypes.c_char_p
        sig.argtypes = [ctypes.c_char_p]
        self._sig = sig
        opt = self.lib.kgen_set_options
        opt.restype = None
        opt.argtypes = [ctypes.c_uint, ctypes.c_size_t]
        self._set_options = opt
        self._options: tuple[int, int] | None = None
        sched = self.lib.kgen_set_schedule
        sched.restype = None
        sched.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self._set_schedule = sched
        self._schedule: tuple[int, int] | None = None
        keep = self.lib.kgen_keep_stacks
        keep.restype = ctypes.c_size_t
        keep.argtypes = [ctypes.c_int]
        self._keep_stacks = keep
        self.signatures: dict[str, tuple[str, ...] | None] = {}

    def set_options(self, workers: int, stack_size: int) -> None:
        if self._options != (workers, stack_size):
            self._set_options(workers, stack_size)
            self._options = (workers, stack_size)

    def set_schedule(self, schedule: int, seed: int) -> None:
        if self._schedule != (schedule, seed):
            self._set_schedule(schedule, seed)
            self._schedule = (schedule, seed)

    def keep_stacks(self, keep: int) -> int:
        """Fiber stacks between launches: keep (1), unmap (0), as they are (-1); returns the maps they
        hold. KEEPER (kgen/runtime/fiber_stacks.py) decides."""
        return self._keep_stacks(keep)

    def signature(self, kernel: str) -> tuple[str, ...] | None:
        if kernel not in self.signatures:
            raw = self._sig(kernel.encode())
            self.signatures[kernel] = None if raw is None else tuple(c for c in raw.decode().split(",") if c)
        return self.signatures[kernel]


_LIBS: dict[Path, _Library] = {}
_LIBS_LOCK = threading.Lock()


def _load(path: Path) -> _Library:
    lib = _LIBS.get(path)
    if lib is None:
        with _LIBS_LOCK:
            lib = _LIBS.get(path)
            if lib is None:
                lib = _LIBS[path] = _Library(path)
    return lib


def _load_or_rebuild(artifact: HostArtifact) -> tuple[HostArtifact, _Library]:
    """Load the artifact's library; a cached one that does not load is rebuilt once, and a fresh
    build that does not load is a ToolchainError (the compiler does not match this machine)."""
    try:
        return artifact, _load(artifact.library)
    except OSError as e:
        error = e
    if artifact.cache_hit:
        artifact = rebuild_host(artifact)
        try:
            return artifact, _load(artifact.library)
        except OSError as e:
            error = e
    raise ToolchainError(
        f"the CPU backend's kernel library {artifact.library}, just built by {compiler()}, does not load "
        f"into this Python: {error}. Check that KGEN_CXX (now {KGEN_CXX.value()!r}) names a "
        "working g++ for this machine"
    )


def _pointer(kernel: str, i: int, a: Any) -> int:
    if isinstance(a, np.ndarray):
        return a.ctypes.data  # a strided view too: the kernel takes its strides as arguments
    if is_torch_tensor(a):
        if a.device.type != "cpu":
            raise ArgumentError(f"kernel '{kernel}' argument {i}: torch tensor on {a.device}, the CPU backend needs cpu")
        if not a.is_contiguous():
            raise ArgumentError(f"kernel '{kernel}' argument {i}: torch tensor must be contiguous (.contiguous())")
        return a.data_ptr()
    if a is None:
        return 0
    if isinstance(a, int) and not isinstance(a, bool):
        return a
    raise ArgumentError(
        f"kernel '{kernel}' argument {i}: expected an array (numpy or torch CPU tensor) for a pointer parameter, "
        f"got {type(a).__name__}"
    )


def _scalar(kernel: str, i: int, code: str, a: Any) -> ctypes._SimpleCData:
    ct = _SCALAR_CTYPES[code]
    if isinstance(a, np.ndarray) and a.ndim == 0:
        a = a[()]
    if isinstance(a, np.generic):
        dt = a.dtype
        if dt.kind + str(dt.itemsize) != code and not (code[0] == "u" and dt.kind == "b" and dt.itemsize == 1):
            raise ArgumentError(
                f"kernel '{kernel}' argument {i}: the parameter is {_CODE_NAMES[code]}, got a numpy {dt} scalar"
            )
        return ct(a.item())
    if isinstance(a, bool | int | float) and not (code[0] in "iu" and isinstance(a, float)):
        if code[0] in "iu":
            bits = int(code[1]) * 8
            lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if code[0] == "i" else (0, (1 << bits) - 1)
            if not lo <= a <= hi:
                raise ArgumentError(f"kernel '{kernel}' argument {i}: {a} does not fit in {_CODE_NAMES[code]}")
        return ct(a)
    raise ArgumentError(
        f"kernel '{kernel}' argument {i}: the parameter is {_CODE_NAMES[code]}, got {type(a).__name__}"
    )


def _by_value(kernel: str, i: int, code: str, a: Any) -> ctypes.Array:
    size = int(code[1:])
    data = a.tobytes() if hasattr(a, "tobytes") else bytes(memoryview(a))
    if len(data) != size:
        raise ArgumentError(f"kernel '{kernel}' argument {i}: a {size}-byte struct parameter, got {len(data)} bytes")
    return (ctypes.c_char * size).from_buffer_copy(data)


def pack_args(kernel: str, sig: Sequence[str], args: Sequence[Any]) -> tuple[ctypes.Array, list[Any]]:
    """The cuLaunchKernel-style void** array for `args`, and the objects that must stay alive."""
    if len(args) != len(sig):
        raise ArgumentError(f"kernel '{kernel}' takes {len(sig)} arguments ({','.join(sig)}), got {len(args)}")
    holders: list[Any] = []
    for i, (code, a) in enumerate(zip(sig, args, strict=True)):
        if code == "p":
            holders.append(ctypes.c_void_p(_pointer(kernel, i, a)))
        elif code in _SCALAR_CTYPES:
            holders.append(_scalar(kernel, i, code, a))
        else:
            holders.append(_by_value(kernel, i, code, a))
    arr = (ctypes.c_void_p * max(len(holders), 1))(*[ctypes.addressof(h) for h in holders])
    return arr, holders


def _dims(v: Sequence[int] | int, what: str) -> tuple[int, int, int]:
    if type(v) is tuple and len(v) == 3 and all(type(x) is int and 0 < x <= 0xFFFFFFFF for x in v):
        return v  # type: ignore[return-value]
    t = (v,) if isinstance(v, int) else tuple(v)
    t = (*t, 1, 1)[:3] if len(t) < 3 else t
    if len(t) != 3 or any((not isinstance(x, int | np.integer)) or x < 1 or x > 0xFFFFFFFF for x in t):
        raise ArgumentError(f"{what} must be 1 to 3 positive integers, got {v!r}")
    return tuple(int(x) for x in t)  # type: ignore[return-value]


class CpuModule:
    """Kernels of one compiled artifact, launched on the CPU (implements runtime.base.Module).

    `schedule` orders a block's threads: "fifo", "reverse", "shuffle" (seeded by `seed`), or
    "mixed" (each block one of the three, from (seed, block)); None = "mixed" when the
    artifact has race detection (`race_check=True`), else "fifo".
    """

    backend = "cpu"

    def __init__(self, artifact: HostArtifact, *, workers: int = 0, stack_size: int = 0,
                 schedule: str | None = None, seed: int = 0):
        if schedule is not None and schedule not in SCHEDULES:
            raise ArgumentError(f"schedule must be one of {', '.join(SCHEDULES)} or None, got {schedule!r}")
        self.artifact = artifact
        self.workers = workers
        self.stack_size = stack_size
        self.schedule = schedule
        self.seed = seed
        self._lib = None
        if not artifact.sanitize:
            self.artifact, self._lib = _load_or_rebuild(artifact)

    @classmethod
    def from_source(cls, source: str, kernel_names: Sequence[str], *, sanitize: bool = False,
                    race_check: bool = False, extra_flags: Sequence[str] = (), **kw: Any) -> CpuModule:
        """`race_check=True`: report shared-memory races (KernelRuntimeError naming both lines)."""
        art = compile_host(source, kernel_names, sanitize=sanitize, race_check=race_check, extra_flags=extra_flags)
        return cls(art, **kw)

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return self.artifact.kernel_names

    def _check_kernel(self, kernel: str) -> None:
        check_kernel(kernel, self.artifact.kernel_names)

    def signature(self, kernel: str) -> tuple[str, ...]:
        self._check_kernel(kernel)
        if self._lib is None:
            return tuple(_sanitized_signature(self.artifact, kernel))
        sig = self._lib.signature(kernel)
        assert sig is not None
        return sig

    def _options(self) -> tuple[int, int]:
        """(worker threads, fiber stack bytes); 0 = the runtime's default."""
        return (self.workers or KGEN_SIMT_THREADS.value(),
                self.stack_size or KGEN_SIMT_STACK.value())

    def launch(self, launch: Launch) -> None:
        self.launch_many([launch])

    def launch_many(self, launches: Sequence[Launch]) -> None:
        """Run launches in order (in sanitize mode: all in one child process)."""
        for ln in launches:
            self._check_kernel(ln.kernel)
        if self._lib is None:
            _sanitized_run(self, launches)
            return
        lib = self._lib
        lib.set_options(*self._options())
        lib.set_schedule(SCHEDULES.get(self.schedule or "", 0), self.seed % (1 << 64))
        err = ctypes.create_string_buffer(ERR_LEN)
        KEEPER.before_launch(lib)
        try:
            for ln in launches:
                sig = lib.signature(ln.kernel)
                assert sig is not None
                gx, gy, gz = _dims(ln.grid, "grid")
                bx, by, bz = _dims(ln.block, "block")
                argv, _keep = pack_args(ln.kernel, sig, ln.args)
                rc = lib.launch(ln.kernel.encode(), gx, gy, gz, bx, by, bz, int(ln.smem), argv, err, ERR_LEN)
                if rc != 0:
                    raise KernelRuntimeError(describe(err.value.decode(errors="replace"), self.artifact))
        finally:
            KEEPER.after_launch(lib)


# ---- sanitize mode: launches in a child python with the ASan runtime preloaded ----

def asan_runtime() -> str:
    cxx = compiler()
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False)
    path = out.stdout.strip()
    if out.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        raise ToolchainError(f"{cxx} has no AddressSanitizer runtime (libasan.so); install it or use sanitize=False")
    return os.path.realpath(path)


def _child_env() -> dict[str, str]:
    env = child_environment()
    env["LD_PRELOAD"] = asan_runtime()
    env["ASAN_OPTIONS"] = ("detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=66:"
                           "detect_stack_use_after_return=0:allocator_may_return_null=1:print_legend=0")
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=67"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _as_numpy(a: Any) -> Any:
    if is_torch_tensor(a):
        return a.detach().numpy()
    return a


def _shipped(a: Any) -> Any:
    """An argument as the sanitizer's child receives it: a strided view travels as the bytes of its
    whole base buffer and its offset there, so its strides hold in the child's copy too."""
    a = _as_numpy(a)
    if isinstance(a, np.ndarray) and not a.flags.c_contiguous:
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        if owner.flags.c_contiguous:
            return {"base": owner.reshape(-1).view(np.uint8), "offset": a.ctypes.data - owner.ctypes.data}
    return a


def _run_child(job: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="kgen-asan-") as d:
        jp, rp = Path(d) / "job.pkl", Path(d) / "result.pkl"
        job["result"] = str(rp)
        jp.write_bytes(pickle.dumps(job, protocol=5))
        proc = subprocess.run([sys.executable, "-m", "kgen.runtime._sanitized_launch", str(jp)],
                              env=_child_env(), capture_output=True, text=True, timeout=3600)
        result = pickle.loads(rp.read_bytes()) if rp.exists() else None
        if proc.returncode != 0 or result is None:
            result = {"error": proc.stderr, "rc": proc.returncode, "crashed": True, "kernel": None,
                      **(result or {})}
        return result


def _sanitized_signature(artifact: HostArtifact, kernel: str) -> list[str]:
    res = _run_child({"library": str(artifact.library), "signature": kernel, "launches": []})
    if res.get("crashed"):
        raise KernelRuntimeError(f"sanitized child failed: {res['error'][-2000:]}")
    return res["signature"]


def _sanitizer_report(text: str, max_lines: int = 25) -> str:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines)
                  if "ERROR: AddressSanitizer" in ln or "runtime error:" in ln or "ERROR: UndefinedBehavior" in ln), 0)
    return "\n".join(lines[start:start + max_lines])


def _sanitized_run(mod: CpuModule, launches: Sequence[Launch]) -> None:
    job_launches = []
    for ln in launches:
        job_launches.append({"kernel": ln.kernel, "grid": _dims(ln.grid, "grid"), "block": _dims(ln.block, "block"),
                             "smem": int(ln.smem), "args": [_shipped(a) for a in ln.args]})
    workers, stack_size = mod._options()
    res = _run_child({"library": str(mod.artifact.library), "launches": job_launches,
                      "workers": workers, "stack_size": stack_size})
    # copy results back into the caller's arrays (even after a failure: what ran, ran)
    for job, outs in zip(job_launches, res.get("arrays", []), strict=False):
        for a, new in zip(job["args"], outs, strict=False):
            if new is not None:
                np.copyto(a["base"] if isinstance(a, dict) else a, new, casting="no")
    if res.get("crashed") or res.get("error"):
        kernel = res.get("kernel") or (launches[res.get("index", 0)].kernel if launches else "?")
        text = res.get("error") or ""
        if "AddressSanitizer" in text or "runtime error:" in text:
            raise KernelRuntimeError(f"kernel '{kernel}': sanitizer report (ASan/UBSan):\n{_sanitizer_report(text)}")
        if res.get("crashed"):
            raise KernelRuntimeError(f"kernel '{kernel}': sanitized run crashed (exit {res.get('rc')}):\n"
                                     + "\n".join(text.strip().splitlines()[-25:]))
        raise KernelRuntimeError(text)
