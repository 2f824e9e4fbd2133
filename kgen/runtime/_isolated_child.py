"""Child process of the isolated CPU runtime (kgen.runtime.isolated), started as

    python -I -S -B _isolated_child.py SOCKET_FD LIBRARY KERNELS WORKERS STACK_BYTES

with an empty environment, in a scratch directory, with no descriptor but 0-2 and the socket;
where the kernel has Landlock, it can write files only inside that directory (restrict_filesystem).
Standard library only (no numpy, no kgen): it starts in tens of milliseconds and leaves the
address-space limit to the kernel. It loads the untrusted library (its static initializers run
here), answers with the kernels' signatures, then serves launch requests until the socket closes:
each request brings the memfds of the arrays (SCM_RIGHTS); they are mapped, the argument array is
built, at the addresses they have in the parent (so pointer tables hold; anywhere, translating the
arguments, if "fixed" is false), soft CPU and address-space limits are set for the launch,
the kernel runs, the arrays are unmapped and the result goes back. A crash ends the process; the
parent turns the signal into a verdict.
"""

import ctypes
import math
import os
import resource
import socket
import sys

# Siblings (kgen/runtime/_wire.py) by name from this folder, put last on the path: this file runs as a
# script, and importing the kgen package would pull in all of kgen (numpy, pydantic, ...) first.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import _wire  # noqa: E402

ERR_LEN = 4096
PROT_RW = 0x1 | 0x2
MAP_SHARED = 0x01
MAP_FIXED_NOREPLACE = 0x100000
EEXIST = 17
MAP_FAILED = ctypes.c_void_p(-1).value
MiB = 1 << 20
STARTUP_CPU_SECONDS = 60
STARTUP_MEMORY = 2048 * MiB

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def set_soft(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, hard))


def vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# Landlock (Linux >= 5.13): writes only inside the scratch directory, no execve, no TCP, no signals
# or abstract sockets outside the child. Reads stay allowed (the interpreter and the library need them).
LANDLOCK_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
FS_EXECUTE, FS_WRITE_FILE = 1 << 0, 1 << 1
FS_WRITES_ABI1 = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make *
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
NET_ALL = (1 << 0) | (1 << 1)  # bind and connect TCP
SCOPE_ALL = (1 << 0) | (1 << 1)  # abstract unix sockets, signals
PR_SET_NO_NEW_PRIVS = 38


def restrict_filesystem(scratch: str) -> int:
    """Confine this process with Landlock; its ABI version, 0 where the kernel has none."""
    nums = LANDLOCK_SYSCALLS.get(os.uname().machine)
    if nums is None:
        return 0
    create, add_rule, restrict = nums
    abi = libc.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    writes = FS_WRITES_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    attr = (ctypes.c_uint64 * 3)(writes | FS_EXECUTE, NET_ALL if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    try:
        beneath = ctypes.create_string_buffer(12)  # struct landlock_path_beneath_attr (packed)
        fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY)
        try:
            ctypes.memmove(beneath, ctypes.byref(ctypes.c_uint64(writes)), 8)
            ctypes.memmove(ctypes.byref(beneath, 8), ctypes.byref(ctypes.c_int32(fd)), 4)
            if libc.syscall(add_rule, ruleset, 1, beneath, ctypes.c_uint32(0)) != 0:  # LANDLOCK_RULE_PATH_BENEATH
                return 0
        finally:
            os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return 0
        if libc.syscall(restrict, ruleset, ctypes.c_uint32(0)) != 0:
            return 0
        return abi
    finally:
        os.close(ruleset)


class Library:
    def __init__(self, path: str, workers: int, stack: int):
        self.lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self.launch = self.lib.kgen_launch
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_char_p, *([ctypes.c_uint] * 6), ctypes.c_size_t, ctypes.c_void_p,
                                ctypes.c_char_p, ctypes.c_size_t]
        self.lib.kgen_signature.restype = ctypes.c_char_p
        self.lib.kgen_signature.argtypes = [ctypes.c_char_p]
        self.lib.kgen_set_options.restype = None
        self.lib.kgen_set_options.argtypes = [ctypes.c_uint, ctypes.c_size_t]
        self.lib.kgen_set_options(workers, stack)

    def signature(self, kernel: str):
        raw = self.lib.kgen_signature(kernel.encode())
        return None if raw is None else raw.decode("ascii", "replace")


