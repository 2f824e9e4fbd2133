"""The launch contract, checked against the cubin: what kgen's CUDA launcher packs for a kernel
equals the kernel's own parameter table, and its shared memory fits the arch.

A kernel launch hands the driver one pointer per parameter; the driver copies each parameter's
bytes from there into the parameter bank at the offsets *the cubin* records. When the launcher's
idea of the list differs from the compiled kernel's (a parameter fewer, an int where the kernel
takes a pointer, a reordered pair), the kernel reads garbage and only a GPU shows it. This module
compares, without a GPU:

- the launcher's side: the family's kernel declarations (argument table, block size, dynamic
  shared memory: kgen/families/argtable.py `KernelDecl`), packed by the launcher's own `pack`
  with the values the CUDA call binding makes (`CallBinder.pointer` on a CUDA device:
  np.uint64 addresses; by-value parameters as their numpy type), each value laid out as
  CudaModule hands it to CuPy (kgen.runtime.cuda.argument_layout) at C ABI offsets;
- the cubin's side: `cuobjdump -elf`, the kernel's `.nv.info.<kernel>` section, one
  EIATTR_KPARAM_INFO entry per parameter (ordinal, offset, size) and EIATTR_CBANK_PARAM_SIZE;
- each launch's shared memory (ptxas' static figure + the declaration's dynamic bytes, threads
  and registers) against the arch table (kgen.plan.arch.launch_problems, as the launcher opts in).

    problems = contract_problems(spec, config, cubins)   # [] when it holds; each names the
                                                           # kernel, arch, ordinal, expected vs actual
Used by tests/compile/test_launch_contract.py on every bundled spec and by kgen verify --source
(kgen/verify/untrusted/handwritten.py) on a hand-written kernel's cubins. cuobjdump comes from the
nvidia-cuda-cuobjdump wheel (the test extra) or PATH; without it `cuobjdump()` is None and
check_source_contract skips the check.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kgen.abi import ABI_VERSION
from kgen.bodies import spec_for_arch
from kgen.build import compile_cubins
from kgen.errors import KgenUserError, ToolchainError
from kgen.families.argtable import KernelDecl, pack
from kgen.families.base import Config, resolve_config
from kgen.families.binding import CallBinder
from kgen.families.registry import family_for
from kgen.plan.arch import launch_problems
from kgen.render import render
from kgen.runtime.cuda import argument_layout
from kgen.spec.models import load_spec


@dataclass(frozen=True)
class Param:
    """One kernel parameter as laid out in the parameter bank."""

    ordinal: int
    offset: int
    size: int
    align: int = 0  # the launcher's side only (the cubin records offsets, not alignments)
    name: str = ""  # the launcher's side: the ABI name
    ctype: str = ""  # the launcher's side: the C type the ABI gives it


@dataclass(frozen=True)
class CubinKernel:
    params: tuple[Param, ...]  # by ordinal
    param_bytes: int | None  # EIATTR_CBANK_PARAM_SIZE, when present


def cuobjdump() -> str | None:
    """The cuobjdump of the nvidia-cuda-cuobjdump wheel, else one on PATH, else None."""
    try:
        files = importlib.metadata.distribution("nvidia-cuda-cuobjdump").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [str(f.locate()) for f in files if f.name == "cuobjdump"]
    return found[0] if found else shutil.which("cuobjdump")


_SECTION = re.compile(r"^\.nv\.info\.(\S+)\s*$")
_KPARAM = re.compile(r"Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*(0x[0-9a-f]+)\s+Size\s*:\s*(0x[0-9a-f]+)", re.I)


def parse_elf_listing(listing: str) -> dict[str, CubinKernel]:
    """{kernel: its parameter table} from `cuobjdump -elf` text: the EIATTR_KPARAM_INFO entries
    (ordinal, offset, size) and EIATTR_CBANK_PARAM_SIZE of each `.nv.info.<kernel>` section."""
    params: dict[str, list[Param]] = {}
    sizes: dict[str, int] = {}
    kernel, attribute = None, None
    for line in listing.splitlines():
        m = _SECTION.match(line.strip())
        if m:
            kernel, attribute = m.group(1), None
            params.setdefault(kernel, [])
            continue
        if kernel is None:
            continue
        if line.strip() and not line[0].isspace():  # another section starts
            kernel = None
            continue
        if "Attribute:" in line:
            attribute = line.split("Attribute:", 1)[1].strip()
        elif "Value:" in line and attribute == "EIATTR_KPARAM_INFO":
            k = _KPARAM.search(line)
            if k:
                params[kernel].append(Param(*(int(v, 16) for v in k.groups())))
        elif "Value:" in line and attribute == "EIATTR_CBANK_PARAM_SIZE":
            sizes[kernel] = int(line.split("Value:", 1)[1].split()[0], 16)
    return {name: CubinKernel(tuple(sorted(ps, key=lambda p: p.ordinal)), sizes.get(name))
            for name, ps in params.items()}


def cubin_kernels(cubin: bytes, tool: str | None = None) -> dict[str, CubinKernel]:
    """The parameter tables of every kernel of `cubin` (cuobjdump -elf)."""
    tool = tool or cuobjdump()
    if tool is None:
        raise ToolchainError("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump, kgen's test extra)")
    with tempfile.TemporaryDirectory(prefix="kgen-contract-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        run = subprocess.run([tool, "-elf", str(path)], capture_output=True, text=True)
    if run.returncode != 0:
        raise ToolchainError(f"cuobjdump -elf failed: {run.stderr.strip()[:500]}")
    return parse_elf_listing(run.stdout)


def launcher_params(spec, decl: KernelDecl) -> tuple[Param, ...]:
    """The parameters CudaModule passes for `decl`: the launcher's `pack` of the values a CUDA call
    binding makes (a null device address for each pointer, 0 for each by-value parameter), each
    laid out as CuPy passes it, at the offset the C ABI gives it (aligned to its alignment)."""
    binder = CallBinder(spec, {})
    binder.device = "cuda"
    values = {a.name: binder.pointer(None) if a.pointer else 0 for a in decl.params}
    out, offset = [], 0
    for i, (arg, value) in enumerate(zip(decl.params, pack(decl.params, values), strict=True)):
        size, align = argument_layout(value)
        offset = -(-offset // align) * align
        out.append(Param(i, offset, size, align, arg.name, arg.ctype))
        offset += size
    return tuple(out)


def _describe(p: Param) -> str:
    return f"{p.size} bytes at offset {p.offset}"


def _named(p: Param) -> str:
    return f"parameter ordinal {p.ordinal} '{p.name}'" + (f" (`{p.ctype}` under kgen ABI {ABI_VERSION})" if p.ctype else "")


def param_problems(kernel: str, arch: str, ours: tuple[Param, ...], theirs: CubinKernel) -> list[str]:
    """Where the launcher's parameter list differs from the cubin's (count, then each ordinal)."""
    where = f"kernel '{kernel}' ({arch} cubin)"
    problems = []
    if len(ours) != len(theirs.params):
        problems.append(f"{where}: the launcher packs {len(ours)} arguments, the cubin's kernel takes "
                        f"{len(theirs.params)} parameters")
    by_ordinal = {p.ordinal: p for p in theirs.params}
    for p in ours:
        got = by_ordinal.get(p.ordinal)
        if got is None:
            problems.append(f"{where}: {_named(p)}: the launcher packs {_describe(p)}, the cubin has no such "
                            "parameter")
        elif (got.offset, got.size) != (p.offset, p.size):
            problems.append(f"{where}: {_named(p)}: expected {_describe(p)} (what the launcher packs), the cubin "
                            f"has {_describe(got)}")
    for got in theirs.params[len(ours):]:
        problems.append(f"{where}: parameter ordinal {got.ordinal} ({_describe(got)}) is not packed by the launcher")
    end = max((p.offset + p.size for p in ours), default=0)
    if not problems and theirs.param_bytes is not None and theirs.param_bytes != end:
        problems.append(f"{where}: the launcher packs {end} bytes of parameters, the cubin's parameter bank "
                        f"holds {theirs.param_bytes}")
    return problems


def contract_problems(spec, config: Config, cubins: dict, tool: str | None = None, bodies: bool = False) -> list[str]:
    """Every way the launches of `spec` with `config` break their cubins' contract: for each arch
    of `cubins` ({arch: CubinArtifact}) and each kernel the family declares, the packed argument
    list against the cubin's parameter table, and the launch's threads, registers and shared
    memory (ptxas' static + the declared dynamic) against the arch's limits. [] when it holds.
    `bodies`: each cubin holds its arch's own body (kgen's kernels, kgen/bodies.py), whose launch
    is that body's; else one source for every arch (a hand-written kernel)."""
    problems = []
    for arch, art in cubins.items():
        decls = family_for(spec).kernels(spec_for_arch(spec, arch) if bodies else spec, config)
        table = cubin_kernels(art.cubin, tool)
        for decl in decls:
            if decl.name not in table:
                problems.append(f"kernel '{decl.name}' ({arch} cubin): not in the cubin "
                                f"(it has {', '.join(sorted(table)) or 'no kernels'})")
                continue
            problems += param_problems(decl.name, arch, launcher_params(spec, decl), table[decl.name])
            res = art.resources.get(decl.name)
            problems += launch_problems(arch, decl.name, decl.block, res.registers if res else 0,
                                        res.static_smem if res else 0, decl.smem, decl.launch_registers)
    return problems


