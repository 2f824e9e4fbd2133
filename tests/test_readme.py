"""The README's first fenced block is what a newcomer copies: a bash block right under the title,
one line that installs kgen and builds a bundled spec, one that runs the tests -- the line .ci/run runs."""

from __future__ import annotations

import re
import shlex
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
    assert install.startswith("python3 -m venv .venv && ") and "pip install -e ." in install
    build = re.search(r"\bkgen build (\S+)$", install)
    assert build and (ROOT / build.group(1)).is_file(), install
    assert "pip install -e '.[test" in tests and "-m pytest" in tests
    assert shlex.split(install) and shlex.split(tests)  # both are well-formed shell words


def test_ci_runs_the_readme_test_command():
    _, _, block = first_block()
    tests = [line for line in block if line.strip()][1]
    script = ROOT / ".ci" / "run"
    # Without --print support the script would run the whole CI from inside this test.
    assert '"--print"' in script.read_text(), ".ci/run cannot print its test command"
    r = subprocess.run(["bash", str(script), "--print"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == tests + "\n"


def test_layout_names_paths_that_exist():
    layout = README[README.index("## Layout"):README.index("## Environment")]
    paths = set(re.findall(r"`(kgen/[\w./]*)`", layout))
    assert {"kgen/spec/", "kgen/families/", "kgen/verify/", "kgen/tune/", "kgen/paging/", "kgen/cli/"} <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []
