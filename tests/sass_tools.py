"""What the tests of the SASS-reading models share (tests/benchmarks, tests/cli/test_perf.py): the usable
cuobjdump, the skip mark without one, and small cuobjdump-style listings written by hand."""

from __future__ import annotations

import pytest

from kgen.perf.sass import usable_cuobjdump

CUOBJDUMP = usable_cuobjdump()
needs_sass = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump with nvdisasm is not installed "
                                "(the test extra's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)")


def listing(name: str, rows: list[tuple[str, int, int]]) -> str:
    """A cuobjdump-style listing: (instruction, scoreboard set, wait mask) per row, 16 bytes apart."""
    lines = ["\tcode for sm_90", f"\t\tFunction : {name}"]
    for i, (text, wbar, wait) in enumerate(rows):
        hi = ((wait << 11) | (wbar << 5)) << 41
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;    /* 0x0000000000000000 */")
        lines.append(f"                                                      /* 0x{hi:016x} */")
    return "\n".join(lines) + "\n"
