"""Which CPU kernel libraries keep their fiber stacks between launches.

A launch that maps its fiber stacks and unmaps them when it ends pays about 20 us per thread of
its block (an mprotect per guard page, page faults on fresh memory, the munmap): most of a small
launch. Kept stacks cost memory maps instead (each stack's guard page splits the mapping: two maps
per thread of the biggest block, per worker thread), and every kernel library loaded into a process
has its own workers; kept by every library, a test process that loads a few dozen of them reaches
vm.max_map_count (65,530) and the next dlopen fails ("failed to map segment from shared object").
So the libraries launched most recently keep theirs while their maps together stay within a
budget, and the least recently launched give theirs back (`kgen_keep_stacks` in the library,
kgen/compile/host.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

# An eighth of Linux's default vm.max_map_count (the rest stays for libraries, the allocator,
# torch): 4,096 stacks, e.g. 16 libraries of 128-thread blocks on 2 workers. Only the pages a
# kernel touched are resident (MAP_NORESERVE), a few KiB per stack for kgen's kernels.
MAP_BUDGET = 8192



class Library(Protocol):
    def keep_stacks(self, keep: int) -> int:
        """The library's kgen_keep_stacks: keep (1), release (0), ask (-1); returns the maps held."""


class StackKeeper:
    """Libraries keeping their stacks, least recently launched first, with the maps each holds."""

    def __init__(self, budget: int = MAP_BUDGET):
        self.budget = budget
        self._held: OrderedDict[Library, int] = OrderedDict()
        self._lock = threading.Lock()

    def before_launch(self, lib: Library) -> None:
        """A library is about to launch: it keeps its stacks from now on (if it did not already)."""
        with self._lock:
            if lib in self._held:
                self._held.move_to_end(lib)
                return
            self._held[lib] = 0
        lib.keep_stacks(1)

    def after_launch(self, lib: Library) -> None:
        """A library has launched: note the maps its stacks hold now, and release the stacks of the
        least recently launched libraries (this one last) until the kept maps fit the budget."""
        maps = lib.keep_stacks(-1)
        evict: list[Library] = []
        with self._lock:
            self._held[lib] = maps
            self._held.move_to_end(lib)
            total = sum(self._held.values())
            for other in list(self._held):
                if total <= self.budget:
                    break
                total -= self._held.pop(other)
                evict.append(other)
        for other in evict:
            other.keep_stacks(0)

    def held_maps(self) -> int:
        """The maps the kept stacks held after each library's last launch."""
        with self._lock:
            return sum(self._held.values())


KEEPER = StackKeeper()
