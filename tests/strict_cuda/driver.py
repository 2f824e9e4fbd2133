"""The state a CUDA driver keeps for one process, held to the rules a real driver enforces.

Written from the CUDA Programming Guide, the driver API reference (cuLaunchKernel,
cuFuncSetAttribute, stream and event semantics) and CuPy's documented behaviour; it is a model
of an outside component, so where it may differ from a real driver is said where the rule is.

- Memory: every allocation is a host buffer whose address *is* the device address (so kernel
  bodies run on kgen's CPU backend read and write it), owned by one device. A launch argument
  that points anywhere else (or into a freed allocation, or another device's) is an illegal
  address: a sticky error, after which every call fails, as a real context does.
- Streams: ordering is tracked with vector clocks. Every operation on a stream ticks its clock;
  an event carries the clock it was recorded at; `wait_event` merges it; a host synchronisation
  (stream, event, device, a blocking copy) makes everything it waited for visible to all work
  issued afterwards; the legacy default stream orders itself with every blocking stream (not
  with non-blocking ones: the streams torch and `Stream(non_blocking=True)` make). A read of
  memory last written on another stream, or a write of memory another stream last read or
  wrote, without such an order is a race and is reported.
- Frees: CuPy's pool hands a freed block back to the stream that allocated it at once; memory
  freed while work on another stream that uses it is not known to be complete is reported.
- Graph capture (the Programming Guide's "CUDA Graphs: stream capture"): a launch on a capturing
  stream is recorded with its argument values, not run; replaying the graph runs the recorded
  launches (their pointers checked then, so memory freed since the capture faults). While a capture
  is in progress, a host synchronisation with the capturing stream or the device, and any use of
  the legacy stream, is refused (cudaErrorStreamCaptureUnsupported) and invalidates the capture; in
  the global and thread-local modes (torch.cuda.graph's default is global) so is cudaMalloc, in
  the relaxed mode (CuPy's default) it is allowed. Only kernel launches are captured: any other
  operation on a capturing stream (CuPy array operations, copies) is reported as outside the model.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import numpy as np

LEGACY = 0  # the handle of the legacy default stream
ALIGN = 256  # cudaMalloc's alignment


class CUDARuntimeError(RuntimeError):
    """What CuPy raises for a failed runtime call (cupy_backends.cuda.api.runtime.CUDARuntimeError)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name


class ModelViolation(AssertionError):
    """kgen did something a real driver or CuPy would refuse, fault on, or race on."""


@dataclass
class Limits:
    """sm_90 (H100/H200): CUDA Programming Guide, Table "Technical Specifications per Compute Capability"."""

    compute_capability: str = "90"
    sm_count: int = 132
    max_threads_per_block: int = 1024
    max_block: tuple[int, int, int] = (1024, 1024, 64)
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    smem_default: int = 48 * 1024  # static + dynamic without the opt-in
    smem_optin: int = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    l2_bytes: int = 50 * 1024 * 1024


@dataclass
class Allocation:
    base: int
    size: int
    device: int
    stream: int  # the stream CuPy's pool allocated it on
    buffer: np.ndarray  # the host bytes behind it
    live: bool = True
    last_write: tuple[int, int] | None = None  # (stream, clock)
    reads: dict[int, int] = field(default_factory=dict)  # stream -> clock of its last read


@dataclass
class StreamState:
    handle: int
    device: int
    non_blocking: bool
    clock: dict[int, int] = field(default_factory=dict)  # vector clock: stream -> tick


@dataclass
class Capture:
    stream: int
    mode: str  # "global" | "thread_local" | "relaxed"
    nodes: list = field(default_factory=list)  # what a replay runs, in order
    invalidated: str | None = None


CAPTURE_MODES = {0: "global", 1: "thread_local", 2: "relaxed"}  # cudaStreamCaptureMode's values


@dataclass
class LaunchRecord:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    stream: int
    device: int


