"""`generated/<name>/`: what `kgen build` writes, and how its `__init__.py` loads it.

Layout: kernel.cu (the body the CPU backend runs), kernel.<arch>.cu for each arch whose
body differs (kgen/bodies.py: a spec renders once per arch), kernel.<arch>.cubin per target,
manifest.json (spec, hashes, each arch's body and why, compiler versions, ptxas resources,
verification report, tuning results) and an __init__.py exposing `kernel`, which loads the
body and cubin of the device's arch. The directory is written next to the destination
and swapped into place, so a failed build leaves the previous output intact.

kgen replaces only its own output: a directory whose manifest.json carries the
`generator` marker and lists, with their hashes, every file kgen wrote (the
manifest itself aside), holding nothing else and nothing changed. Anything else at
that path is the user's, and is replaced only when they ask (`--force`).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from kgen.bodies import dispatch
from kgen.build import load_module, select_backend
from kgen.cache import ArtifactCache
from kgen.compile.nvrtc import compile_arch, nvrtc_version
from kgen.errors import KgenError, KgenUserError
from kgen.fileio import make_temp_dir, remove_path
from kgen.kernel import Kernel
from kgen.render import Rendered
from kgen.runtime.cuda import CudaModule, device_arch, loaded_cubin
from kgen.spec.models import spec_from_dict
from kgen.torch_ops import register_if_imported
from kgen.tune.tuned import tuned_from_manifest
from kgen.version import __version__

MANIFEST = "manifest.json"
SOURCE = "kernel.cu"
INIT = "__init__.py"
GENERATOR = "kgen"  # the manifest's "generator": marks a directory as kgen's output
# Python's byte-code cache of the generated __init__.py, written when the package is imported.
_PYCACHE = "__pycache__"
_PYC = re.compile(r"__init__\.[\w.-]+\.pyc")

_INIT = '''"""kgen-generated kernel '{name}' (spec sha256 {spec_hash}). Regenerate with `kgen build`; do not edit."""

from pathlib import Path

from kgen.generated import load_generated

kernel = load_generated(Path(__file__).resolve().parent)

__all__ = ["kernel"]
'''

_PACKAGE_INIT = '"""Kernels written by `kgen build`: `from generated.<name> import kernel`."""\n'

# renameat2(RENAME_EXCHANGE) swaps two paths in one step (Linux >= 3.15, glibc >= 2.28).
_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _cubin_file(arch: str) -> str:
    return f"kernel.{arch}.cubin"


def _source_file(arch: str) -> str:
    return f"kernel.{arch}.cu"


def body_sources(kernel) -> dict[str, tuple[str, str]]:
    """{arch: (file, source)} of each arch's body: kernel.cu for the kernel's own, kernel.<arch>.cu
    for a body that differs from it."""
    bodies = kernel.artifacts.get("bodies", {})
    return {arch: (SOURCE, r.source) if r.source == kernel.source else (_source_file(arch), r.source)
            for arch, r in bodies.items()}


def manifest_for(kernel, spec_file: str | None = None, tuning: dict | None = None,
                 files: dict[str, str] | None = None) -> dict[str, Any]:
    cubins = kernel.artifacts.get("cubins", {})
    rendered = kernel.artifacts.get("bodies", {})
    sources = body_sources(kernel)
    return {
        "generator": GENERATOR,
        "files": files,
        "kgen_version": __version__,
        "name": kernel.spec.name,
        "kind": kernel.spec.kind,
        "spec": kernel.spec.canonical(),
        "spec_hash": kernel.spec.spec_hash(),
        "spec_file": spec_file,
        "config": kernel.config,
        "kernel_names": kernel.kernel_names,
        "source_sha256": _sha256(kernel.source),
        # a hand-written kernel (kgen.load_source, `kgen build --source`): the file it came from
        "handwritten_source": kernel.artifacts.get("origin"),
        "compilers": {"nvrtc": nvrtc_version()},
        "cubins": {arch: {"file": _cubin_file(arch), "sha256": _sha256(a.cubin),
                          "resources": kernel.resources.get(arch, {})} for arch, a in cubins.items()},
        # the arch whose body kernel.cu holds (the CPU backend's), and each arch's body
        "arch": kernel.arch,
        "bodies": {arch: {"body": rendered[arch].body, "why": rendered[arch].why, "source": file,
                          "source_sha256": _sha256(text), "arch_specific": compile_arch(text, arch) != arch}
                   for arch, (file, text) in sources.items()},
        "verification": kernel.report.to_dict() if kernel.report is not None else None,
        "tuning": tuning,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def check_output(out_root: Path | str, names: list[str], force: bool = False) -> None:
    """Refuse (KgenUserError), before anything is built or written, an output directory that
    cannot hold packages, or a `<out_root>/<name>` that is not kgen's own unchanged output."""
    out_root = Path(out_root)
    existing = out_root
    while not os.path.lexists(existing):  # the nearest existing ancestor decides whether mkdir can work
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == out_root else f"{existing} "
        raise KgenUserError(f"output directory {out_root}: {where}is {_what(existing)}, not a directory")
    problems = []
    for name in names:
        final = out_root / name
        why = None if force or not os.path.lexists(final) else _not_ours(final)
        if why:
            problems.append(f"{final}: {why}; kgen replaces only its own unchanged output "
                            "(move it away, choose another -o, or pass --force to replace it)")
    if problems:
        raise KgenUserError("\n".join(problems))


