"""kgen as a vLLM attention backend (docs/vllm.md).

`pip install 'kgen[vllm]'` makes vLLM call `register()` at start-up (the `vllm.general_plugins`
entry point). It registers kgen's backend as `CUSTOM` (`--attention-backend CUSTOM`), or, with
KGEN_VLLM_BACKEND set, in place of that vLLM backend (vLLM's CPU platform always takes CPU_ATTN,
so `KGEN_VLLM_BACKEND=CPU_ATTN` is how kgen serves there). Importing this package does not
import vLLM; `register()` and the backend module do.
"""

from __future__ import annotations

from kgen.errors import KgenUserError
from kgen.settings import KGEN_VLLM_BACKEND
from kgen.vllm.kernels import launch_counts, reset_launch_counts

BACKEND_CLASS = "kgen.vllm.backend.KgenAttentionBackend"

__all__ = ["BACKEND_CLASS", "launch_counts", "register", "reset_launch_counts"]


def register() -> str:
    """Register kgen's backend with vLLM's registry; returns the vLLM backend name it serves as."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    name = KGEN_VLLM_BACKEND.value() or "CUSTOM"
    try:
        member = AttentionBackendEnum[name]
    except (KeyError, ValueError):
        names = ", ".join(AttentionBackendEnum.__members__)
        raise KgenUserError(f"KGEN_VLLM_BACKEND={name!r} is not a vLLM attention backend; "
                            f"expected one of {names}") from None
    register_backend(member, BACKEND_CLASS)
    return name
