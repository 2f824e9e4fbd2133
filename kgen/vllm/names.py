"""The vLLM backend names kgen's two backends (dense and MLA) serve as, from KGEN_VLLM_BACKEND
(docs/vllm.md "Install and select"), and sparse MLA's refusal. Imports no vLLM."""

from __future__ import annotations

from kgen.errors import KgenUserError
from kgen.settings import KGEN_VLLM_BACKEND

BACKEND_CLASS = "kgen.vllm.backend.KgenAttentionBackend"
MLA_BACKEND_CLASS = "kgen.vllm.mla.KgenMLABackend"
MLA_NAME = "CUSTOM_MLA"  # the name kgen's MLA backend registers under when it replaces none of vLLM's
# vLLM's sparse attention backends (DeepSeek-V3.2's DSA and its successors, MiniMax's MSA): names holding one of these
_SPARSE_MARKS = ("SPARSE", "DSV4", "MSA")
SPARSE_MLA_REFUSAL = (
    "sparse MLA (DeepSeek-V3.2's top-k attention) is not served by kgen's vLLM plugin: kgen has no sparse MLA "
    "kernel yet. Serving it needs a sparse backend (`is_sparse`) whose impl takes vLLM's indexer and its top-k "
    "indices buffer, turns each token's top-k request-local positions into kgen's physical slots "
    "(block_table[i // block_size] * block_size + i % block_size, -1 kept), and calls a kgen spec with "
    "`attention.sparse_topk` (the config's index_topk) over vLLM's `fp8_ds_mla` cache (656 bytes a token); "
    "vLLM serves sparse MLA on GPUs only")


def backend_kind(name: str) -> str:
    """"dense", "mla" or "sparse" for a vLLM attention backend name."""
    if any(mark in name for mark in _SPARSE_MARKS):
        return "sparse"
    return "mla" if "MLA" in name else "dense"


def backend_names() -> dict[str, str]:
    """{"dense": name, "mla": name}: the vLLM backend names kgen's two backends serve as."""
    chosen: dict[str, str] = {}
    for name in (n.strip() for n in (KGEN_VLLM_BACKEND.value() or "").split(",")):
        if not name:
            continue
        kind = backend_kind(name)
        if kind == "sparse":
            raise KgenUserError(f"KGEN_VLLM_BACKEND names {name}, a sparse attention backend: {SPARSE_MLA_REFUSAL}")
        if kind in chosen:
            raise KgenUserError(f"KGEN_VLLM_BACKEND names two {kind} backends ({chosen[kind]}, {name}); accepted: at "
                                "most one dense and one MLA backend, comma-separated (e.g. CPU_ATTN,CPU_MLA)")
        chosen[kind] = name
    return {"dense": chosen.get("dense", "CUSTOM"), "mla": chosen.get("mla", MLA_NAME)}
