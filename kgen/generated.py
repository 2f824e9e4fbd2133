"""`generated/<name>/`: what `kgen build` writes, and how its `__init__.py` loads it.

Layout: kernel.cu, kernel.<arch>.cubin per target, manifest.json (spec, hashes,
compiler versions, ptxas resources, verification report, tuning results) and an
__init__.py exposing `kernel`. The directory is written next to the destination
and swapped into place, so a failed build leaves the previous output intact.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from kgen.fileio import make_temp_dir, remove_path, replace_dir
from kgen.version import __version__

MANIFEST = "manifest.json"
SOURCE = "kernel.cu"

_INIT = '''"""kgen-generated kernel '{name}' (spec sha256 {spec_hash}). Regenerate with `kgen build`; do not edit."""

from pathlib import Path

from kgen.generated import load_generated

kernel = load_generated(Path(__file__).resolve().parent)

__all__ = ["kernel"]
'''

_PACKAGE_INIT = '"""Kernels written by `kgen build`: `from generated.<name> import kernel`."""\n'


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def manifest_for(kernel, spec_file: str | None = None, tuning: dict | None = None) -> dict[str, Any]:
    from kgen.compile.nvrtc import nvrtc_version

    cubins = kernel.artifacts.get("cubins", {})
    return {
        "kgen_version": __version__,
        "name": kernel.spec.name,
        "kind": kernel.spec.kind,
        "spec": kernel.spec.canonical(),
        "spec_hash": kernel.spec.spec_hash(),
        "spec_file": spec_file,
        "config": kernel.config,
        "kernel_names": kernel.kernel_names,
        "source_sha256": _sha256(kernel.source),
        "compilers": {"nvrtc": nvrtc_version()},
        "cubins": {arch: {"file": f"kernel.{arch}.cubin", "sha256": _sha256(a.cubin),
                          "resources": kernel.resources.get(arch, {})} for arch, a in cubins.items()},
        "verification": kernel.report.to_dict() if kernel.report is not None else None,
        "tuning": tuning,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_generated(kernel, out_root: Path | str, spec_file: str | None = None,
                    tuning: dict | None = None) -> Path:
    """Write generated/<name>/ atomically (build in a temp dir, then swap)."""
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    init = out_root / "__init__.py"
    if not init.exists():
        init.write_text(_PACKAGE_INIT)
    final = out_root / kernel.spec.name
    tmp = make_temp_dir(out_root, f".{kernel.spec.name}-")
    try:
        (tmp / SOURCE).write_text(kernel.source)
        for arch, art in kernel.artifacts.get("cubins", {}).items():
            (tmp / f"kernel.{arch}.cubin").write_bytes(art.cubin)
        manifest = manifest_for(kernel, spec_file, tuning)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        (tmp / "__init__.py").write_text(_INIT.format(name=kernel.spec.name, spec_hash=manifest["spec_hash"]))
        replace_dir(tmp, final)
    finally:
        remove_path(tmp)
    return final


class GeneratedKernel:
    """The `kernel` of a generated module: loads lazily (cubin for this GPU, else the CPU backend)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.manifest = json.loads((self.directory / MANIFEST).read_text())
        self.source = (self.directory / SOURCE).read_text()
        if _sha256(self.source) != self.manifest["source_sha256"]:
            from kgen.errors import KgenError

            raise KgenError(f"{self.directory / SOURCE}: source does not match its manifest; re-run kgen build")
        self._kernel = None

    @property
    def spec(self):
        from kgen.spec.models import spec_from_dict

        return spec_from_dict(self.manifest["spec"], filename=str(self.directory / MANIFEST))

    def load(self, backend: str = "auto"):
        """Build the runnable kernel (no re-verification: the manifest holds the build's report)."""
        from kgen.build import select_backend
        from kgen.kernel import Kernel
        from kgen.render import Rendered

        chosen = select_backend(backend)
        spec = self.spec
        rendered = Rendered(self.source, self.manifest["kernel_names"], self.manifest["config"])
        if chosen == "cuda":
            from kgen.runtime.cuda import CudaModule, device_arch

            entry = self.manifest["cubins"].get(device_arch())
            if entry is not None:
                module = CudaModule(self.directory / entry["file"], rendered.kernel_names)
            else:  # arch differs from the build's targets: compile the shipped source for this GPU
                from kgen.build import load_module

                module = load_module("cuda", rendered)
        else:
            from kgen.build import load_module

            module = load_module("cpu", rendered)
        resources = {arch: c["resources"] for arch, c in self.manifest["cubins"].items()}
        self._kernel = Kernel(spec, self.source, rendered.config, module, rendered.kernel_names, resources)
        # Tuning hook (kgen/tuned.py): per-bucket tuned configs when the manifest's results fit this device.
        from kgen.tune.tuned import tuned_from_manifest

        self._kernel = tuned_from_manifest(self._kernel, self.manifest.get("tuning"), chosen)
        return self._kernel

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
    return GeneratedKernel(directory)
