"""kgen: specialized paged-attention kernels from YAML specs.

    spec = kgen.load_spec("specs/llama3_8b_decode.yaml")
    kern = kgen.build(spec, backend="auto")          # renders, compiles, verifies
    out = kern(q=q, k_cache=k, v_cache=v, block_tables=bt, seq_lens=sl)

The public names resolve lazily (PEP 562), so `from generated.<name> import kernel`
does not pay for pydantic, Jinja and the compilers until the kernel is first called.
"""

from __future__ import annotations

import importlib

from .version import __version__ as __version__

_EXPORTS = {
    "build": "build", "Kernel": "kernel",
    "load_spec": "spec", "parse_spec": "spec", "spec_from_dict": "spec", "json_schema": "spec", "Spec": "spec",
    "verify": "verify", "VerificationReport": "verify", "CaseResult": "verify",
    "KgenError": "errors", "KgenUserError": "errors", "SpecError": "errors", "ArgumentError": "errors",
    "UnsupportedError": "errors", "ToolchainError": "errors", "CompileError": "errors",
    "KernelRuntimeError": "errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
