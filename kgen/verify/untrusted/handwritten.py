"""Hand-written kernels (e.g. from an AI assistant) verified against a spec's ABI (docs/abi.md).

The file must define `extern "C" __global__ void <spec name>(...)` with the exact
signature printed by `kgen abi SPEC` (the single-pass ABI 1 launch), or kgen's own current
signature for the spec's default config, the one `kgen show SPEC` prints (split-KV: a trailing
`int partition_tokens` and a `<name>_merge` kernel): a source that starts from `kgen show`
verifies as is. kgen compiles it for the spec's targets (resources), builds it for the chosen
backend and runs the same case matrix (docs/verification.md).

`load_source` is the service path: the verdict comes from the isolated, race-checked build;
only a source that passed is then built in-process (no child per launch) and handed out as an
ordinary Kernel, like `kgen.build`'s.
"""

from __future__ import annotations

import re
from pathlib import Path

from kgen.build import compile_cubins, load_module, select_backend
from kgen.compile.launch_contract import check_source_contract
from kgen.compile.nvrtc import resources_as_dict
from kgen.errors import KgenUserError, VerificationError
from kgen.families.base import Config, resolve_config
from kgen.families.registry import family_for
from kgen.kernel import Kernel
from kgen.render import Rendered
from kgen.spec.models import load_spec
from kgen.torch_ops import register_if_imported
from kgen.verify.judge.report import describe_failure
from kgen.verify.runner import verify as run_verify
from kgen.verify.untrusted.cxx_text import tokenize
from kgen.verify.untrusted.launch_state import check_cubins
from kgen.verify.untrusted.signature import check_signature
from kgen.verify.untrusted.source_policy import SourcePolicyError, prepare_source


def read_source(path: Path | str) -> str:
    try:
        return Path(path).read_text()
    except UnicodeDecodeError:
        raise KgenUserError(f"{path}: not a text file (a kernel source must be UTF-8 C++ text)") from None
    except OSError as e:
        raise KgenUserError(f"{path}: cannot read the kernel source ({e.strerror})") from None


def build_from_source(spec, path: Path, backend: str = "auto") -> Kernel:
    return kernel_from_source(spec, read_source(path), backend=backend, origin=str(path))


def load_source(spec, path: Path | str, backend: str = "auto", seed: int | None = None,
                archs: list[str] | None = None) -> Kernel:
    """A verified Kernel over the hand-written source at `path` (the spec's ABI, docs/abi.md).

    The verdict is the sandboxed one (`kgen verify --source`: source policy, object check, each
    launch in an isolated child with race detection on the CPU backend, the whole matrix);
    VerificationError (with `.report`) when a case fails, KgenUserError when the source is refused
    (policy, signature, launch contract, unreadable). After it passes, the same preprocessed text
    is built in-process for the backend `kgen.build` would pick and returned with the report,
    registered as torch.ops.kgen.<name> when torch is imported."""
    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    origin = str(path)
    untrusted = kernel_from_source(spec, read_source(path), backend=backend, archs=archs, origin=origin)
    try:
        report = run_verify(untrusted, seed=seed)
    finally:
        close = getattr(untrusted.module, "close", None)
        if close is not None:
            close()
    if not report.passed:
        first = report.failed_cases[0] if report.failed_cases else None
        where = f"; case '{first.name}': {describe_failure(first)}" if first is not None else ""
        raise VerificationError(f"{origin}: {report.summary()}{where}", report)
    rendered = Rendered(untrusted.source, untrusted.kernel_names, untrusted.config)
    module = load_module(untrusted.backend, rendered, untrusted.artifacts.get("cubins"))
    kernel = Kernel(spec, untrusted.source, untrusted.config, module, untrusted.kernel_names,
                    resources=untrusted.resources, report=report, artifacts=untrusted.artifacts)
    kernel.artifacts["origin"] = origin
    register_if_imported(kernel)
    return kernel


