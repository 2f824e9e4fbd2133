"""Hand-written kernels (e.g. from an AI assistant) verified against a spec's ABI (docs/abi.md).

The file must define `extern "C" __global__ void <spec name>(...)` with the exact
signature printed by `kgen abi SPEC`; kgen compiles it for the spec's targets
(resources), builds it for the chosen backend and runs the same case matrix
(docs/verification.md).
"""

from __future__ import annotations

from pathlib import Path

from kgen.build import compile_cubins, load_module, select_backend
from kgen.compile.launch_contract import check_source_contract
from kgen.compile.nvrtc import resources_as_dict
from kgen.errors import KgenUserError
from kgen.families.base import Config, resolve_config
from kgen.families.registry import family_for
from kgen.kernel import Kernel
from kgen.render import Rendered
from kgen.verify.untrusted.signature import check_signature
from kgen.verify.untrusted.source_policy import prepare_source


def build_from_source(spec, path: Path, backend: str = "auto") -> Kernel:
    try:
        source = Path(path).read_text()
    except OSError as e:
        raise KgenUserError(f"{path}: cannot read the kernel source ({e.strerror})") from None
    return kernel_from_source(spec, source, backend=backend, origin=str(path))


def kernel_from_source(spec, source: str, backend: str = "auto", config: Config | None = None,
                       archs: list[str] | None = None, origin: str = "<source>") -> Kernel:
    """A Kernel over `source` with the spec's ABI. Without `config`, the launch of the ABI
    contract (the family's abi_config) that a hand-written kernel implements; cubins for
    `archs` (default: the spec's targets) give its resources."""
    # Source policy (kgen/verify/untrusted/source_policy.py): kernel code only, and one preprocessed text
    # that NVRTC and g++ both compile; a violation exits 2 naming the file and line.
    prepared = prepare_source(source, origin)
    family = family_for(spec)
    config = resolve_config(family, spec, family.abi_config(spec) if config is None else config)
    names = family.kernel_names(spec, config)
    missing = [n for n in names if f"{n}(" not in source.replace(" (", "(")]
    if missing:
        raise KgenUserError(
            f"{origin}: defines no kernel named {', '.join(missing)}; it must declare "
            f'extern "C" __global__ void {names[0]}(...) with the signature of `kgen abi {spec.source_path or spec.name}`'
        )
    rendered = Rendered(prepared.text, names, config)
    cubins = compile_cubins(spec, rendered, archs)
    chosen = select_backend(backend)
    # Untrusted: its own process; on the CPU also race detection and varied thread schedules.
    module = load_module(chosen, rendered, cubins, isolated=True, race_check=chosen == "cpu")
    check_signature(spec, config, module, origin)
    # Then each cubin's own parameter table against what the CUDA launcher packs, and the launch's
    # shared memory against the arch (kgen/compile/launch_contract.py; needs cuobjdump): the check
    # a CUDA module cannot make (it reports no parameter types), and what only a cubin shows.
    check_source_contract(spec, config, cubins, origin)
    return Kernel(spec, source, config, module, names,
                  resources={arch: resources_as_dict(a.resources) for arch, a in cubins.items()},
                  artifacts={"cubins": cubins})
