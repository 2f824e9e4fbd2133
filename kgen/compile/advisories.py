"""ptxas as a witness: the performance advisories in its `-v` output, as data.

ptxas prints numbered advisories ("ptxas info : (C7520) Potential Performance Loss: wgmma.mma_async
instructions are serialized due to ... in the function 'NAME'", "(C7519) warpgroup.arrive is injected
...") where it had to give up performance to keep a kernel correct, and a resource report per entry
function whose stack frame and spills are local-memory traffic. Each becomes an Advisory(code,
message, kernel): ptxas's own code for the numbered ones, "stack", "spill" or "local" for those read
from the resource report. kgen reports them (`kgen build`, Kernel.resources, the manifest), the tuner
prunes configs that draw one, and the prefill performance model charges serialised wgmma.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Codes read from the resource report rather than printed by ptxas.
STACK, SPILL, LOCAL = "stack", "spill", "local"
# The advisory that says the wgmma of a function run one after another (no overlap of batches).
WGMMA_SERIALIZED = "C7520"

_NUMBERED = re.compile(r"^ptxas\s+(?:info|warning)\s*:\s*\((C\d{4})\)\s*(.*?)\s*$")
_FUNCTION = re.compile(r"function '(\w+)'")


@dataclass(frozen=True)
class Advisory:
    code: str     # "C7520", or STACK / SPILL / LOCAL
    message: str  # ptxas's text after the code, or what the resource report showed
    kernel: str   # the entry function it is about ("" when ptxas named none)

    def __str__(self) -> str:
        return f"{self.kernel + ': ' if self.kernel else ''}{self.code} {self.message}"


def numbered_advisories(log: str, current: str | None = None) -> list[tuple[int, Advisory]]:
    """(line index, Advisory) of each numbered ptxas advisory in `log`; the kernel is the function the
    message names, else `current` (the entry function being compiled, when the caller tracks it)."""
    out = []
    for i, line in enumerate(log.splitlines()):
        if m := _NUMBERED.match(line.strip()):
            named = _FUNCTION.search(m.group(2))
            out.append((i, Advisory(m.group(1), m.group(2), named.group(1) if named else (current or ""))))
    return out


def resource_advisories(kernel: str, stack_frame: int, spill_stores: int, spill_loads: int,
                        local_bytes: int = 0) -> list[Advisory]:
    """Local-memory use the resource report shows for one entry function."""
    out = []
    if spill_stores or spill_loads:
        out.append(Advisory(SPILL, f"{spill_stores} bytes spill stores, {spill_loads} bytes spill loads "
                                   "(registers spilled to local memory)", kernel))
    if stack_frame:
        out.append(Advisory(STACK, f"{stack_frame} bytes stack frame (local memory)", kernel))
    if local_bytes:
        out.append(Advisory(LOCAL, f"{local_bytes} bytes lmem (local memory)", kernel))
    return out


def advisories_of(resources: dict) -> list[dict]:
    """Every advisory in a Kernel's `resources` ({arch: {kernel: {..., "advisories": [...]}}}), each
    with its arch: [{"arch", "code", "message", "kernel"}]."""
    return [{"arch": arch, **a} for arch, kernels in resources.items() for figures in kernels.values()
            for a in figures.get("advisories", [])]


def describe(advisories: list[dict]) -> str:
    """One line for a list of advisories_of's entries (a pruning reason, a report line)."""
    return "; ".join(f"{a['arch']} {a['kernel']}: {a['code']} {a['message']}" for a in advisories)
