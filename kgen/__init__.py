"""kgen: specialized paged-attention kernels from YAML specs.

    spec = kgen.load_spec("specs/llama3_8b_decode.yaml")
    kern = kgen.build(spec, backend="auto")          # renders, compiles, verifies
    out = kern(q=q, k_cache=k, v_cache=v, block_tables=bt, seq_lens=sl)
    mine = kgen.load_source(spec, "mine.cu")         # a hand-written kernel, verified (VerificationError)
    audited = mine.audit(rate=0.01)                  # 1 % of calls re-checked (AuditError)
"""

# Imported eagerly on purpose: `build` and `verify` share their names with submodules, and a
# lazy (PEP 562) export would be shadowed by the submodule once anything imports it.
from kgen import interop, torch_ops  # neither imports torch: `import kgen` stays cheap
from kgen.build import build
from kgen.errors import (
    ArgumentError,
    AuditError,
    CompileError,
    KernelRuntimeError,
    KgenError,
    KgenUserError,
    SpecError,
    ToolchainError,
    UnsupportedError,
    VerificationError,
)
from kgen.kernel import Kernel
from kgen.model_specs import specs_for_model
from kgen.spec.models import Spec, json_schema, load_spec, parse_spec, spec_from_dict
from kgen.verify.judge.report import CaseResult, VerificationReport
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import load_source
from kgen.version import __version__

__all__ = [
    "ArgumentError", "AuditError", "CaseResult", "CompileError", "Kernel", "KernelRuntimeError", "KgenError", "KgenUserError",
    "Spec", "SpecError", "ToolchainError", "UnsupportedError", "VerificationError", "VerificationReport",
    "__version__", "build", "interop", "json_schema", "load_source", "load_spec", "parse_spec", "spec_from_dict", "specs_for_model", "torch_ops",
    "verify",
]
