"""Child process of CpuModule's sanitize mode: `python -m kgen.runtime._sanitized_launch JOB.pkl`.

Started with the ASan runtime in LD_PRELOAD. Loads the job (library path, launches with
numpy arrays; a strided view as {"base": its base buffer's bytes, "offset"}), runs the launches
and pickles back the arrays (pointer arguments) and any runtime error. A sanitizer report ends the process (nonzero exit, report on stderr); the
parent turns it into a KernelRuntimeError.
"""

from __future__ import annotations

import ctypes
import pickle
import sys

import numpy as np

from kgen.fileio import atomic_write_bytes
from kgen.runtime.cpu import _Library, pack_args


def main(job_path: str) -> int:
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    out_path = job["result"]
    lib = _Library(job["library"])
    result: dict = {"arrays": []}
    if "signature" in job:
        result["signature"] = list(lib.signature(job["signature"]) or ())
    lib.set_options(job.get("workers", 0), job.get("stack_size", 0))
    err = ctypes.create_string_buffer(4096)
    for idx, ln in enumerate(job["launches"]):
        # Fresh, exactly sized buffers: ASan puts its redzones right after each one.
        arrays = [np.array(a["base"] if isinstance(a, dict) else a, copy=True)
                  if isinstance(a, np.ndarray | dict) else None for a in ln["args"]]
        args = [arr.ctypes.data + a["offset"] if isinstance(a, dict) else a if arr is None else arr
                for a, arr in zip(ln["args"], arrays, strict=True)]
        sig = lib.signature(ln["kernel"])
        result["kernel"] = ln["kernel"]
        result["index"] = idx
        # Progress marker: if the sanitizer kills us mid-launch, the parent knows which kernel.
        atomic_write_bytes(out_path, pickle.dumps(result))
        argv, _keep = pack_args(ln["kernel"], sig, args)
        rc = lib.launch(ln["kernel"].encode(), *ln["grid"], *ln["block"], ln["smem"], argv, err, 4096)
        result["arrays"].append(arrays)
        if rc != 0:
            result["error"] = err.value.decode(errors="replace")
            break
    atomic_write_bytes(out_path, pickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
