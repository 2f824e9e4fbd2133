"""docs/ai-kernels.md's worked example runs as written: its bash blocks, in order, in one shell in a
fresh directory, with this checkout's `kgen` and `python` first on PATH (the CPU backend: no GPU).
Each block checks its own exit codes (`set -e`, `test "$status" -eq 1` for the failing verdict)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, _env

DOC = ROOT / "docs" / "ai-kernels.md"


def bash_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", DOC.read_text(encoding="utf-8"), re.M | re.S)


@pytest.mark.full  # ~30 s: the commands it runs are each tested by default in tests/cli/
def test_the_loop_runs_as_written(tmp_path):
    blocks = bash_blocks()
    assert len(blocks) >= 6, f"expected the loop's steps as bash blocks, found {len(blocks)}"
    env = _env((), None)
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    script = "set -e -o pipefail\n" + "\n".join(blocks)
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert re.search(r"seed \d+: (\d+) of \d+ cases failed", r.stdout), r.stdout  # the buggy attempt
    assert re.search(r"\d+ cases passed", r.stdout), r.stdout                     # the fix
    assert (tmp_path / "generated" / "tiny_decode" / "kernel.cu").exists()
    assert "mismatches=0" in r.stdout or "mismatches': 0" in r.stdout or "mismatches=0," in r.stdout, r.stdout