def run_launch(lib: Library, req: dict, fds: list) -> dict:
    maps = []
    try:
        if not len(fds) == len(req["sizes"]) == len(req["homes"]):
            return {"error": f"{len(fds)} array descriptors arrived for {len(req['sizes'])} arrays"}
        for fd, size, home in zip(fds, req["sizes"], req["homes"], strict=True):
            want = home if req["fixed"] else None
            addr = libc.mmap(want, size, PROT_RW, MAP_SHARED | (MAP_FIXED_NOREPLACE if want else 0), fd, 0)
            if addr in (None, MAP_FAILED):
                errno = ctypes.get_errno()
                if want and errno == EEXIST:
                    return {"collision": True, "error": f"address {home:#x} is taken in the isolated process"}
                return {"error": f"cannot map an array of {size} bytes: {os.strerror(errno)}"}
            maps.append((addr, size))
            if want and addr != want:  # a kernel older than MAP_FIXED_NOREPLACE (4.17) took it as a hint
                return {"collision": True, "error": f"address {home:#x} is taken in the isolated process"}
    finally:
        for fd in fds:
            os.close(fd)
    try:
        holders = []
        for arg in req["args"]:
            if arg[0] == "p":
                holders.append(ctypes.c_void_p(maps[arg[1]][0] + arg[2]))
            elif arg[0] == "null":
                holders.append(ctypes.c_void_p(0))
            else:
                data = bytes.fromhex(arg[1])
                holders.append((ctypes.c_char * len(data)).from_buffer_copy(data))
        argv = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        err = ctypes.create_string_buffer(ERR_LEN)
        g, b = req["grid"], req["block"]
        # The launch's limits: CPU seconds from now, address space = what is mapped now + headroom.
        set_soft(resource.RLIMIT_CPU, math.ceil(cpu_seconds() + req["cpu_seconds"]))
        set_soft(resource.RLIMIT_AS, vm_size() + req["memory_bytes"])
        try:
            rc = lib.launch(req["kernel"].encode(), g[0], g[1], g[2], b[0], b[1], b[2], req["smem"], argv, err,
                            ERR_LEN)
        finally:
            set_soft(resource.RLIMIT_AS, resource.RLIM_INFINITY)
        return {"ok": True} if rc == 0 else {"error": err.value.decode("utf-8", "replace")}
    finally:
        for addr, size in maps:
            libc.munmap(addr, size)


def main(argv: list) -> int:
    libc.clearenv()  # Python's own locale coercion (LC_CTYPE) is the one variable that could appear
    sock = socket.socket(fileno=int(argv[1]))
    library, kernels, workers, stack = argv[2], argv[3].split(","), int(argv[4]), int(argv[5])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    set_soft(resource.RLIMIT_FSIZE, 64 * MiB)
    set_soft(resource.RLIMIT_NOFILE, 256)
    landlock = restrict_filesystem(os.getcwd())
    set_soft(resource.RLIMIT_CPU, STARTUP_CPU_SECONDS)  # loading runs the library's static initializers
    set_soft(resource.RLIMIT_AS, vm_size() + STARTUP_MEMORY)
    try:
        lib = Library(library, workers, stack)
    except (OSError, AttributeError) as e:
        _wire.send(sock, {"error": f"the kernel library does not load: {e}"})
        return 3
    set_soft(resource.RLIMIT_AS, resource.RLIM_INFINITY)
    _wire.send(sock, {"ok": True, "signatures": {k: lib.signature(k) for k in kernels}, "landlock": landlock})
    while True:
        fds: list = []
        try:
            req = _wire.recv(sock, fds)
        except _wire.WireError:
            return 0  # the parent closed the socket: done
        if req.get("op") != "launch":
            return 0
        _wire.send(sock, run_launch(lib, req, fds))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
