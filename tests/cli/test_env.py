"""`kgen env`, run as a real subprocess: every variable, its value and where it came from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kgen.settings import REGISTRY

ROOT = Path(__file__).resolve().parents[2]


def run_env(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in REGISTRY}
    return subprocess.run([sys.executable, "-m", "kgen.cli", "env"], capture_output=True, text=True, cwd=ROOT,
                          env={**base, "PYTHONPATH": str(ROOT), **env}, timeout=120)


def _lines(stdout: str) -> dict[str, str]:
    return {m[1]: m[0] for m in re.finditer(r"^(KGEN_[A-Z0-9_]+) = .*$", stdout, re.M)}


def test_lists_every_variable_with_value_and_source(tmp_path):
    res = run_env(KGEN_CACHE_DIR=str(tmp_path / "c"), KGEN_SIMT_STACK="64k")
    assert res.returncode == 0, res.stderr
    lines = _lines(res.stdout)
    assert set(lines) == set(REGISTRY)
    assert lines["KGEN_CACHE_DIR"] == f"KGEN_CACHE_DIR = {tmp_path / 'c'}  [environment]"
    assert lines["KGEN_SIMT_STACK"] == "KGEN_SIMT_STACK = 64k  [environment]"
    assert lines["KGEN_BACKEND"] == "KGEN_BACKEND = auto  [default]"
    assert lines["KGEN_CXX"] == "KGEN_CXX = g++  [default]"
    for setting in REGISTRY.values():  # the help text is printed under each name
        assert setting.help in res.stdout


def test_every_kgen_name_in_the_code_is_listed():
    """Every KGEN_* name in kgen/ and templates/ (any spelling, `-DKGEN_X` included) is listed: an
    environment variable with its value, or a reserved macro name in its own section."""
    files = [*(ROOT / "kgen").rglob("*.py"), *(p for p in (ROOT / "templates").rglob("*") if p.is_file())]
    names = {m for p in files for m in re.findall(r"KGEN_[A-Z0-9_]+", p.read_text())}
    stdout = run_env().stdout
    listed = set(_lines(stdout)) | set(re.findall(r"^  (KGEN_[A-Z0-9_]+):", stdout, re.M))
    assert names and names <= listed, names - listed
    env_part, reserved_part = stdout.split("Reserved names")
    assert not set(re.findall(r"^  (KGEN_[A-Z0-9_]+):", env_part, re.M))  # macros are not shown as variables


def test_invalid_value_exits_2_naming_variable_value_and_choices():
    res = run_env(KGEN_BACKEND="bogus")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "KGEN_BACKEND='bogus'" in res.stderr and "auto, cuda, cpu" in res.stderr
    assert "KGEN_BACKEND = bogus  [environment]" in res.stdout  # still listed


def test_build_with_a_bogus_backend_variable_exits_2(tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in REGISTRY}
    env = {**base, "PYTHONPATH": str(ROOT), "KGEN_BACKEND": "bogus", "KGEN_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-m", "kgen.cli", "build", str(ROOT / "specs" / "llama3_8b_decode.yaml"),
                          "-o", str(tmp_path / "gen")], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "KGEN_BACKEND='bogus'" in res.stderr and "auto, cuda, cpu" in res.stderr
    assert not (tmp_path / "gen" / "llama3_8b_decode").exists()
