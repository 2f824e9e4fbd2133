"""kgen as a vLLM attention backend (docs/vllm.md).

`pip install 'kgen[vllm]'` makes vLLM call `register()` at start-up (the `vllm.general_plugins`
entry point). It registers two backends: kgen's dense attention as `CUSTOM` (`--attention-backend
CUSTOM`) and kgen's multi-head latent attention (DeepSeek-V2/V3, Kimi K2) as a new name,
`CUSTOM_MLA`. KGEN_VLLM_BACKEND names vLLM backends kgen replaces instead (comma-separated, at most
one dense and one MLA backend): vLLM's CPU platform always takes CPU_ATTN, and CPU_MLA for MLA
models, so `KGEN_VLLM_BACKEND=CPU_ATTN,CPU_MLA` is how kgen serves there. Sparse MLA backends
(DeepSeek-V3.2) are refused by name. Importing this package does not import vLLM; `register()`
and the backend modules do.
"""

from __future__ import annotations

from kgen.errors import KgenUserError
from kgen.vllm.kernels import launch_counts, reset_launch_counts
from kgen.vllm.names import (
    BACKEND_CLASS,
    MLA_BACKEND_CLASS,
    MLA_NAME,
    SPARSE_MLA_REFUSAL,
    backend_names,
)

__all__ = ["BACKEND_CLASS", "MLA_BACKEND_CLASS", "MLA_NAME", "SPARSE_MLA_REFUSAL", "backend_names", "launch_counts",
           "register", "reset_launch_counts"]


def register() -> dict[str, str]:
    """Register kgen's backends with vLLM's registry; returns {"dense": name, "mla": name} they serve as."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    names = backend_names()
    for kind, path in (("dense", BACKEND_CLASS), ("mla", MLA_BACKEND_CLASS)):
        name = names[kind]
        if name == MLA_NAME and name not in AttentionBackendEnum.__members__:
            register_backend(name, path)  # a new member (vLLM's registry allows third-party names)
            continue
        try:
            member = AttentionBackendEnum[name]
        except (KeyError, ValueError):
            known = ", ".join(AttentionBackendEnum.__members__)
            raise KgenUserError(f"KGEN_VLLM_BACKEND={name!r} is not a vLLM attention backend; "
                                f"expected one of {known}") from None
        register_backend(member, path)
    return names