def check_source_contract(spec, config: Config, cubins: dict, origin: str) -> None:
    """A hand-written kernel's cubins against the launch contract (kgen verify --source): a
    KgenUserError naming the kernel, the parameter and expected vs actual when it breaks; skipped
    where cuobjdump is not installed."""
    tool = cuobjdump()
    if tool is None or not cubins:
        return
    problems = contract_problems(spec, config, cubins, tool)
    if problems:
        shown = "\n  ".join(problems[:12])
        raise KgenUserError(f"{origin}: the compiled kernel does not take the arguments kgen launches it with "
                            f"under kgen ABI {ABI_VERSION} (`kgen abi {spec.source_path or spec.name}` prints the "
                            f"signature):\n  {shown}")


def main(argv: list[str] | None = None) -> int:
    """python -m kgen.compile.launch_contract SPEC...: the contract of each spec's default config
    (and its single-pass config, where that differs) on every target arch."""
    failed = 0
    for path in argv if argv is not None else sys.argv[1:]:
        spec = load_spec(path)
        family = family_for(spec)
        configs = [resolve_config(family, spec, None)]
        abi = resolve_config(family, spec, family.abi_config(spec))
        configs += [abi] if abi != configs[0] else []
        for config in configs:
            rendered = render(spec, config)
            problems = contract_problems(spec, config, compile_cubins(spec, rendered), bodies=True)
            kernels = ", ".join(f"{d.name} ({len(d.params)} params, {d.smem} B dynamic smem)"
                                for d in family.kernels(spec, config))
            verdict = "ok" if not problems else "BROKEN"
            print(f"{spec.name} [{', '.join(spec.targets)}] {verdict}: {kernels}")
            for p in problems:
                print(f"  {p}")
            failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
