"""Host arrays that a child process maps too: the memory of the isolated runtime (kgen.runtime.isolated).

A `SharedBuffer` is an anonymous in-memory file (memfd) mapped MAP_SHARED: its file
descriptor goes to the child over the pipe, the child maps the same pages, and what the
kernel writes is in the parent's array with no copy back. The file is sparse: a 4 GiB
pool of which a kernel touches a few blocks commits only those pages, in both processes.

`zeros(shape, dtype)` makes such an array; give the kernel views of it (strided or not)
and nothing is copied. Any other numpy array is *staged* by `Staging`: its whole base
buffer (the array that owns the memory, so guard bytes around a view travel with it) is
copied into a SharedBuffer before the launch and back after it. Either way the child maps
the memory at the address it has here, so addresses stored in arrays (pointer tables) hold.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from kgen.errors import ArgumentError, KernelRuntimeError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class SharedBuffer(mmap.mmap):
    """`size` bytes of a memfd, mapped shared; `fd` stays open while the buffer lives (to hand on).
    `home` is the address a child maps it at: its own address here, or that of the bytes it copies."""

    fd: int
    address: int
    home: int

    def __new__(cls, size: int) -> SharedBuffer:
        size = max(mmap.PAGESIZE, -(-int(size) // mmap.PAGESIZE) * mmap.PAGESIZE)
        fd = os.memfd_create("kgen-array", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)  # sparse: no page is committed until it is written
            self = super().__new__(cls, fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.address = self.home = ctypes.addressof(ctypes.c_char.from_buffer(self))  # the export ends here
        weakref.finalize(self, os.close, fd)
        _LIVE.add(self)
        return self

    def committed_bytes(self) -> int:
        """Bytes of the file that hold pages (written at least once)."""
        return os.fstat(self.fd).st_blocks * 512

    def contains(self, lo: int, hi: int) -> bool:
        return self.address <= lo and hi <= self.address + len(self)


_LIVE: weakref.WeakSet[SharedBuffer] = weakref.WeakSet()


def zeros(shape: int | Sequence[int], dtype: Any) -> np.ndarray:
    """A C-contiguous array of zeros in a new SharedBuffer (pages are committed as they are written)."""
    dt = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
    count = int(np.prod(shape, dtype=np.int64))
    buf = SharedBuffer(count * dt.itemsize)
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)


def copy(arr: np.ndarray) -> np.ndarray:
    """`arr` copied into a new SharedBuffer (same shape and dtype, C order)."""
    out = zeros(arr.shape, arr.dtype)
    out[...] = arr
    return out


def find(lo: int, hi: int) -> SharedBuffer | None:
    """The live SharedBuffer holding the bytes [lo, hi), if any."""
    for buf in list(_LIVE):
        if buf.contains(lo, hi):
            return buf
    return None


def _span(a: np.ndarray) -> tuple[int, int]:
    lo, hi = byte_bounds(a)
    return lo, max(hi, lo + 1)


def _owner(a: np.ndarray) -> np.ndarray:
    """The array that owns `a`'s memory (the base buffer of a view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _transfer(op: Any, fd: int, offset: int, lo: int, hi: int, chunk: int = 1 << 30) -> None:
    """os.pwrite this process's bytes [lo, hi) to `fd` at `offset`, or os.preadv them back from there
    (system calls, not memmove: no page faults on this side, and a bad address is an error, not a crash)."""
    done = 0
    while done < hi - lo:
        n = min(chunk, hi - lo - done)
        view = memoryview((ctypes.c_char * n).from_address(lo + done)).cast("B")
        moved = op(fd, view, offset + done) if op is os.pwrite else op(fd, [view], offset + done)
        if moved <= 0:
            raise OSError(f"short transfer of a staged array ({done} of {hi - lo} bytes)")
        done += moved


def _pages(lo: int, hi: int) -> tuple[int, int]:
    page = mmap.PAGESIZE
    return lo // page * page, -(-hi // page) * page


class Staging:
    """Where the arrays of a batch of launches live in shared memory, and at which address.

    The child maps every buffer at the address the bytes have in this process (`SharedBuffer.home`),
    so any address the kernel gets, as an argument or inside a pointer table, means the same there.
    An array inside a SharedBuffer is used as is. Any other array is staged: the pages that its base
    buffer (the array owning its memory) spans are copied into a new SharedBuffer, with only the
    owners' bytes written (the rest of those pages reads as zeros there); owners sharing a page share
    one buffer, so aliasing is kept. `place(a)` gives (buffer, byte offset of a's first element);
    `finish()` copies the owners' bytes back and releases the copies.
    """

    def __init__(self, arrays: Iterable[np.ndarray]):
        self._copies: list[tuple[SharedBuffer, list[np.ndarray]]] = []
        owners: dict[int, np.ndarray] = {}
        for a in arrays:
            if find(*_span(a)) is None:
                o = _owner(a)
                owners[id(o)] = o
        regions: list[list[Any]] = []  # [first page, end page, owners]
        for o in sorted(owners.values(), key=lambda o: _span(o)[0]):
            lo, hi = _pages(*_span(o))
            if regions and lo < regions[-1][1]:
                regions[-1][1] = max(regions[-1][1], hi)
                regions[-1][2].append(o)
            else:
                regions.append([lo, hi, [o]])
        for lo, hi, group in regions:
            buf = SharedBuffer(hi - lo)
            buf.home = lo
            for o in group:
                olo, ohi = _span(o)
                _transfer(os.pwrite, buf.fd, olo - lo, olo, ohi)
            self._copies.append((buf, group))

    def place(self, a: np.ndarray | int, what: str) -> tuple[SharedBuffer, int]:
        lo, hi = _span(a) if isinstance(a, np.ndarray) else (a, a + 1)
        for buf, _ in self._copies:
            if buf.home <= lo and hi <= buf.home + len(buf):
                return buf, lo - buf.home
        buf = find(lo, hi)
        if buf is None:
            raise ArgumentError(
                f"{what}: a raw address ({a:#x}) that is not inside an array kgen can share with the isolated "
                "child; pass the numpy array (views are fine) or an array from kgen.runtime.shared.zeros"
            )
        return buf, lo - buf.home

    def finish(self) -> None:
        """Copy the owners' bytes back; a change to a read-only array is a KernelRuntimeError."""
        copies, self._copies = self._copies, []
        for buf, group in copies:
            for o in group:
                lo, hi = _span(o)
                if o.flags.writeable:
                    _transfer(os.preadv, buf.fd, lo - buf.home, lo, hi)
                elif _libc.memcmp(buf.address + (lo - buf.home), lo, hi - lo) != 0:
                    raise KernelRuntimeError("the kernel wrote into a read-only array argument")
