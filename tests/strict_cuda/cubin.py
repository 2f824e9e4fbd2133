"""What the driver reads from a cubin at module load: each kernel's static shared memory (the size
of its `.nv.shared.<kernel>` section, as cuFuncGetAttribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
reports it), and the CUDA source it was built from (for the model to run on the CPU backend)."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path


def section_sizes(cubin: bytes) -> dict[str, int]:
    """{section name: size} of an ELF64 little-endian file (a cubin)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]

    def name(off: int) -> str:
        end = cubin.index(b"\0", strtab_off + off)
        return cubin[strtab_off + off:end].decode()

    return {name(h[0]): h[5] for h in headers}


RESERVED_SMEM = 1024  # per block, for the system, on sm_80 and newer (cudaDevAttrReservedSharedMemoryPerBlock)


def static_smem(cubin: bytes, kernel: str) -> int:
    """The kernel's own static shared memory, as ptxas reports it: its section holds the block's
    reserved kilobyte too where the cubin has a `.nv.shared.reserved.*` section (sm_80+); the
    driver counts that kilobyte apart. (An assumption read from the cubins NVRTC 13 writes.)"""
    sections = section_sizes(cubin)
    size = sections.get(f".nv.shared.{kernel}", 0)
    reserved = RESERVED_SMEM if any(k.startswith(".nv.shared.reserved") for k in sections) else 0
    return max(0, size - reserved)


def source_for(path: Path) -> str:
    """The CUDA source of the cubin at `path`: `<hash>.cu` beside a cubin kgen loads from
    `<cache>/loaded/`, kernel.cu beside it (a generated module, a cache entry), else the kgen cache
    entry holding the same cubin bytes."""
    for sibling in (path.with_suffix(".cu"), path.parent / "kernel.cu"):
        if sibling.is_file():
            return sibling.read_text()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    roots = {path.parent.parent}
    if os.environ.get("KGEN_CACHE_DIR"):
        roots.add(Path(os.environ["KGEN_CACHE_DIR"]))
    for root in roots:
        for cubin in root.glob("cubin-*/*/*/kernel.cubin"):
            if hashlib.sha256(cubin.read_bytes()).hexdigest() == digest and (cubin.parent / "kernel.cu").is_file():
                return (cubin.parent / "kernel.cu").read_text()
    raise FileNotFoundError(f"{path}: no CUDA source for this cubin (the strict model runs kernels from source)")
