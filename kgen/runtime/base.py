"""What every backend runtime implements: launch one `extern "C" __global__` function.

A kernel call (kgen/kernel.py) turns the user's keyword arguments into a list of
`Launch`es; a backend module executes them. Arguments are passed by value in
kernel-parameter order, exactly like cuLaunchKernel's `void** args`:
arrays (numpy on the CPU backend, CuPy on CUDA) stand for a device pointer, and
numpy scalars (np.int32, np.int64, np.float32) for by-value parameters of that C type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kgen.errors import ArgumentError


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0  # dynamic shared memory, bytes
    args: list[Any] = field(default_factory=list)
    # Arrays the kernel reaches through addresses stored in an argument (a pointer table), not as
    # arguments: an isolated runtime maps them into its child process too.
    reached: list[Any] = field(default_factory=list)


class DeviceAddress(np.uint64):
    """A device address in a launch's arguments that keeps the array it points into alive (`owner`):
    a temporary made while binding a call (split-KV scratch, an int32 copy of int64 indices, a
    scale array) must outlive the launch, and a bound call's repeated launches."""

    __slots__ = ("owner",)

    def __new__(cls, address: int, owner: Any):
        self = super().__new__(cls, address)
        self.owner = owner
        return self


def has_blocks(launch: Launch) -> bool:
    """False for a launch of zero blocks (a grid with a 0: an empty batch), which does no work."""
    grid = (launch.grid,) if isinstance(launch.grid, int) else tuple(launch.grid)
    return all(int(g) != 0 for g in grid)


def check_kernel(kernel: str, names) -> None:
    """Refuse a launch (or signature) of a kernel that a module with kernels `names` does not have."""
    if kernel not in names:
        raise ArgumentError(f"unknown kernel {kernel!r}; this module has {', '.join(names)}")


class Module(Protocol):
    backend: str

    def launch(self, launch: Launch) -> None: ...
