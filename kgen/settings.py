"""Every environment variable kgen reads, declared once: name, type, default and meaning.

Code reads a variable through its `Setting` (`KGEN_BACKEND.value()`), never through
os.environ, so `kgen env` can list them all and a value of the wrong type or outside
its choices is refused with a message naming the variable, the value and what would be
accepted, instead of silently meaning something else. A variable set to the empty
string counts as unset.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from kgen.errors import KgenUserError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE = re.compile(r"(\d+)([kKmM]?)\Z")
_EXPECTED = {
    "str": "any text",
    "path": "a path",
    "bool": "one of " + ", ".join(_TRUE + _FALSE),
    "int": "a whole number >= 0",
    "size": "a number of bytes >= 0, optionally with a k or M suffix (64k, 1M)",
    "rate": "a number in [0, 1] (0.01 = one in a hundred)",
}


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # str | path | choice | bool | int | size | rate
    help: str
    default: Any = None  # the value when unset (a callable is called); None: "not set"
    choices: tuple[str, ...] = ()  # kind "choice" only
    default_text: str = ""  # how `kgen env` shows the default when it is not a plain value

    def raw(self) -> str | None:
        """The text in the environment, None when unset or empty."""
        value = os.environ.get(self.name)
        return value if value else None

    def source(self) -> str:
        return "environment" if self.raw() is not None else "default"

    def expected(self) -> str:
        return "one of " + ", ".join(self.choices) if self.kind == "choice" else _EXPECTED[self.kind]

    def value(self) -> Any:
        """The typed value (the default when unset); KgenUserError for a value of the wrong form."""
        raw = self.raw()
        if raw is None:
            return self.default() if callable(self.default) else self.default
        parsed = _parse(self, raw)
        if parsed is None:
            raise KgenUserError(
                f"environment variable {self.name}={raw!r} is not valid: expected {self.expected()}; "
                "fix it or unset it (`kgen env` lists kgen's variables)"
            )
        return parsed

    def describe_default(self) -> str:
        if self.default_text:
            return f"({self.default_text})"
        default = self.default() if callable(self.default) else self.default
        return "unset" if default is None else str(default)


def _parse(setting: Setting, raw: str) -> Any:
    """The typed value of `raw`, or None when it has the wrong form."""
    kind = setting.kind
    if kind == "str":
        return raw
    if kind == "path":
        return Path(raw).expanduser()
    if kind == "choice":
        return raw if raw in setting.choices else None
    if kind == "bool":
        low = raw.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else None
    if kind == "int":
        return int(raw) if raw.strip().isdigit() else None
    if kind == "rate":
        try:
            value = float(raw.strip())
        except ValueError:
            return None
        return value if 0.0 <= value <= 1.0 else None  # NaN fails both comparisons
    if kind == "size":
        m = _SIZE.match(raw.strip())
        if m is None:
            return None
        return int(m[1]) << {"": 0, "k": 10, "m": 20}[m[2].lower()]
    raise ValueError(f"{setting.name}: unknown setting kind {kind!r}")


REGISTRY: dict[str, Setting] = {}


def _declare(setting: Setting) -> Setting:
    if setting.kind != "choice" and setting.kind not in _EXPECTED:
        raise ValueError(f"{setting.name}: unknown setting kind {setting.kind!r}")
    REGISTRY[setting.name] = setting
    return setting


def _user_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("kgen"))


KGEN_CACHE_DIR = _declare(Setting(
    "KGEN_CACHE_DIR", "path",
    "directory of kgen's cache: compiled kernels, loaded cubins and tuning results",
    default=_user_cache_dir,
))
KGEN_CUDA_HOME = _declare(Setting(
    "KGEN_CUDA_HOME", "path",
    "a CUDA toolkit root whose include/ replaces the headers of NVIDIA's pip wheels",
    default_text="unset: the headers of NVIDIA's pip wheels",
))
KGEN_CXX = _declare(Setting(
    "KGEN_CXX", "str",
    "C++ compiler of the CPU backend (a name on PATH or a path)",
    default="g++",
))
KGEN_BACKEND = _declare(Setting(
    "KGEN_BACKEND", "choice",
    "the backend that backend='auto' picks (auto: CUDA when a GPU is visible, else the CPU)",
    default="auto", choices=("auto", "cuda", "cpu"),
))
KGEN_SIMT_THREADS = _declare(Setting(
    "KGEN_SIMT_THREADS", "int",
    "worker threads of the CPU backend's runtime (0: one per CPU core)",
    default=0,
))
KGEN_SIMT_STACK = _declare(Setting(
    "KGEN_SIMT_STACK", "size",
    "stack size of each simulated GPU thread on the CPU backend (0: the runtime's default, 64k; 512k "
    "with the sanitizer)",
    default=0,
))

KGEN_DEBUG = _declare(Setting(
    "KGEN_DEBUG", "bool",
    "check the values a kernel trusts (seq_lens, block-table entries, slots) on every call; on device "
    "arrays this copies them to the host (a synchronisation); a kernel's `debug` attribute overrides it",
    default=None, default_text="unset: checked for host arrays, not for device arrays",
))

KGEN_VLLM_BACKEND = _declare(Setting(
    "KGEN_VLLM_BACKEND", "str",
    "the vLLM attention backends kgen's vLLM plugin replaces through vLLM's registry, comma-separated, at most "
    "one dense (CPU_ATTN, FLASH_ATTN, ...) and one MLA backend (CPU_MLA, FLASHMLA, ...); unset, the plugin "
    "registers CUSTOM (dense) and CUSTOM_MLA (MLA) only (docs/vllm.md)",
    default=None, default_text="unset: register CUSTOM and CUSTOM_MLA only",
))
KGEN_VLLM_SPEC_DIR = _declare(Setting(
    "KGEN_VLLM_SPEC_DIR", "path",
    "a folder of kgen specs (as `kgen specs-for-model` writes them) that the vLLM backend uses in place of "
    "the specs it derives, matched by name: tuned configs or edited specs go into service this way",
    default=None, default_text="unset: the derived specs",
))

KGEN_VLLM_SOURCE_DIR = _declare(Setting(
    "KGEN_VLLM_SOURCE_DIR", "path",
    "a folder of hand-written kernel sources, <spec name>.cu with the spec named as `kgen specs-for-model` "
    "names it (any prefix, then _<layer key>_<kind>): each is verified (kgen.load_source) and serves that layer "
    "type's kind in place of kgen's kernel",
    default=None, default_text="unset: kgen's own kernels",
))
KGEN_VLLM_AUDIT_RATE = _declare(Setting(
    "KGEN_VLLM_AUDIT_RATE", "rate",
    "the fraction of decode and prefill calls the vLLM backend recomputes with a trusted kernel and checks "
    "within the verifier's bound (kern.audit: a mismatch raises kgen.AuditError and stops the step)",
    default=0.0,
))

KGEN_VLLM_MIXED = _declare(Setting(
    "KGEN_VLLM_MIXED", "choice",
    "how the vLLM backend serves a batch of one-token requests and prefill chunks: split (paged_decode for the "
    "one-token rows, paged_prefill for the chunks), prefill (every row through paged_prefill) or auto (split on "
    "the CUDA backend, prefill on the CPU backend, where it is the faster: benchmarks/vllm_cpu.py)",
    default="auto", choices=("auto", "split", "prefill"),
))


def cache_dir() -> Path:
    return KGEN_CACHE_DIR.value()


def child_environment() -> dict[str, str]:
    """A copy of this process's environment, for a child process kgen starts (the one place kgen
    hands the environment on, so every variable it *reads* stays declared above)."""
    return dict(os.environ)


def report() -> list[tuple[Setting, str, str, str]]:
    """For `kgen env`: (setting, value as shown, where it came from, problem or "") for each."""
    rows = []
    for setting in REGISTRY.values():
        raw = setting.raw()
        problem = ""
        try:
            setting.value()
        except KgenUserError as e:
            problem = str(e)
        rows.append((setting, raw if raw is not None else setting.describe_default(), setting.source(), problem))
    return rows

