"""Child process of the isolated CUDA runtime (kgen.runtime.cuda.IsolatedCudaModule), started as

    python -I -B _isolated_cuda_child.py SOCKET_FD CUBIN KERNELS PCI_BUS_ID [IMPORT_PATH]

with an empty environment, in a scratch directory. A faulting kernel poisons the CUDA context of
the process that launched it; here that is this child, which the parent then replaces. It loads
the cubin with CuPy on the parent's GPU (found by PCI bus id: with an empty environment the device
numbering can differ from the parent's CUDA_VISIBLE_DEVICES one), then serves launch requests:
the arrays are the parent's own device allocations, opened through CUDA IPC handles, so nothing
is copied; the kernel runs, the device is synchronized, the handles are closed and the result
goes back. After a CUDA error the child answers and exits (its context is unusable).
"""

import os
import sys

if len(sys.argv) > 5:  # the parent's import path: numpy and CuPy may be installed outside -I's
    sys.path[:0] = [p for p in sys.argv[5].split(os.pathsep) if p]

import ctypes  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import socket  # noqa: E402

import numpy as np  # noqa: E402

# Siblings (kgen/runtime/_wire.py) by name from this folder, put last on the path: this file runs as a
# script, and importing the kgen package would pull in all of kgen (numpy, pydantic, ...) first.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import _wire  # noqa: E402


def set_soft(which, value):
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, hard))


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def decode_args(req, bases):
    args = []
    for arg in req["args"]:
        if arg[0] == "p":
            args.append(np.uint64(bases[arg[1]] + arg[2]))
        elif arg[0] == "null":
            args.append(np.uint64(0))
        elif arg[0] == "np":
            args.append(np.frombuffer(bytes.fromhex(arg[2]), dtype=np.dtype(arg[1]))[0])
        else:  # "py": a Python scalar, passed on as the caller gave it
            args.append(arg[1])
    return args


def run_launch(cupy, functions, req):
    runtime = cupy.cuda.runtime
    bases = []
    try:
        for handle in req["handles"]:
            bases.append(runtime.ipcOpenMemHandle(bytes.fromhex(handle)))
        fn = functions[req["kernel"]]
        smem = req["smem"]
        # The attribute's default is what the function may take without the opt-in (the default limit
        # less its static shared memory): past it, opt in (kgen/plan/arch.py).
        if smem and fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
        set_soft(resource.RLIMIT_CPU, math.ceil(cpu_seconds() + req["cpu_seconds"]))
        fn(tuple(req["grid"]), tuple(req["block"]), tuple(decode_args(req, bases)), shared_mem=smem)
        runtime.deviceSynchronize()
        return {"ok": True}
    except Exception as e:  # CUDARuntimeError, CUDADriverError: the context may be poisoned
        return {"error": f"{type(e).__name__}: {e}", "fatal": True}
    finally:
        for base in bases:
            try:
                runtime.ipcCloseMemHandle(base)
            except Exception:  # a poisoned context refuses this too; the process ends anyway
                pass


def main(argv):
    ctypes.CDLL(None).clearenv()  # Python's locale coercion may have set LC_CTYPE
    sock = socket.socket(fileno=int(argv[1]))
    cubin, kernels, bus_id = argv[2], argv[3].split(","), argv[4]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    set_soft(resource.RLIMIT_FSIZE, 64 << 20)
    set_soft(resource.RLIMIT_NOFILE, 1024)
    set_soft(resource.RLIMIT_CPU, 120)  # CUDA's start-up and the module load
    try:
        import cupy

        cupy.cuda.Device(cupy.cuda.runtime.deviceGetByPCIBusId(bus_id)).use()
        module = cupy.RawModule(path=cubin)
        functions = {name: module.get_function(name) for name in kernels}
    except Exception as e:
        _wire.send(sock, {"error": f"the CUDA module does not load in the isolated process: {type(e).__name__}: {e}"})
        return 3
    _wire.send(sock, {"ok": True})
    while True:
        try:
            req = _wire.recv(sock)
        except _wire.WireError:
            return 0
        if req.get("op") != "launch":
            return 0
        reply = run_launch(cupy, functions, req)
        _wire.send(sock, reply)
        if "error" in reply:
            return 4


if __name__ == "__main__":
    sys.exit(main(sys.argv))
