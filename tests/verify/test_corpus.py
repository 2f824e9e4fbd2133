"""The hand-written kernel corpus (tests/verify/corpus/, described by its manifest.yaml) run
through the real `kgen verify SPEC --source FILE`, one subprocess per file.

Correct originals must pass (exit 0); every mutant, one planted bug each, and every kernel that
cheats only while watched (cheat_*, ISSUE 21) must be rejected (exit 1); every hostile kernel must be refused (exit 2) or rejected (exit 1) by a verifier that
returns on its own (no signal, no timeout) and creates nothing outside its scratch directory:
no /tmp/kgen_corpus_pwned_* marker, nothing in the working directory it was started in, and no
echo of a file the kernel tried to #include.

The cheats are slow (each a whole verification run): a representative subset runs by default,
the entries marked `tier: full` in the manifest in the full tier (`pytest --tier full`).
"""

from __future__ import annotations

import difflib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kgen

CORPUS = Path(__file__).parent / "corpus"
SPECS = Path(__file__).parents[2] / "specs"
MANIFEST: dict[str, dict] = yaml.safe_load((CORPUS / "manifest.yaml").read_text())
TIMEOUT_S = 300  # a hung verifier fails the test instead of hanging the suite
MARKERS = "/tmp/kgen_corpus_pwned_*"  # what the hostile kernels try to create
SECRET = Path("/tmp/kgen_corpus_secret.txt")  # included by hostile_include_secret_file.cu
EXIT = {"pass": {0}, "reject": {1}, "refuse": {1, 2}}
MAX_EDIT_LINES = 20  # a mutant or hostile kernel is a small, reviewable edit of its original


def spec_of(entry: str) -> Path:
    return SPECS / f"{Path(entry).parent.name}.yaml"


def clear_markers() -> None:
    for path in glob.glob(MARKERS):
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def run_verify(spec: Path, source: Path, cache_dir: Path, cwd: Path) -> tuple[int | None, str]:
    """(exit status, or None after a timeout; combined output) of the CLI in its own session,
    so that a timeout kills the verifier and everything it started."""
    env = dict(os.environ, KGEN_CACHE_DIR=str(cache_dir))
    kgen_root = str(Path(kgen.__file__).parents[1])  # the kgen under test, also in the child
    env["PYTHONPATH"] = os.pathsep.join(p for p in (kgen_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "kgen.cli", "verify", str(spec), "--source", str(source)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
        status: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        status = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing the verifier started outlives the test
        except ProcessLookupError:
            pass
    if status is None:
        output, _ = proc.communicate()
    return status, output


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kgen_cache")


def test_manifest_lists_every_file():
    on_disk = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.cu")}
    assert on_disk == set(MANIFEST)
    for entry, info in MANIFEST.items():
        assert info["expect"] in EXIT, entry
        assert spec_of(entry).is_file(), entry
        assert (CORPUS / entry).with_name("original.cu").is_file(), entry


@pytest.mark.parametrize("entry", [e for e in MANIFEST if not e.endswith("/original.cu")])
def test_variant_is_a_small_edit_of_its_original(entry):
    original = (CORPUS / entry).with_name("original.cu").read_text().splitlines()
    variant = (CORPUS / entry).read_text().splitlines()
    changed = [line for line in difflib.unified_diff(original, variant, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= MAX_EDIT_LINES, "\n".join(changed)


def _entries():
    """Every manifest entry; those with `tier: full` (slow cheats) in the full tier."""
    return [pytest.param(e, marks=pytest.mark.full) if info.get("tier") == "full" else e for e, info in MANIFEST.items()]


@pytest.mark.parametrize("entry", _entries())
def test_verify_source(entry, cache_dir, tmp_path):
    info = MANIFEST[entry]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    clear_markers()
    token = f"kgen_corpus_secret_{secrets.token_hex(8)}"
    SECRET.write_text(token + "\n")
    try:
        status, output = run_verify(spec_of(entry), CORPUS / entry, cache_dir, cwd)
        created = sorted(glob.glob(MARKERS)) + sorted(str(p) for p in cwd.iterdir())
    finally:
        clear_markers()
        SECRET.unlink(missing_ok=True)
    tail = output[-3000:]
    assert status is not None, f"verifier still running after {TIMEOUT_S} s:\n{tail}"
    assert status >= 0, f"verifier killed by signal {-status}:\n{tail}"
    assert not created, f"the kernel created {created}:\n{tail}"
    assert token not in output, f"the verifier's output shows the content of {SECRET}"
    assert status in EXIT[info["expect"]], (
        f"{entry} ({info['expect']}: {info.get('bug')}) exited {status}, expected {sorted(EXIT[info['expect']])}:\n{tail}")
