"""Arrays far larger than the memory a case touches (docs/verification.md: a KV pool past 2^32
elements whose used blocks sit at its top). The array is an anonymous in-memory file mapped
shared: only the pages written commit memory, so an 8 GiB pool of which a case writes a few
blocks costs those blocks. Such an array must only be read where it was written (a read of an
untouched page commits it too): the reference gathers the used blocks, the seals hash the
written ranges, and a device copy holds zeros plus the written ranges.

The isolated CPU runtime (kgen.runtime.shared) shares arrays of its own memfd buffers with the
kernel's process without a copy; where that module exists its `zeros` makes these arrays, so a
sparse pool reaches the child as it is.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kgen.runtime.cuda import cupy_module

try:  # the isolated runtime's shared buffers, where that runtime is present
    from kgen.runtime.shared import zeros as _shared_zeros
except ImportError:  # pragma: no cover - depends on the runtime in this tree
    _shared_zeros = None

Ranges = list[tuple[int, int]]  # element ranges [lo, hi) of the flattened array


def sparse_zeros(shape: tuple[int, ...], np_dtype) -> np.ndarray:
    """A C-contiguous array of zeros that commits memory only for the pages written."""
    dt = np.dtype(np_dtype)
    if _shared_zeros is not None:
        return _shared_zeros(shape, dt)
    nbytes = max(int(np.prod(shape, dtype=np.int64)) * dt.itemsize, 1)
    fd = os.memfd_create("kgen-sparse", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file alive
    return np.frombuffer(buf, dtype=dt, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)


def byte_ranges(arr: np.ndarray, ranges: Ranges) -> Ranges:
    """Element ranges of a C-contiguous array as byte ranges."""
    item = arr.dtype.itemsize
    return [(lo * item, hi * item) for lo, hi in ranges]


def sparse_to_backend(arr: np.ndarray, ranges: Ranges, backend: str):
    """A sparse host array for `backend`: itself on the CPU; on CUDA a device array of zeros
    holding the written `ranges` (copying the whole array would read, and commit, every page)."""
    if backend == "cpu":
        return arr
    cp = cupy_module()
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize]
    dev = cp.zeros(arr.size, dtype=bits)
    flat = arr.reshape(-1).view(bits)
    for lo, hi in ranges:
        dev[lo:hi] = cp.asarray(flat[lo:hi])
    return dev.reshape(arr.shape).view(arr.dtype)
