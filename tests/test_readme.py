"""The README's first fenced block is what a newcomer copies: a bash block right under the title,
one line that installs kgen and builds a bundled spec, one that runs the tests -- the command .ci/run runs."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def first_block() -> tuple[list[str], str, list[str]]:
    """(the lines above the first fence, the fence's info string, the block's lines)."""
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[:start], lines[start][3:].strip(), lines[start + 1:end]


def test_first_block_is_bash_right_under_the_title():
    above, info, _ = first_block()
    assert info == "bash"
    assert [line for line in above if line.strip()] == [above[0]]
    assert above[0].startswith("# kgen")


def test_first_block_installs_and_builds_then_tests():
    _, _, block = first_block()
    commands = [line for line in block if line.strip()]
    assert len(commands) == 2, commands
    install, tests = commands
    # the default CUDA line (kgen/compile/cuda_line.py): the base install names none, the lines exclude each other
    assert install.startswith("python3 -m venv .venv && ") and "pip install -e '.[cu13]'" in install
    build = re.search(r"\bkgen build (\S+)$", install)
    assert build and (ROOT / build.group(1)).is_file(), install
    assert "pip install -e '.[test" in tests and "-m pytest" in tests
    assert shlex.split(install) and shlex.split(tests)  # both are well-formed shell words


STAND_INS = {"bin/python3": "python3", ".venv/bin/pip": "pip", ".venv/bin/python": "python"}


def tool_calls(root: Path, *command: str) -> list[str]:
    """The calls `command` (run in `root`) makes to python3, .venv/bin/pip and .venv/bin/python, with
    stand-ins for the three that only write their arguments down."""
    log = root / "calls.log"
    for rel, name in STAND_INS.items():
        tool = root / rel
        tool.parent.mkdir(parents=True, exist_ok=True)
        tool.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "{name} $*" >> "{log}"\n')
        tool.chmod(0o755)
    env = {"PATH": f"{root / 'bin'}:/usr/bin:/bin", "HOME": str(root)}
    r = subprocess.run(list(command), capture_output=True, text=True, cwd=root, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_ci_runs_the_readme_test_command(tmp_path):
    """What .ci/run runs, not what it says: the script itself, run with stand-in tools, makes the
    README line's calls (after creating the environment)."""
    _, _, block = first_block()
    tests = [line for line in block if line.strip()][1]
    script = ROOT / ".ci" / "run"
    (tmp_path / "ci" / ".ci").mkdir(parents=True)
    shutil.copy(script, tmp_path / "ci" / ".ci" / "run")
    ci = tool_calls(tmp_path / "ci", "bash", ".ci/run")
    (tmp_path / "readme").mkdir()
    readme = tool_calls(tmp_path / "readme", "bash", "-c", tests)
    assert any(" -m pytest " in call for call in readme), readme
    assert ci[:len(readme) + 2] == ["python3 -m venv .venv", "pip install --quiet --upgrade pip", *readme], ci
    # then a quarter of the full tier (no git repository here: commit count 0, shard 0)
    assert ci[len(readme) + 2:] == ["python -m pytest -q -n 2 --dist loadfile --tier full --full-shard 0/4 "
                                    "--durations=30"], ci
    # `.ci/run --print` shows the same command.
    r = subprocess.run(["bash", str(script), "--print"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout == tests + "\n", r.stdout + r.stderr


def test_layout_names_paths_that_exist():
    layout = README[README.index("## Layout"):README.index("## Environment")]
    paths = set(re.findall(r"`(kgen/[\w./]*)`", layout))
    assert {"kgen/spec/", "kgen/families/", "kgen/verify/", "kgen/tune/", "kgen/paging/", "kgen/cli/"} <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []
