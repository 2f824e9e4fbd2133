"""The isolated runtime (kgen.runtime.isolated): launches run in a child process with an empty
environment, a scratch directory and limits; a crash, an abort, a hang or a refused allocation is a
KernelRuntimeError naming the signal or the timeout, and the module keeps working afterwards.
Arrays reach the child through shared memory: strides, aliasing and bytes around a view survive,
and a sparse pool past 2^31 elements costs only its touched pages."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from kgen.compile.host import compile_host
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import ArgumentError, KernelRuntimeError
from kgen.runtime import _wire, isolated, shared
from kgen.runtime.base import DeviceAddress, Launch
from kgen.runtime.cpu import CpuModule
from kgen.runtime.cuda import IsolatedCudaModule, device_arch, encode_cuda_args
from kgen.runtime.isolated import (
    CPU_CHILD,
    Child,
    IsolatedCpuModule,
    Limits,
    describe_exit,
)

SRC = r"""
extern char** environ;
extern "C" __global__ void add(float* out, const float* x, int n, float c) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + c;
}
extern "C" __global__ void strided_copy(float* out, long long os, const float* x, long long xs, int n) {
  int i = threadIdx.x;
  if (i < n) out[i * os] = x[i * xs];
}
extern "C" __global__ void write_past(float* out, int n) { if (threadIdx.x == 0) out[n] = 42.0f; }
extern "C" __global__ void alias(float* a, const float* b) {
  if (threadIdx.x == 0) { a[0] = 5.0f; a[1] = b[0] + 1.0f; }
}
extern "C" __global__ void pool_sum(float* out, const __half* pool, long long start, int n) {
  if (threadIdx.x == 0) { float s = 0.f; for (int i = 0; i < n; ++i) s += __half2float(pool[start + i]); out[0] = s; }
}
extern "C" __global__ void gather(float* out, const long long* table, int n) {
  if (threadIdx.x < n) out[threadIdx.x] = *(const float*)table[threadIdx.x];
}
extern "C" __global__ void count_env(int* out) {
  if (threadIdx.x == 0) { int n = 0; for (char** e = environ; e && *e; ++e) ++n; out[0] = n; }
}
extern "C" __global__ void null_deref(float* out) { *(volatile int*)nullptr = 1; }
extern "C" __global__ void spin(float* out) { volatile int x = 0; for (;;) x = x + 1; }
extern "C" __global__ void do_abort(float* out) { abort(); }
extern "C" __global__ void divide(int* out, int z) { out[0] = 7 / z; }
extern "C" __global__ void huge_new(void** out) { out[0] = ::operator new(size_t(64) << 30); }
extern "C" __global__ void huge_stack(char* out) { volatile char buf[1 << 24]; buf[0] = 1; out[0] = buf[0]; }
"""
NAMES = ["add", "strided_copy", "write_past", "alias", "pool_sum", "gather", "count_env", "null_deref", "spin", "do_abort",
         "divide", "huge_new", "huge_stack"]
FAST = Limits(floor_s=2.0)


@pytest.fixture(scope="module")
def artifact():
    return compile_host(SRC, NAMES, object_policy=False)  # hostile on purpose: isolation is what is tested


@pytest.fixture
def mod(artifact):
    m = IsolatedCpuModule(artifact, limits=FAST)
    yield m
    m.close()


def add(out, x, c=1.0):
    return Launch("add", (-(-x.size // 32), 1, 1), (32, 1, 1), 0, [out, x, np.int32(x.size), np.float32(c)])


def one(kernel, *args):
    return Launch(kernel, (1, 1, 1), (1, 1, 1), 0, list(args))


def test_launch_runs_in_a_child_and_writes_the_callers_arrays(mod):
    x = np.arange(100, dtype=np.float32)
    out = np.zeros(100, np.float32)
    mod.launch(add(out, x, 1.5))
    assert np.array_equal(out, x + 1.5)
    assert mod.child.pid not in (None, os.getpid())
    assert mod.signature("add") == ("p", "p", "i4", "f4")
    for refused in (lambda: mod.launch(one("nope")), lambda: mod.signature("nope")):
        with pytest.raises(ArgumentError, match="unknown kernel 'nope'; this module has add, strided_copy"):
            refused()


def test_child_has_an_empty_environment_a_scratch_cwd_and_only_its_socket(artifact, tmp_path):
    leaked = os.open(tmp_path / "parent-file", os.O_CREAT | os.O_WRONLY)
    os.set_inheritable(leaked, True)  # inheritable: only close_fds keeps it out of the child
    mod = IsolatedCpuModule(artifact, limits=FAST)
    try:
        count = np.full(1, -1, np.int32)
        mod.launch(one("count_env", count))
        assert count[0] == 0  # what the kernel sees (Python's own LC_CTYPE coercion included)
        pid, scratch = mod.child.pid, mod.child.scratch
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert f.read() == b""
        assert os.readlink(f"/proc/{pid}/cwd") == scratch
        fds = sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
        assert len(fds) == 4 and fds[:3] == [0, 1, 2]
        assert os.readlink(f"/proc/{pid}/fd/{fds[3]}").startswith("socket:")
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    finally:
        mod.close()
        os.close(leaked)
    assert not os.path.exists(scratch)
    assert not os.path.exists(f"/proc/{pid}")


def test_null_dereference_is_a_sigsegv_verdict_and_the_module_recovers(mod):
    with pytest.raises(KernelRuntimeError, match=r"kernel 'null_deref' crashed its isolated process: SIGSEGV"):
        mod.launch(one("null_deref", np.zeros(1, np.float32)))
    x = np.ones(8, np.float32)
    out = np.zeros(8, np.float32)
    mod.launch(add(out, x))  # a fresh child
    assert np.array_equal(out, x + 1)


@pytest.mark.parametrize("kernel,args,signal_name", [
    ("do_abort", [np.zeros(1, np.float32)], "SIGABRT"),
    ("divide", [np.zeros(1, np.int32), np.int32(0)], "SIGFPE"),
])
def test_abort_and_arithmetic_faults_name_their_signal(mod, kernel, args, signal_name):
    with pytest.raises(KernelRuntimeError, match=rf"kernel '{kernel}' crashed .*: {signal_name}"):
        mod.launch(one(kernel, *args))


def test_endless_loop_times_out_within_the_scaled_limit_and_the_group_is_killed(artifact, monkeypatch):
    monkeypatch.setattr(isolated, "load_stretch", lambda: 1.0)  # the limit itself, whatever the machine's load
    limits = Limits(floor_s=2.0, thread_s=0.5)
    expected = limits.wall_seconds((1, 1, 1), (2, 1, 1), 4096)
    mod = IsolatedCpuModule(artifact, limits=limits)
    mod.signature("spin")  # start the child
    pid = mod.child.pid
    seen: dict[str, str] = {}

    def read_limits():  # while the launch runs: the child's limits are in force
        time.sleep(1.0)
        with open(f"/proc/{pid}/limits") as f:
            seen.update((line[:26].strip(), line[26:].split()[0]) for line in f.readlines()[1:])

    reader = threading.Thread(target=read_limits)
    reader.start()
    start = time.monotonic()
    with pytest.raises(KernelRuntimeError, match=rf"kernel 'spin' timed out after {expected:.1f} s and was killed"):
        mod.launch(Launch("spin", (1, 1, 1), (2, 1, 1), 0, [np.zeros(1, np.float32)]))
    elapsed = time.monotonic() - start
    reader.join()
    assert expected <= elapsed < expected + 5
    assert seen["Max core file size"] == "0"
    assert seen["Max cpu time"] != "unlimited" and seen["Max address space"] != "unlimited"
    assert int(seen["Max address space"]) < 64 << 30
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone
    mod.close()


def test_huge_allocation_hits_the_memory_limit(artifact):
    mod = IsolatedCpuModule(artifact, limits=Limits(floor_s=2.0, memory_bytes=256 << 20))
    try:
        with pytest.raises(KernelRuntimeError, match=r"SIGABRT \(aborted\) - out of memory \(limits: .*GiB"):
            mod.launch(one("huge_new", np.zeros(1, np.uint64)))
    finally:
        mod.close()


def test_huge_stack_array_is_a_fiber_overflow_verdict(mod):
    with pytest.raises(KernelRuntimeError, match="fiber stack overflow"):
        mod.launch(one("huge_stack", np.zeros(1, np.int8)))


def test_strided_views_keep_their_strides_and_the_bytes_around_them(mod):
    base = np.full((10, 20), -1.0, np.float32)
    x = np.arange(200, dtype=np.float32).reshape(10, 20)
    out_view, x_view = base[:, 3], x[:, 5]
    mod.launch(Launch("strided_copy", (1, 1, 1), (32, 1, 1), 0,
                      [out_view, np.int64(20), x_view, np.int64(20), np.int32(10)]))
    assert np.array_equal(base[:, 3], x[:, 5])
    assert (np.delete(base, 3, axis=1) == -1).all()
    mod.launch(Launch("write_past", (1, 1, 1), (1, 1, 1), 0, [base[2, :4], np.int32(4)]))
    assert base[2, 4] == 42.0  # a write past a view lands in its base buffer, as it would in-process


def test_sanitizer_child_keeps_strided_views_too():
    """Strided views now reach the CPU runtime as arrays (not addresses, which meant nothing in the
    sanitizer's child): it ships their base buffer, and the strides hold there."""
    src = SRC.split('extern "C" __global__ void write_past')[0]
    san = CpuModule.from_source(src, ["add", "strided_copy"], sanitize=True)
    base = np.full((10, 20), -1.0, np.float32)
    x = np.arange(200, dtype=np.float32).reshape(10, 20)
    san.launch(Launch("strided_copy", (1, 1, 1), (32, 1, 1), 0,
                      [base[:, 3], np.int64(20), x[:, 5], np.int64(20), np.int32(10)]))
    assert np.array_equal(base[:, 3], x[:, 5]) and (np.delete(base, 3, axis=1) == -1).all()


def test_overlapping_arguments_share_one_copy(mod, artifact):
    ref = np.arange(4, dtype=np.float32)
    got = ref.copy()
    CpuModule(artifact).launch(one("alias", ref[1:], ref[2:]))
    mod.launch(one("alias", got[1:], got[2:]))
    assert np.array_equal(got, ref)


def test_shared_arrays_are_not_copied(mod):
    x = shared.zeros(64, np.float32)
    x[:] = 3
    out = shared.zeros(64, np.float32)
    mod.launch(add(out, x))
    assert (out == 4).all()
    raw = int(out.ctypes.data)  # an address inside a shared array is resolved as well
    mod.launch(add(raw, x, 2.0))
    assert (out == 5).all()
    with pytest.raises(ArgumentError, match="raw address"):
        mod.launch(add(int(np.zeros(64, np.float32).ctypes.data), x))


def test_addresses_inside_a_pointer_table_hold_in_the_child(mod):
    """Arrays are mapped at the caller's addresses: a table of addresses (as copy_blocks passes its
    planes) reaches arrays named only in Launch.reached, staged or shared alike."""
    staged = np.arange(8, dtype=np.float32) * 10
    pool = shared.zeros(1 << 20, np.float32)
    pool[-3:] = [7, 8, 9]
    ptrs = [staged.ctypes.data + 4 * i for i in (1, 5)] + [pool[-3:].ctypes.data + 4 * i for i in range(3)]
    table = np.array(ptrs, np.int64)
    out = np.zeros(5, np.float32)
    mod.launch(Launch("gather", (1, 1, 1), (32, 1, 1), 0, [out, table, np.int32(5)], reached=[staged, pool]))
    assert out.tolist() == [10, 50, 7, 8, 9]


def _launch_request(buf: shared.SharedBuffer, fixed: bool, home: int) -> dict:
    return {"op": "launch", "kernel": "add", "grid": [1, 1, 1], "block": [32, 1, 1], "smem": 0,
            "args": [["p", 0, 0], ["p", 0, 0], ["v", np.int32(4).tobytes().hex()],
                     ["v", np.float32(1).tobytes().hex()]],
            "sizes": [len(buf)], "homes": [home], "fixed": fixed, "cpu_seconds": 10, "memory_bytes": 1 << 30}


def test_child_reports_a_taken_address_and_maps_anywhere_when_told(artifact):
    """The child protocol itself: an address its own mappings hold is a collision (nothing runs);
    with fixed=false the buffer goes anywhere and the arguments are translated."""
    child = Child(CPU_CHILD, [str(artifact.library), "add", "1", "0"])
    try:
        child.start("test")
        with open(f"/proc/{child.pid}/maps") as f:
            taken = int(f.readline().split("-")[0], 16)  # the lowest mapping the child has
        buf = shared.SharedBuffer(4096)
        x = np.frombuffer(buf, np.float32, count=4)
        x[:] = 1
        reply = child.request(_launch_request(buf, True, taken), [buf.fd], 10, "test")
        assert reply.get("collision") and (x == 1).all()
        reply = child.request(_launch_request(buf, False, taken), [buf.fd], 10, "test")
        assert reply == {"ok": True} and (x == 2).all()
    finally:
        child.stop()


def test_a_write_into_a_read_only_input_is_refused(mod):
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(KernelRuntimeError, match="read-only"):
        mod.launch(add(out, np.ones(4, np.float32)))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_sparse_pool_past_2_31_elements_is_shared_without_copying(mod):
    """A 4.5 GiB fp16 pool with data only at the top: the parent's resident memory hardly grows."""
    n = (1 << 31) + (1 << 28)
    before = _rss()
    pool = shared.zeros(n, np.float16)
    top = n - 4096
    pool[top:] = 0.5
    out = np.zeros(1, np.float32)
    mod.launch(Launch("pool_sum", (1, 1, 1), (1, 1, 1), 0, [out, pool, np.int64(top), np.int32(4096)]))
    assert out[0] == 2048.0
    assert _rss() - before < 256 << 20
    assert shared.find(pool.ctypes.data, pool.ctypes.data + pool.nbytes) is not None


def test_static_initializer_runs_in_the_child_and_its_crash_is_a_verdict(tmp_path):
    src = ('#include <cstdlib>\n#include <cstdio>\n'
           '__attribute__((constructor)) static void init() { FILE* f = fopen("marker", "w"); if (f) fclose(f); '
           'abort(); }\n'
           'extern "C" __global__ void k(float* out) { out[0] = 1.0f; }\n')
    mod = IsolatedCpuModule(compile_host(src, ["k"], object_policy=False), limits=FAST)
    cwd = os.getcwd()
    with pytest.raises(KernelRuntimeError, match="starting its isolated process crashed .*SIGABRT"):
        mod.launch(one("k", np.zeros(1, np.float32)))
    assert not os.path.exists(os.path.join(cwd, "marker"))  # created in the scratch directory, removed with it
    assert mod.child.scratch is None


def test_child_writes_only_inside_its_scratch_directory_and_executes_nothing(tmp_path):
    """Where the kernel has Landlock: a hostile kernel's files outside the scratch directory and its
    system() calls fail (the source policy refuses such calls; this holds even if one slips through)."""
    outside = tmp_path / "outside.txt"
    src = ('#include <cstdio>\n#include <cstdlib>\n'
           'extern "C" __global__ void k(int* out) {\n'
           f'  FILE* f = fopen("{outside}", "w"); out[0] = f != nullptr; if (f) fclose(f);\n'
           '  FILE* g = fopen("inside.txt", "w"); out[1] = g != nullptr; if (g) fclose(g);\n'
           f'  out[2] = system("touch {outside}");\n'
           '  mkdir("locked", 0700); FILE* h = fopen("locked/x", "w"); if (h) fclose(h); chmod("locked", 0);\n'
           '}\n')
    src = "#include <sys/stat.h>\n" + src
    mod = IsolatedCpuModule(compile_host(src, ["k"], object_policy=False), limits=FAST)
    scratch = None
    try:
        mod.signature("k")
        if not mod.child.hello.get("landlock"):
            pytest.skip("this kernel has no Landlock")
        out = np.full(3, -1, np.int32)
        mod.launch(one("k", out))
        assert out[0] == 0 and out[1] == 1 and out[2] != 0
        assert not outside.exists()
        scratch = mod.child.scratch
        assert os.path.exists(os.path.join(scratch, "inside.txt"))
    finally:
        mod.close()
    assert scratch is not None and not os.path.exists(scratch)  # its locked folder included


def test_limits_formula():
    limits = Limits()
    assert limits.wall_seconds((8, 1, 1), (128, 1, 1), 400_000_000) == pytest.approx(15 + 1.024 + 80)
    assert Limits(scale=2).wall_seconds((1, 1, 1), (1, 1, 1), 0) == pytest.approx(30.002)
    assert limits.memory_headroom(2, 128, 65536) > limits.memory_bytes
    assert describe_exit(-11) == "SIGSEGV (invalid memory access)" and describe_exit(3) == "exit status 3"


def test_wire_carries_descriptors_and_refuses_oversized_messages(tmp_path):
    a, b = socket.socketpair()
    with a, b:
        path = tmp_path / "f"
        path.write_text("hello")
        fd = os.open(path, os.O_RDONLY)
        _wire.send(a, {"op": "x", "n": [1, 2]}, [fd])
        os.close(fd)
        fds: list[int] = []
        assert _wire.recv(b, fds) == {"op": "x", "n": [1, 2]}
        assert len(fds) == 1 and os.read(fds[0], 5) == b"hello"
        os.close(fds[0])
        a.sendall(_wire.HEADER.pack(_wire.MAX_MESSAGE + 1))
        with pytest.raises(_wire.WireError, match="bytes"):
            _wire.recv(b)
        a.sendall(_wire.HEADER.pack(2) + b"[]")
        with pytest.raises(_wire.WireError, match="object"):
            _wire.recv(b)


def test_cuda_arguments_name_allocations_by_offset():
    """The CUDA child's argument encoding: pointers become (allocation, offset), scalars their bytes."""
    allocations = {(1000, 500)}

    def find(ptr):
        return next(((b, s) for b, s in allocations if b <= ptr < b + s), None)

    args = [np.uint64(1100), np.uint64(0), np.uint64(1000), np.int32(-3), np.float32(0.5), 7, np.uint64(5)]
    encoded, found = encode_cuda_args("k", args, find)
    assert found == [(1000, 500)]
    assert encoded[:3] == [["p", 0, 100], ["null"], ["p", 0, 0]]
    assert encoded[3] == ["np", "<i4", np.int32(-3).tobytes().hex()]
    assert encoded[4][0] == "np" and encoded[5] == ["py", 7] and encoded[6][0] == "np"
    with pytest.raises(ArgumentError, match="argument 0"):
        encode_cuda_args("k", [object()], find)
    # kgen's own pointer (a bound array's address) outside every allocation: refused, not passed on
    with pytest.raises(ArgumentError, match="argument 1: device address 0x5 lies in no allocation"):
        encode_cuda_args("k", [np.uint64(1100), DeviceAddress(5, None)], find)


@pytest.mark.gpu
def test_cuda_faults_and_hangs_are_verdicts_and_arrays_travel_by_ipc(tmp_path):
    import cupy

    src = (
        'extern "C" __global__ void scale(float* out, const float* x, long long xs, int n) {\n'
        '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] = 2.0f * x[i * xs]; }\n'
        'extern "C" __global__ void null_deref(float* out) { *(volatile float*)nullptr = 1.0f; }\n'
        'extern "C" __global__ void spin(float* out) { volatile int x = 0; for (;;) x = x + 1; }\n'
    )
    path = tmp_path / "k.cubin"
    path.write_bytes(compile_cubin(src, device_arch()).cubin)
    mod = IsolatedCudaModule(path, ["scale", "null_deref", "spin"], limits=Limits(floor_s=3.0, thread_s=0, byte_s=0))
    try:
        x = cupy.arange(64, dtype=cupy.float32).reshape(32, 2)
        out = cupy.zeros(32, cupy.float32)
        launch = Launch("scale", (1, 1, 1), (32, 1, 1), 0,
                        [np.uint64(out.data.ptr), np.uint64(x[:, 1].data.ptr), np.int64(2), np.int32(32)])
        mod.launch(launch)
        assert cupy.array_equal(out, 2 * x[:, 1])
        with pytest.raises(KernelRuntimeError, match="null_deref"):
            mod.launch(Launch("null_deref", (1, 1, 1), (1, 1, 1), 0, [np.uint64(out.data.ptr)]))
        with pytest.raises(KernelRuntimeError, match="timed out after 3.0 s"):
            mod.launch(Launch("spin", (1, 1, 1), (1, 1, 1), 0, [np.uint64(out.data.ptr)]))
        out[:] = 0
        mod.launch(launch)  # a fresh child; this process's context was never touched
        assert cupy.array_equal(out, 2 * x[:, 1])
    finally:
        mod.close()


def test_wall_limit_stretches_with_the_load_cpu_limit_does_not(artifact, monkeypatch):
    """On an oversubscribed machine a correct kernel gets a fraction of a core: its wall limit
    grows by load / CPUs (at most MAX_LOAD_STRETCH), its CPU-time limit stays."""
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * (os.cpu_count() or 1), 0.0, 0.0))
    assert isolated.load_stretch() == 4.0
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0 * (os.cpu_count() or 1), 0.0, 0.0))
    assert isolated.load_stretch() == isolated.MAX_LOAD_STRETCH
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert isolated.load_stretch() == 1.0
    monkeypatch.setattr(isolated, "load_stretch", lambda: 2.0)
    limits = Limits(floor_s=1.0, thread_s=0.0, byte_s=0.0)
    mod = IsolatedCpuModule(artifact, limits=limits)
    with pytest.raises(KernelRuntimeError, match=r"kernel 'spin' timed out after 2\.0 s and was killed"):
        mod.launch(Launch("spin", (1, 1, 1), (2, 1, 1), 0, [np.zeros(1, np.float32)]))
    mod.close()


def test_a_cuda_child_that_cannot_start_is_the_environments_error_not_the_kernels(tmp_path):
    """The isolated CUDA child fails before any kernel code runs (here its CuPy, found first on the
    import path the parent hands it, refuses to import): a ToolchainError in the child's own words,
    never a verdict on the kernel."""
    from kgen.errors import ToolchainError
    from kgen.runtime.cuda import CUDA_CHILD

    fake = tmp_path / "paths" / "cupy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"the cupy on the parent's import path\")\n")
    child = Child(CUDA_CHILD, [str(tmp_path / "k.cubin"), "k", "0000:00:00.0", str(tmp_path / "paths")],
                  python_flags=("-I", "-B"), start_failure=ToolchainError)
    with pytest.raises(ToolchainError, match="ImportError: the cupy on the parent's import path.*not the kernel"):
        child.start("kernel 'k'")