def kernel_from_source(spec, source: str, backend: str = "auto", config: Config | None = None,
                       archs: list[str] | None = None, origin: str = "<source>") -> Kernel:
    """A Kernel over `source` with the spec's ABI. Without `config`, the launch of the ABI
    contract (the family's abi_config) that a hand-written kernel implements; cubins for
    `archs` (default: the spec's targets) give its resources."""
    # Source policy (kgen/verify/untrusted/source_policy.py): kernel code only, and one preprocessed text
    # that NVRTC and g++ both compile; a violation exits 2 naming the file and line.
    prepared = prepare_source(source, origin)
    family = family_for(spec)
    config = source_config(spec, prepared.text) if config is None else resolve_config(family, spec, config)
    names = family.kernel_names(spec, config)
    missing = [n for n in names if f"{n}(" not in source.replace(" (", "(")]
    if missing:
        raise KgenUserError(
            f"{origin}: defines no kernel named {', '.join(missing)}{_what_it_is(spec, source, prepared.text)}; "
            f'it must declare extern "C" __global__ void {names[0]}(...) with the signature of '
            f"`kgen abi {spec.source_path or spec.name}`"
        )
    rendered = Rendered(prepared.text, names, config)
    chosen = select_backend(backend)  # a bad backend is refused before any compile
    cubins = compile_cubins(spec, rendered, archs)
    # What the text rules may have missed, as compiled: writable device globals, device-heap calls.
    if problems := check_cubins(cubins, prepared.text, prepared.name):
        raise SourcePolicyError("\n".join(f"{prepared.name}:{line}: {msg}" if line else f"{prepared.name}: {msg}"
                                          for line, msg in dict.fromkeys(problems)))
    # Untrusted: its own process; on the CPU also race detection and varied thread schedules.
    module = load_module(chosen, rendered, cubins, isolated=True, race_check=chosen == "cpu")
    check_signature(spec, config, module, origin)
    # Then each cubin's own parameter table against what the CUDA launcher packs, and the launch's
    # shared memory against the arch (kgen/compile/launch_contract.py; needs cuobjdump): the check
    # a CUDA module cannot make (it reports no parameter types), and what only a cubin shows.
    check_source_contract(spec, config, cubins, origin)
    # The source is what both compilers compiled (preprocessed, includes restored): what a
    # generated/<name>/ package or an in-process build compiles again.
    kernel = Kernel(spec, prepared.text, config, module, names,
                    resources={arch: resources_as_dict(a.resources) for arch, a in cubins.items()},
                    artifacts={"cubins": cubins})
    kernel.handwritten = True
    return kernel


_SHOW_HEADER = re.compile(r"^// Family (\w+); config:", re.M)


def global_kernels(text: str) -> list[str]:
    """The names of the `__global__` functions a preprocessed source defines or declares."""
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in text.split("\n"))
    tokens = tokenize(code)
    names = []
    for i, t in enumerate(tokens):
        if t.text != "__global__":
            continue
        for j in range(i + 1, min(i + 16, len(tokens) - 1)):
            if tokens[j].kind == "id" and tokens[j + 1].text == "(" and tokens[j].text not in ("__launch_bounds__", "__maxnreg__"):
                names.append(tokens[j].text)
                break
    return list(dict.fromkeys(names))


def _what_it_is(spec, source: str, text: str) -> str:
    """What a source that lacks the spec's kernel holds instead: its kernels, and the kind kgen's
    own header (`kgen show`) says it was generated for."""
    found = global_kernels(text)
    parts = [f" (it defines {', '.join(found)})" if found else " (it defines no __global__ kernel)"]
    m = _SHOW_HEADER.search(source)
    if m:
        parts.append(f": it is a {m[1]} kernel for another spec (its `kgen show` header says so), and "
                     f"{spec.name} is a {spec.kind} spec; verify it against the spec it was generated from, "
                     f"or start from `kgen show {spec.source_path or spec.name}`")
    return "".join(parts)


def source_config(spec, text: str) -> Config:
    """The config a source implements: the ABI 1 launch (the family's abi_config), or the spec's
    default config when that differs and the source's main kernel declares its parameter count
    (kgen's own `kgen show SPEC` output: the split-KV signature). The signature and launch-contract
    checks then hold the source to the config chosen here."""
    family = family_for(spec)
    abi = resolve_config(family, spec, family.abi_config(spec))
    default = resolve_config(family, spec, None)
    if default == abi:
        return abi
    declared = declared_parameter_count(text, spec.name)
    abi_count = len(family.kernels(spec, abi)[0].params)
    default_count = len(family.kernels(spec, default)[0].params)
    if declared == default_count != abi_count:
        return default
    return abi


def declared_parameter_count(text: str, name: str) -> int | None:
    """How many parameters the `__global__` function `name` of a preprocessed source declares
    (None: no such definition found). Lines starting with `#` (includes, #line) are skipped."""
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in text.split("\n"))
    tokens = tokenize(code)
    for i, t in enumerate(tokens[:-1]):
        if t.text != name or tokens[i + 1].text != "(":
            continue
        head = [x.text for x in tokens[max(0, i - 12):i]]
        cut = max((k for k, x in enumerate(head) if x in (";", "}", "{")), default=-1)
        if "__global__" not in head[cut + 1:]:
            continue
        depth, commas, empty = 0, 0, True
        for x in tokens[i + 1:]:
            if x.text in ("(", "[", "{"):
                depth += 1
                continue
            if x.text in (")", "]", "}"):
                depth -= 1
                if depth == 0:
                    break
                continue
            if depth == 1:
                if x.text == ",":
                    commas += 1
                elif not (empty and x.text == "void"):
                    empty = False
        return 0 if empty and commas == 0 else commas + 1
    return None
