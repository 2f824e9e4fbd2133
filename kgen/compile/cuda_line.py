"""The CUDA line kgen runs on (cu12 or cu13), what the installed driver supports, and whether the
cubins kgen compiles can be loaded by it.

A line is one consistent set of NVIDIA's wheels, installed as one extra (`pip install 'kgen[cu13]'`,
the default, or `'kgen[cu12]'`): CuPy built for that CUDA major (it carries the CUDA runtime kgen
launches through), NVRTC of that major (it compiles kgen's cubins) and the CUDA headers of that major
(cuda_fp16.h & co., the crt/ headers and CCCL's <nv/target>, which the CPU backend's g++ needs too).
Mixing majors breaks in ways that surface late: CuPy for CUDA 13 does not start on a CUDA 12 driver,
and a cubin from NVRTC 13 does not load on one either.

The loading rules implemented here, from NVIDIA's "CUDA Compatibility" guide
(docs.nvidia.com/deploy/cuda-compatibility: "Minor Version Compatibility", and the CUDA C++
Programming Guide's "Binary Compatibility" / "PTX Compatibility"):

- Backward compatibility: a driver loads cubins built by the toolkit of its own CUDA version or any
  older one, across majors (a CUDA 13 driver loads NVRTC 12.x cubins).
- Minor version compatibility (CUDA 11 and later): a cubin from toolkit X.y loads on any driver of the
  same major X, even one older than X.y (CUDA 12.x needs a driver >= 525, CUDA 13.x >= 580): the
  driver's CUDA major must be at least NVRTC's major. An older major never loads it (a CUDA 12 driver
  refuses NVRTC 13's cubins).
- PTX is outside minor version compatibility: the driver JIT-compiles only PTX of an ISA version it
  knows, so PTX from NVRTC X.y needs a driver whose CUDA version is at least X.y (else
  CUDA_ERROR_UNSUPPORTED_PTX_VERSION at load time). PTX from NVRTC 12.x is JIT-compiled by any newer
  driver, 13.x included.
- Arch-specific targets (sm_90a, for wgmma) run only on that exact compute capability.

So for every driver, a cubin (SASS for the device's arch) from a given NVRTC loads wherever that
NVRTC's PTX would, and on some drivers where the PTX would not: kgen emits cubins only
(`loadable_targets` says which of the two a driver could take; `choose_target` picks). Where the driver's
major is older than NVRTC's, nothing NVRTC emits loads, and `require_loadable` refuses before the load
with both versions and the extra to install.

`describe()` is the report `kgen env` prints and `kgen selftest` records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from kgen.errors import ToolchainError

Version = tuple[int, int]  # (major, minor) of a CUDA version


@dataclass(frozen=True)
class CudaLine:
    name: str  # the extra that installs it: kgen[<name>]
    major: int  # the CUDA major of every wheel in the set
    cupy: str  # CuPy's distribution for this major
    nvrtc: str  # NVRTC's distribution
    nvrtc_dir: str  # where that wheel puts libnvrtc, relative to site-packages
    # (distribution, include directory relative to site-packages) of the headers, in -I order
    headers: tuple[tuple[str, str], ...]
    min_linux_driver: int  # the oldest driver branch of this major (minor version compatibility)

    @property
    def extra(self) -> str:
        return f"kgen[{self.name}]"

    @property
    def install(self) -> str:
        return f"pip install '{self.extra}'"

    @property
    def distributions(self) -> tuple[str, ...]:
        return (self.cupy, self.nvrtc, *dict.fromkeys(d for d, _ in self.headers))


# The sets pyproject.toml's extras install (tests/compile/test_cuda_line.py checks they agree).
LINES: dict[str, CudaLine] = {
    "cu13": CudaLine(
        "cu13", 13, "cupy-cuda13x", "nvidia-cuda-nvrtc", "nvidia/cu13/lib",
        # CUDA 13's runtime, crt and CCCL wheels share one include directory.
        (("nvidia-cuda-runtime", "nvidia/cu13/include"), ("nvidia-cuda-crt", "nvidia/cu13/include"),
         ("nvidia-cuda-cccl", "nvidia/cu13/include")),
        580),
    "cu12": CudaLine(
        "cu12", 12, "cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia/cuda_nvrtc/lib",
        # CUDA 12's wheels each have their own: crt/ ships with nvcc's wheel, <nv/target> with CCCL's.
        (("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/include"),
         ("nvidia-cuda-nvcc-cu12", "nvidia/cuda_nvcc/include"),
         ("nvidia-cuda-cccl-cu12", "nvidia/cuda_cccl/include")),
        525),
}
DEFAULT_LINE = "cu13"
_BY_MAJOR = {line.major: line for line in LINES.values()}


def install_hint() -> str:
    return " or ".join(f"{line.install} (driver >= {line.min_linux_driver}, CUDA {line.major})"
                       for line in LINES.values())


def parse_version(text: str) -> Version:
    """(major, minor) of a distribution's or library's version text ("13.0.88" -> (13, 0))."""
    m = re.match(r"(\d+)\.(\d+)", text)
    if not m:
        raise ValueError(f"not a CUDA version: {text!r} (expected MAJOR.MINOR...)")
    return int(m[1]), int(m[2])


def parse_driver_version(raw: int) -> Version | None:
    """The CUDA version of cudaDriverGetVersion's integer (1000 * major + 10 * minor), or None for 0,
    which the runtime reports where no driver is installed."""
    if raw < 0:
        raise ValueError(f"driver version {raw} is negative")
    return None if raw == 0 else (raw // 1000, raw % 1000 // 10)


def show(version: Version | None) -> str:
    return "none" if version is None else f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class Resolution:
    line: CudaLine | None  # None: no line's CuPy or NVRTC is installed
    nvrtc: Version | None  # the line's NVRTC wheel's version
    problems: tuple[str, ...]  # an inconsistent set, each with the way out

    @property
    def consistent(self) -> bool:
        return self.line is not None and not self.problems


def installed_versions() -> dict[str, str]:
    """The installed version of each distribution a line is made of (absent ones left out)."""
    return dict(_installed())


@lru_cache(maxsize=1)
def _installed() -> tuple[tuple[str, str], ...]:  # read once per process: a launch path asks for it
    found = {}
    for name in dict.fromkeys(d for line in LINES.values() for d in line.distributions):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return tuple(found.items())


def resolve_line(installed: Mapping[str, str]) -> Resolution:
    """The line the installed distributions (name -> version) make up, and what is wrong with the set.

    CuPy decides (it is the runtime kernels launch through): two CuPy builds cannot both be installed,
    as they share the `cupy` package. Without CuPy (compiling only, the CPU backend), the line whose
    NVRTC is installed; both (torch pulls in NVRTC 12 for itself): the default line."""
    cupys = [line for line in LINES.values() if line.cupy in installed]
    nvrtcs = [line for line in LINES.values() if line.nvrtc in installed]
    problems = []
    if len(cupys) > 1:
        names = " and ".join(f"{line.cupy} {installed[line.cupy]}" for line in cupys)
        problems.append(f"{names} are both installed, and they overwrite each other's `cupy` package: "
                        f"uninstall both, then install one line ({install_hint()})")
    if cupys:
        line = cupys[0]
    elif nvrtcs:
        line = LINES[DEFAULT_LINE] if LINES[DEFAULT_LINE] in nvrtcs else nvrtcs[0]
    else:
        return Resolution(None, None, (f"no CUDA line is installed: {install_hint()}",))
    missing = [d for d in line.distributions if d not in installed]
    if missing:
        problems.append(f"the {line.name} line is incomplete ({', '.join(missing)} not installed): "
                        f"{line.install}")
    nvrtc = parse_version(installed[line.nvrtc]) if line.nvrtc in installed else None
    if nvrtc is not None and nvrtc[0] != line.major:
        problems.append(f"{line.nvrtc} {installed[line.nvrtc]} is not CUDA {line.major}'s NVRTC: {line.install}")
    return Resolution(line, nvrtc, tuple(problems))


def current() -> Resolution:
    return resolve_line(installed_versions())


def loadable_targets(nvrtc: Version, driver: Version | None) -> tuple[str, ...]:
    """Which of NVRTC's outputs the driver can load: "cubin" (SASS) when the driver's major is at
    least NVRTC's (backward and minor version compatibility), "ptx" when the driver's whole version
    is (the PTX JIT takes only ISA versions it knows). No driver: nothing loads."""
    if driver is None:
        return ()
    return (("cubin",) if driver[0] >= nvrtc[0] else ()) + (("ptx",) if driver >= nvrtc else ())


def mismatch(nvrtc: Version, driver: Version | None) -> str | None:
    """Why NVRTC `nvrtc`'s output cannot load on `driver` (with what to install), or None when it can
    or when there is no driver (then nothing is loaded, and compiling needs none)."""
    if driver is None or loadable_targets(nvrtc, driver):
        return None
    fix = _BY_MAJOR.get(driver[0])
    way_out = (f"install the CUDA {driver[0]} line: {fix.install} (in a fresh environment, or after "
               "uninstalling the other line's CuPy), or upgrade the driver"
               if fix else f"upgrade the driver (kgen's lines need {install_hint()})")
    return (f"the driver supports CUDA {show(driver)}, older than the CUDA {nvrtc[0]} of NVRTC {show(nvrtc)} that "
            f"compiles kgen's kernels: a CUDA {driver[0]} driver cannot load its cubins or its PTX; {way_out}")


def choose_target(nvrtc: Version, driver: Version | None) -> str:
    """What kgen emits for a device: a cubin wherever anything loads (see the module's rules: never
    less loadable than PTX), else a ToolchainError saying why and what to install. No driver: a cubin
    (compiling names its arch and needs no driver)."""
    problem = mismatch(nvrtc, driver)
    if problem:
        raise ToolchainError(problem)
    return "cubin"


def query_driver() -> tuple[Version | None, str]:
    """(the driver's CUDA version or None, how that was learnt) through CuPy's runtime."""
    try:
        import cupy
        raw = int(cupy.cuda.runtime.driverGetVersion())
    except Exception as e:  # no CuPy, a CuPy that cannot load its runtime, a runtime error
        return None, f"no driver ({type(e).__name__}: {e})"
    driver = parse_driver_version(raw)
    return driver, "no driver (cudaDriverGetVersion: 0)" if driver is None else "cudaDriverGetVersion"


def require_loadable() -> None:
    """Before loading a cubin: refuse, naming both versions and the extra to install, where the
    installed line's cubins cannot load on this driver (instead of CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    from the load), or where the installed set is inconsistent."""
    res = current()
    if res.problems:
        raise ToolchainError("; ".join(res.problems))
    if res.nvrtc is not None:
        choose_target(res.nvrtc, query_driver()[0])


class LineWarning(UserWarning):
    """A GPU driver is present, but the installed CUDA line cannot use it (kgen runs on the CPU)."""


def driver_mismatch() -> str | None:
    """Why the installed line's NVRTC output cannot load on this machine's driver (with the extra
    to install), or None: no driver, no line, or they agree. Where CuPy of a newer major than the
    driver's cannot even start, the driver's version still tells the right line."""
    res = current()
    return mismatch(res.nvrtc, query_driver()[0]) if res.nvrtc is not None else None


def _site_dir(distribution: str, relative: str) -> Path | None:
    try:
        path = Path(str(metadata.distribution(distribution).locate_file(relative)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_dir() else None


def nvrtc_library(res: Resolution | None = None) -> Path | None:
    """libnvrtc of the resolved line's wheel (None: no such wheel; then the caller searches as
    cuda-pathfinder does). Named by line, not found first-come: torch may install another major's."""
    res = res or current()
    if res.line is None:
        return None
    folder = _site_dir(res.line.nvrtc, res.line.nvrtc_dir)
    pattern = re.compile(rf"(lib)?nvrtc(\.so\.{res.line.major}|64_{res.line.major}\d_0\.dll)\Z")
    hits = sorted(p for p in folder.iterdir() if pattern.match(p.name)) if folder else []
    return hits[0] if hits else None


def include_dirs(res: Resolution | None = None) -> tuple[Path, ...]:
    """The resolved line's header directories, in -I order (empty: its wheels are not installed)."""
    res = res or current()
    if res.line is None:
        return ()
    found = (_site_dir(dist, rel) for dist, rel in res.line.headers)
    return tuple(dict.fromkeys(p for p in found if p is not None))


def describe() -> dict[str, Any]:
    """What `kgen env` prints and `kgen selftest` records: the line in use, its distributions and
    NVRTC, the driver's CUDA version, which targets it loads and what is wrong, as plain data.

    Keys: line ("cu12" | "cu13" | None), default_line, extra (what installs the line),
    distributions (name -> version, the line's), nvrtc ("13.0"), driver ("12.8" | None),
    driver_source (how it was learnt, or why there is none), loadable (targets the driver loads:
    ["cubin", "ptx"]), target ("cubin" | None), problems (each with its way out)."""
    res = current()
    installed = installed_versions()
    driver, source = query_driver()
    problems = list(res.problems)
    loadable: tuple[str, ...] = ()
    if res.nvrtc is not None:
        loadable = loadable_targets(res.nvrtc, driver)
        if problem := mismatch(res.nvrtc, driver):
            problems.append(problem)
    return {
        "line": res.line.name if res.line else None,
        "default_line": DEFAULT_LINE,
        "extra": res.line.extra if res.line else None,
        "distributions": {d: installed[d] for d in (res.line.distributions if res.line else ()) if d in installed},
        "nvrtc": show(res.nvrtc) if res.nvrtc else None,
        "driver": show(driver) if driver else None,
        "driver_source": source,
        "loadable": list(loadable),
        "target": "cubin" if "cubin" in loadable else None,
        "problems": problems,
    }
