"""Fiber stacks kept between launches (kgen/runtime/fiber_stacks.py and the runtime's keep_stacks)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest

from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule
from kgen.runtime.fiber_stacks import KEEPER, MAP_BUDGET

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")

SRC = r"""
extern "C" __global__ void __launch_bounds__(1024) stamp(int* out, int v) {
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = v + (int)threadIdx.x;
}
"""
THREADS = 1024  # two maps per thread and worker: a guard page splits each stack's mapping


@pytest.fixture(scope="module")
def mod() -> CpuModule:
    return CpuModule.from_source(SRC, ["stamp"], workers=1)


def _process_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _stamp(m: CpuModule, v: int, blocks: int = 2) -> None:
    out = np.zeros(blocks * THREADS, np.int32)
    m.launch(Launch("stamp", (blocks, 1, 1), (THREADS, 1, 1), 0, [out, np.int32(v)]))
    np.testing.assert_array_equal(out, np.tile(np.arange(THREADS, dtype=np.int32) + v, blocks))


def test_a_library_keeps_its_stacks_between_launches(mod):
    """The second launch of a block size maps nothing: it runs on the stacks the first one left."""
    _stamp(mod, 1)
    held = mod._lib.keep_stacks(-1)
    before = _process_maps()
    _stamp(mod, 2)
    after = _process_maps()
    assert held >= 2 * THREADS, f"{held} maps of kept stacks after a {THREADS}-thread launch"
    assert after - before < 64, f"{after - before} mappings added by a launch on kept stacks"
    assert mod._lib.keep_stacks(-1) == held


def test_libraries_launched_least_recently_give_their_stacks_back(mod, tmp_path):
    """Copies of one library loaded from different paths are separate libraries, each with its own
    worker and stacks (2,048 maps here). Kept by all of them, their maps would pass the budget (and,
    a few dozen libraries later, vm.max_map_count); the least recently launched ones release theirs."""
    copies = []
    for i in range(MAP_BUDGET // (2 * THREADS) + 2):
        path = tmp_path / f"copy{i}" / mod.artifact.library.name
        path.parent.mkdir()
        shutil.copy(mod.artifact.library, path)
        copies.append(CpuModule(dataclasses.replace(mod.artifact, library=path, cache_hit=False), workers=1))
    before = _process_maps()
    for i, m in enumerate(copies):
        _stamp(m, 10 * i)
    after = _process_maps()
    assert KEEPER.held_maps() <= MAP_BUDGET
    assert after - before < MAP_BUDGET + 1024, f"{after - before} mappings added by {len(copies)} libraries"
    assert copies[-1]._lib.keep_stacks(-1) >= 2 * THREADS  # the most recent keeps its stacks
    assert copies[0]._lib.keep_stacks(-1) == 0  # the least recent gave them back
    _stamp(copies[0], 7)  # and launches again, keeping them anew
    assert copies[0]._lib.keep_stacks(-1) >= 2 * THREADS
    assert KEEPER.held_maps() <= MAP_BUDGET
