"""The settings registry: every environment variable kgen reads is declared, typed and checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kgen import settings
from kgen.build import select_backend
from kgen.compile.provided import RESERVED_MACROS
from kgen.errors import KgenUserError
from kgen.settings import REGISTRY, Setting

ROOT = Path(__file__).resolve().parents[1]


def _names_in(paths, pattern) -> set[str]:
    return {m for p in paths for m in re.findall(pattern, p.read_text())}


def test_every_kgen_name_in_the_package_is_declared():
    """A KGEN_* name is an environment variable of the registry or a reserved C macro, never both."""
    names = _names_in(sorted((ROOT / "kgen").rglob("*.py")), r"KGEN_[A-Z0-9_]+")
    assert {"KGEN_CACHE_DIR", "KGEN_BACKEND", "KGEN_CXX", "KGEN_CUDA_HOME"} <= names
    assert names - set(REGISTRY) - set(RESERVED_MACROS) == set()
    assert not set(REGISTRY) & set(RESERVED_MACROS)


def test_every_variable_the_cpu_runtime_reads_is_declared():
    read = _names_in(sorted((ROOT / "templates").rglob("*.h*")), r'getenv\("([A-Z0-9_]+)"\)')
    assert read == {"KGEN_SIMT_THREADS", "KGEN_SIMT_STACK"}
    assert read <= set(REGISTRY)


def test_only_the_registry_reads_the_environment():
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "kgen").rglob("*.py"))
                 if p.name != "settings.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"os\.environ|getenv\(", line)]
    assert offenders == []


def test_each_setting_is_documented_and_typed():
    for s in REGISTRY.values():
        assert s.name.startswith("KGEN_") and len(s.help) > 20
        assert s.kind in ("str", "path", "choice", "bool", "int", "size", "rate")
        assert (s.kind == "choice") == bool(s.choices)
        assert s.expected()


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("KGEN_BACKEND", "cpu", "cpu"),
    ("KGEN_CACHE_DIR", "/tmp/kgen-x", Path("/tmp/kgen-x")),
    ("KGEN_CXX", "clang++", "clang++"),
    ("KGEN_SIMT_THREADS", "3", 3),
    ("KGEN_SIMT_STACK", "4096", 4096),
    ("KGEN_SIMT_STACK", "64k", 64 << 10),
    ("KGEN_SIMT_STACK", "2M", 2 << 20),
    ("KGEN_VLLM_AUDIT_RATE", "0.01", 0.01),
    ("KGEN_VLLM_AUDIT_RATE", "1", 1.0),
    ("KGEN_VLLM_SOURCE_DIR", "/tmp/kernels", Path("/tmp/kernels")),
])
def test_values_are_parsed_to_their_type(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert REGISTRY[name].value() == value
    assert REGISTRY[name].source() == "environment"


def test_audit_rate_defaults_to_zero(monkeypatch):
    monkeypatch.delenv("KGEN_VLLM_AUDIT_RATE", raising=False)
    assert settings.KGEN_VLLM_AUDIT_RATE.value() == 0.0


def test_unset_and_empty_mean_the_default(monkeypatch):
    monkeypatch.delenv("KGEN_BACKEND", raising=False)
    assert settings.KGEN_BACKEND.value() == "auto" and settings.KGEN_BACKEND.source() == "default"
    monkeypatch.setenv("KGEN_BACKEND", "")
    assert settings.KGEN_BACKEND.value() == "auto" and settings.KGEN_BACKEND.source() == "default"
    monkeypatch.delenv("KGEN_CACHE_DIR", raising=False)
    assert settings.cache_dir().name == "kgen"


@pytest.mark.parametrize(("name", "raw", "allowed"), [
    ("KGEN_BACKEND", "bogus", "auto, cuda, cpu"),
    ("KGEN_BACKEND", "CUDA", "auto, cuda, cpu"),
    ("KGEN_SIMT_THREADS", "four", "whole number"),
    ("KGEN_SIMT_THREADS", "-1", "whole number"),
    ("KGEN_SIMT_STACK", "1G", "k or M suffix"),
    ("KGEN_VLLM_AUDIT_RATE", "1.5", "a number in [0, 1]"),
    ("KGEN_VLLM_AUDIT_RATE", "-0.1", "a number in [0, 1]"),
    ("KGEN_VLLM_AUDIT_RATE", "nan", "a number in [0, 1]"),
    ("KGEN_VLLM_AUDIT_RATE", "often", "a number in [0, 1]"),
])
def test_invalid_values_are_refused_with_name_value_and_allowed(monkeypatch, name, raw, allowed):
    monkeypatch.setenv(name, raw)
    with pytest.raises(KgenUserError) as e:
        REGISTRY[name].value()
    assert name in str(e.value) and repr(raw) in str(e.value) and allowed in str(e.value)


def test_bool_kind(monkeypatch):
    flag = Setting("KGEN_TEST_ONLY_FLAG", "bool", "a flag declared only by this test", default=False)
    assert flag.value() is False
    for raw, value in (("1", True), ("Yes", True), ("off", False), ("0", False)):
        monkeypatch.setenv(flag.name, raw)
        assert flag.value() is value
    monkeypatch.setenv(flag.name, "maybe")
    with pytest.raises(KgenUserError, match="KGEN_TEST_ONLY_FLAG='maybe'.*true"):
        flag.value()


def test_bogus_backend_is_refused_not_taken_as_cpu(monkeypatch):
    monkeypatch.setenv("KGEN_BACKEND", "bogus")
    with pytest.raises(KgenUserError, match=r"KGEN_BACKEND='bogus'.*auto, cuda, cpu"):
        select_backend("auto")
    assert select_backend("cpu") == "cpu"  # an explicit backend does not consult KGEN_BACKEND
    monkeypatch.setenv("KGEN_BACKEND", "cpu")
    assert select_backend("auto") == "cpu"


def test_report_names_the_source_and_the_problem(monkeypatch):
    monkeypatch.setenv("KGEN_CXX", "g++-13")
    monkeypatch.setenv("KGEN_SIMT_THREADS", "lots")
    rows = {s.name: (value, source, problem) for s, value, source, problem in settings.report()}
    assert set(rows) == set(REGISTRY)
    assert rows["KGEN_CXX"] == ("g++-13", "environment", "")
    assert rows["KGEN_SIMT_THREADS"][2] and "KGEN_SIMT_THREADS" in rows["KGEN_SIMT_THREADS"][2]
