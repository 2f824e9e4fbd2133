"""Running one entry of the hand-written kernel corpus (tests/verify/corpus/, described by its
manifest.yaml) through the real `kgen verify SPEC --source FILE`, in its own subprocess: shared by
tests/verify/test_corpus.py (originals, hostile kernels, cheats) and test_corpus_mutants.py (planted
bugs), two files so that `--dist loadfile` runs them on both workers."""

from __future__ import annotations

import glob
import os
import re
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


def entries(kinds: tuple[str, ...]) -> list:
    """The manifest's entries whose file name starts with one of `kinds` ("original", "mutant",
    "hostile", "cheat"); those with `tier: full` (slow cheats, most mutants) in the full tier."""
    chosen = [e for e in MANIFEST if Path(e).name.startswith(kinds)]
    return [pytest.param(e, marks=pytest.mark.full) if MANIFEST[e].get("tier") == "full" else e for e in chosen]


def check_entry(entry: str, cache_dir: Path, tmp_path: Path) -> None:
    """Run `entry` and assert its expected outcome, that it created nothing and showed no secret."""
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
    if "rule" in info:  # refused by the source policy: exit 2, naming the file, a line and the rule
        named = re.search(rf"{re.escape(Path(entry).name)}:\d+: [^\n]*{re.escape(info['rule'])}", output)
        assert status == 2 and named, (
            f"{entry}: expected the source policy's refusal naming '{info['rule']}' (exit 2), got {status}:\n{tail}")
