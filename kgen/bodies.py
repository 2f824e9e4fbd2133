"""Each target arch's body (docs/pipeline.md, "Each arch's body"): a spec renders once per arch it is
built for, with the family seeing that arch alone as the spec's targets, so every arch gets the best
body it can run (paged_prefill: the Hopper wgmma body on sm_90, mma.sync on sm_80) and one Kernel
runs the body of the device's arch. This module holds the rules that pick an arch's body and the
device's; rendering is kgen/render.py's and compiling kgen/build.py's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def arch_number(arch: str) -> int:
    """sm_90 -> 90 (sm_90a -> 90)."""
    return int("".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit()) or 0)


def spec_for_arch(spec, arch: str | None):
    """The spec as the family sees it when rendering `arch`'s body: targets [arch] (its shared memory
    limit, its instructions). None: the spec as given (a hand-written source: one body everywhere)."""
    if arch is None or list(spec.targets) == [arch]:
        return spec
    narrowed = spec.model_copy(update={"targets": [arch]})
    narrowed._source_path = spec.source_path  # a private attribute: model_copy's update does not reach it
    return narrowed


def newest(archs: Iterable[str]) -> str:
    """The newest of `archs` (the default body: what the CPU backend runs)."""
    archs = list(archs)
    if not archs:
        raise ValueError("newest: no arch given")
    return max(archs, key=arch_number)


def oldest(archs: Iterable[str]) -> str:
    """The oldest of `archs`: its body compiles for every newer one (`kgen show`'s default, the start
    of a hand-written source, which is one body for every target)."""
    archs = list(archs)
    if not archs:
        raise ValueError("oldest: no arch given")
    return min(archs, key=arch_number)


def cpu_arch(archs: Iterable[str], requested: str | None = None) -> str:
    """The arch whose body the CPU backend runs: `requested` when given, else the newest arch built.
    The CPU backend emulates every body (wgmma included), so it takes the one the newest GPU runs;
    verification covers the others too (kgen.build)."""
    return requested or newest(archs)


def dispatch(bodies: Mapping[str, bool], device: str) -> str | None:
    """The built arch whose body a GPU of arch `device` runs. `bodies`: {arch built: whether its body
    is arch-specific (compiled for sm_90a: it runs on sm_90 alone)}. The device's own arch when built;
    else the newest older arch with a portable body (its source compiled for the device: an older
    arch's body uses nothing the newer lacks); None when no built body can run there."""
    if device in bodies:
        return device
    portable = [arch for arch, specific in bodies.items()
                if not specific and arch_number(arch) <= arch_number(device)]
    return max(portable, key=arch_number, default=None)


def groups(sources: Mapping[str, str]) -> list[list[str]]:
    """Archs grouped by identical source (a body shared by several archs is one body), newest first
    within a group, groups in the order of their newest arch, newest first."""
    by_source: dict[str, list[str]] = {}
    for arch, source in sources.items():
        by_source.setdefault(source, []).append(arch)
    out = [sorted(archs, key=arch_number, reverse=True) for archs in by_source.values()]
    return sorted(out, key=lambda g: arch_number(g[0]), reverse=True)
