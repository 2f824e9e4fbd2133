"""The suite runs on a temporary kgen cache, in this process and in the subprocesses it
spawns, never on the user's (the autouse fixture in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import platformdirs
from conftest import run_python, tiny_decode

import kgen
from kgen import settings


def test_the_cache_is_this_runs_temporary_directory(kgen_cache_dir, tmp_path_factory):
    assert settings.cache_dir() == kgen_cache_dir
    assert kgen_cache_dir.is_relative_to(tmp_path_factory.getbasetemp().parent)
    assert not kgen_cache_dir.is_relative_to(platformdirs.user_cache_dir("kgen"))


def test_builds_and_subprocesses_use_it(kgen_cache_dir, tmp_path):
    kgen.build(tiny_decode("isolation_probe"), backend="cpu", archs=["sm_80"], verify=False)
    assert list(kgen_cache_dir.rglob("kernel.cubin")), "the build compiled somewhere else"
    r = run_python("from kgen import settings; print(settings.cache_dir())", tmp_path)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == kgen_cache_dir