def _what(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link" if path.exists() else "a symbolic link to a missing path"
    return "a directory" if path.is_dir() else "a file"


def _not_ours(final: Path) -> str | None:
    """Why `final` is not kgen's own unchanged output, or None when kgen may replace it."""
    if final.is_symlink() or not final.is_dir():
        return f"is {_what(final)}, not kgen's output"
    try:
        manifest = json.loads((final / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"has no readable {MANIFEST}, so it was not written by kgen build"
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("generator") == GENERATOR else None
    if not isinstance(files, dict) or any(Path(f).name != f or f in ("", ".", "..") for f in files):
        return f"its {MANIFEST} does not list the files kgen wrote (not kgen's output, or an older kgen's)"
    try:
        extra = sorted(p.name for p in final.iterdir()
                       if p.name not in files and p.name != MANIFEST and not _is_pycache(p))
        changed = sorted(name for name, digest in files.items() if not _unchanged(final / name, digest))
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if extra:
        return f"holds files kgen did not write ({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})"
    if changed:
        return f"{', '.join(changed)} changed since kgen wrote {'it' if len(changed) == 1 else 'them'}"
    return None


def _is_pycache(path: Path) -> bool:
    """Python's byte-code of the generated __init__.py (written on import): kgen's to delete."""
    return (path.name == _PYCACHE and path.is_dir() and not path.is_symlink()
            and all(_PYC.fullmatch(p.name) and p.is_file() for p in path.iterdir()))


def _unchanged(path: Path, digest: str) -> bool:
    if not os.path.lexists(path):  # deleted since: nothing of the user's to lose
        return True
    return path.is_file() and not path.is_symlink() and _sha256(path.read_bytes()) == digest


def write_generated(kernel, out_root: Path | str, spec_file: str | None = None,
                    tuning: dict | None = None, force: bool = False) -> Path:
    """Write <out_root>/<name>/ atomically: build it in a temporary directory beside it, then swap it in.
    What was there must be kgen's own unchanged output (check_output) unless `force`."""
    out_root = Path(out_root)
    name = kernel.spec.name
    final = out_root / name
    check_output(out_root, [name], force)
    try:
        out_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KgenUserError(f"output directory {out_root}: cannot create it ({e.strerror})") from e
    tmp = None
    try:
        tmp = make_temp_dir(out_root, f".{name}-")  # the user's umask, not mkdtemp's 0700
        files = {SOURCE: kernel.source.encode(),
                 INIT: _INIT.format(name=name, spec_hash=kernel.spec.spec_hash()).encode(),
                 **{_cubin_file(arch): a.cubin for arch, a in kernel.artifacts.get("cubins", {}).items()},
                 **{file: text.encode() for file, text in body_sources(kernel).values() if file != SOURCE}}
        for file, data in files.items():
            (tmp / file).write_bytes(data)
        manifest = manifest_for(kernel, spec_file, tuning, {file: _sha256(data) for file, data in files.items()})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
        _replace(tmp, final)
        tmp = None
        _write_package_init(out_root)
    except OSError as e:
        raise KgenUserError(f"{final}: cannot write the generated package ({e.strerror or e})") from e
    finally:
        if tmp is not None and os.path.lexists(tmp):
            remove_path(tmp)
    return final


def _write_package_init(out_root: Path) -> None:
    """Make out_root a package; an existing __init__.py (or link of that name) is the user's, never touched."""
    try:
        fd = os.open(out_root / INIT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(_PACKAGE_INIT)


def _replace(new: Path, final: Path) -> None:
    """Put `new` at `final` and delete what was there; where the OS can swap, `final` never goes missing."""
    if not os.path.lexists(final):
        os.rename(new, final)
    elif _exchange(new, final):
        remove_path(new)  # it now holds the previous output
    else:
        _replace_by_renames(new, final)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where the C library, kernel or file system cannot."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _replace_by_renames(new: Path, final: Path) -> None:
    """The portable fallback: the old output aside, the new one in, the old one deleted."""
    aside = new.with_name(f"{new.name}-old")
    os.rename(final, aside)
    try:
        os.rename(new, final)
    except OSError:
        os.rename(aside, final)
        raise
    remove_path(aside)


class GeneratedKernel:
    """The `kernel` of a generated module: loads lazily (cubin for this GPU, else the CPU backend)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.manifest = json.loads((self.directory / MANIFEST).read_text(encoding="utf-8"))
        self.source = (self.directory / SOURCE).read_text(encoding="utf-8")
        if _sha256(self.source) != self.manifest["source_sha256"]:
            raise KgenError(f"{self.directory / SOURCE}: source does not match its manifest; re-run kgen build")
        self._kernel = None

    @property
    def spec(self):
        return spec_from_dict(self.manifest["spec"], filename=str(self.directory / MANIFEST))

    def load(self, backend: str = "auto"):
        """Build the runnable kernel (no re-verification: the manifest holds the build's report). CUDA:
        the body and cubin of this GPU's arch; a GPU the build did not target compiles the body of the
        newest older arch with a portable body (kgen.bodies.dispatch). CPU: kernel.cu's body."""
        chosen = select_backend(backend)
        spec = self.spec
        arch, source = self.manifest.get("arch"), self.source
        entry = None
        if chosen == "cuda":
            device = device_arch()
            bodies = self.manifest.get("bodies") or {}
            if bodies:  # a manifest of per-arch bodies (older ones have one source for every arch)
                arch = dispatch({a: b["arch_specific"] for a, b in bodies.items()}, device)
                if arch is None:
                    raise KgenError(f"{self.directory}: no body of this build runs on {device} (built: "
                                    + ", ".join(f"{a} {b['body']}".rstrip() for a, b in bodies.items())
                                    + f"); rebuild with `kgen build --arch {device}`")
                source = self._body_source(bodies[arch])
            entry = self.manifest["cubins"].get(device)
        rendered = Rendered(source, self.manifest["kernel_names"], self.manifest["config"])
        if entry is not None:
            cubin = (self.directory / entry["file"]).read_bytes()
            if _sha256(cubin) != entry["sha256"]:
                raise KgenError(f"{self.directory / entry['file']}: cubin does not match its manifest; re-run kgen build")
            # Loaded by its hash: a module rebuilt into the same directory is not CuPy's cached old one.
            module = CudaModule(loaded_cubin(ArtifactCache(), cubin, source), rendered.kernel_names)
        else:  # the CPU backend, or a GPU the build did not target: compile the shipped source
            module = load_module(chosen, rendered)
        self._kernel = Kernel(spec, source, rendered.config, module, rendered.kernel_names, self.resources,
                              arch=arch)
        # Per-bucket tuned configs when the manifest's tuning results fit this device.
        self._kernel = tuned_from_manifest(self._kernel, self.manifest.get("tuning"), chosen)
        return self._kernel

    def _body_source(self, body: dict) -> str:
        if body["source"] == SOURCE:
            return self.source
        text = (self.directory / body["source"]).read_text(encoding="utf-8")
        if _sha256(text) != body["source_sha256"]:
            raise KgenError(f"{self.directory / body['source']}: source does not match its manifest; "
                            "re-run kgen build")
        return text

    def __call__(self, **arguments: Any):
        if self._kernel is None:
            self.load()
        return self._kernel(**arguments)

    @property
    def resources(self) -> dict:
        return {arch: c["resources"] for arch, c in self.manifest["cubins"].items()}

    @property
    def report(self) -> dict | None:
        return self.manifest.get("verification")

    def __repr__(self) -> str:
        return f"<generated kgen kernel {self.manifest['name']} from {self.directory}>"


def load_generated(directory: Path) -> GeneratedKernel:
    kernel = GeneratedKernel(directory)
    register_if_imported(kernel)  # torch.ops.kgen.<name>, when torch is imported (docs/interop.md)
    return kernel