class Driver:
    """One process's view of the GPUs: devices, allocations, streams, the sticky error, and what
    kgen asked of it (launches, syncs, allocations), for tests to read."""

    def __init__(self, device_count: int = 1, limits: Limits | None = None):
        self.device_count = device_count
        self.limits = limits or Limits()
        self.current_device = 0
        self._lock = threading.RLock()
        self.allocations: dict[int, Allocation] = {}
        self.streams: dict[int, StreamState] = {}
        self._next_stream = 0x1000
        self.host_clock: dict[int, int] = {}  # what the host has waited for
        self.sticky: CUDARuntimeError | None = None
        self.violations: list[str] = []
        self.launches: list[LaunchRecord] = []
        self.syncs: list[str] = []
        self.log: list[tuple] = []  # every operation in issue order: (kind, stream, detail)
        self.allocated_bytes = 0  # live, as the pool's users see them
        self.peak_bytes = 0
        self.pool_cached_bytes = 0  # freed into CuPy's pool, not yet returned
        self.captures: dict[int, Capture] = {}  # capturing stream -> its capture
        for d in range(device_count):
            self.streams[self._legacy(d)] = StreamState(self._legacy(d), d, non_blocking=False)

    @staticmethod
    def _legacy(device: int) -> int:
        return LEGACY if device == 0 else -device  # one legacy stream per device

    def legacy_stream(self, device: int | None = None) -> int:
        return self._legacy(self.current_device if device is None else device)

    # ---- errors ------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.sticky is not None:
            raise self.sticky

    def fault(self, message: str) -> CUDARuntimeError:
        """A device-side fault: the context is dead from now on (cudaErrorIllegalAddress is sticky)."""
        self.sticky = CUDARuntimeError("cudaErrorIllegalAddress", f"an illegal memory access was encountered ({message})")
        self.violations.append(f"illegal address: {message}")
        return self.sticky

    def violate(self, message: str) -> None:
        self.violations.append(message)

    # ---- memory ------------------------------------------------------------------------------
    def malloc(self, size: int, stream: int) -> Allocation:
        self.check_alive()
        strict = [c for c in self.captures.values() if c.mode != "relaxed"]
        if strict:
            self.refuse_during_capture(f"cudaMalloc of {size} bytes", strict)
        with self._lock:
            buf = np.zeros(size + ALIGN, np.uint8)
            base = (buf.ctypes.data + ALIGN - 1) // ALIGN * ALIGN
            buf = buf[base - buf.ctypes.data:][:size]
            alloc = Allocation(base, size, self.current_device, stream, buf)
            self.allocations[base] = alloc
            self.allocated_bytes += size
            self.log.append(("malloc", stream, size))
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            return alloc

    def free(self, alloc: Allocation) -> None:
        """CuPy's pool takes the block back for its allocating stream at once (no sync)."""
        with self._lock:
            if not alloc.live:
                return
            alloc.live = False
            self.allocated_bytes -= alloc.size
            self.pool_cached_bytes += alloc.size
            owner = self._seen_by(alloc.stream)
            users = ([alloc.last_write] if alloc.last_write else []) + list(alloc.reads.items())
            for stream, tick in users:
                if stream != alloc.stream and owner.get(stream, 0) < tick:
                    self.violate(f"{alloc.size}-byte allocation 0x{alloc.base:x} freed (back to stream "
                                 f"{alloc.stream:#x}'s pool) while stream {stream:#x} may still use it")
                    break

    def release_pool(self) -> None:
        self.pool_cached_bytes = 0

    def find(self, ptr: int) -> Allocation | None:
        for alloc in self.allocations.values():
            if alloc.live and alloc.base <= ptr < alloc.base + max(alloc.size, 1):
                return alloc
        return None

    def host_bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)) if nbytes else np.zeros(0, np.uint8)

    # ---- graph capture -----------------------------------------------------------------------
    def begin_capture(self, stream: int, mode: str) -> None:
        self.check_alive()
        if stream == self._legacy(self.streams[stream].device):
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "the legacy stream cannot be captured")
        if stream in self.captures:
            raise CUDARuntimeError("cudaErrorIllegalState", f"stream {stream:#x} is already capturing")
        self.captures[stream] = Capture(stream, mode)
        self.log.append(("begin_capture", stream, mode))

    def end_capture(self, stream: int) -> Capture:
        capture = self.captures.pop(stream, None)
        if capture is None:
            raise CUDARuntimeError("cudaErrorIllegalState", f"stream {stream:#x} is not capturing")
        self.log.append(("end_capture", stream, len(capture.nodes)))
        if capture.invalidated:
            raise CUDARuntimeError("cudaErrorStreamCaptureInvalidated", f"the capture on stream {stream:#x} was "
                                   f"invalidated by {capture.invalidated}")
        return capture

    def refuse_during_capture(self, what: str, captures: list[Capture] | None = None) -> None:
        """An operation CUDA forbids while these captures (default: all) are in progress: the captures
        are invalidated and the call fails."""
        for capture in self.captures.values() if captures is None else captures:
            capture.invalidated = capture.invalidated or what
        self.violations.append(f"{what} during stream capture")
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", f"operation not permitted when stream is "
                               f"capturing ({what})")

    # ---- streams -----------------------------------------------------------------------------
    def new_stream(self, non_blocking: bool, handle: int | None = None) -> int:
        with self._lock:
            if handle is None:
                handle = self._next_stream
                self._next_stream += 0x10
            if handle not in self.streams:
                self.streams[handle] = StreamState(handle, self.current_device, non_blocking)
            return handle

    def _seen_by(self, stream: int) -> dict[int, int]:
        """Stream `stream`'s clock merged with what the host has waited for (work it issues next)."""
        s = self.streams[stream]
        merged = dict(s.clock)
        for k, v in self.host_clock.items():
            merged[k] = max(merged.get(k, 0), v)
        legacy = self._legacy(s.device)
        if stream == legacy:  # the legacy stream waits for every blocking stream's work ...
            implicit = [o for o in self.streams.values() if o.device == s.device and not o.non_blocking]
        elif not s.non_blocking:  # ... and a blocking stream for the legacy stream's
            implicit = [self.streams[legacy]]
        else:
            implicit = []
        for other in implicit:
            if other.handle != stream:
                merged[other.handle] = max(merged.get(other.handle, 0), other.clock.get(other.handle, 0))
        return merged

    def tick(self, stream: int) -> int:
        s = self.streams[stream]
        if self.captures and stream == self._legacy(s.device):
            self.refuse_during_capture(f"use of the legacy stream {stream:#x}")
        if stream in self.captures:
            self.violations.append(f"an operation other than a kernel launch on capturing stream {stream:#x} "
                                   "(the model captures launches only)")
        s.clock = self._seen_by(stream)
        s.clock[stream] = s.clock.get(stream, 0) + 1
        return s.clock[stream]

    def access(self, alloc: Allocation, stream: int, write: bool, what: str) -> None:
        """Check `stream`'s access to `alloc` against the last uses on other streams, then record it."""
        seen = self.streams[stream].clock
        w = alloc.last_write
        if w and w[0] != stream and seen.get(w[0], 0) < w[1]:
            self.violate(f"{what}: {'writes' if write else 'reads'} memory 0x{alloc.base:x} written on stream "
                         f"{w[0]:#x} with no event or sync between (stream {stream:#x})")
        if write:
            for other, tick in alloc.reads.items():
                if other != stream and seen.get(other, 0) < tick:
                    self.violate(f"{what}: writes memory 0x{alloc.base:x} that stream {other:#x} reads, with no "
                                 f"event or sync between (stream {stream:#x})")
                    break
            alloc.last_write = (stream, seen[stream])
            alloc.reads = {}
        else:
            alloc.reads[stream] = seen[stream]

    def record_event(self, stream: int) -> dict[int, int]:
        self.check_alive()
        return dict(self.streams[stream].clock)

    def wait_event(self, stream: int, clock: dict[int, int]) -> None:
        s = self.streams[stream]
        for k, v in clock.items():
            s.clock[k] = max(s.clock.get(k, 0), v)

    def host_wait(self, clock: dict[int, int], what: str, waits_on: int | None = None,
                  device_wide: bool = False) -> None:
        """The host blocks until the work in `clock` is done (`waits_on`: the stream whose work it is,
        if one; `device_wide`: all of the device's)."""
        self.check_alive()
        if self.captures and (device_wide or waits_on in self.captures):
            self.refuse_during_capture(what)
        self.syncs.append(what)
        self.log.append(("sync", None, what))
        for k, v in clock.items():
            self.host_clock[k] = max(self.host_clock.get(k, 0), v)

    def synchronize_stream(self, stream: int, what: str) -> None:
        self.host_wait(self.record_event(stream), what, waits_on=stream)

    def synchronize_device(self, what: str = "deviceSynchronize") -> None:
        self.check_alive()
        merged: dict[int, int] = {}
        for s in self.streams.values():
            if s.device == self.current_device:
                merged[s.handle] = s.clock.get(s.handle, 0)
        self.host_wait(merged, what, device_wide=True)
