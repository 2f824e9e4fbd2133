"""kgen's vLLM backend for multi-head latent attention (DeepSeek-V2/V3, Kimi K2; docs/vllm.md "MLA").

vLLM's MLA layer (`MLAAttention.forward_impl`) runs the requests its metadata counts as decodes
through `forward_mqa` in the absorbed form: the query projected into the latent space, one row
of `kv_lora_rank + qk_rope_head_dim` per (token, head), attention over the cache's latent rows,
the latent output `[tokens, heads, kv_lora_rank]` projected back by the layer (`_v_up_proj`). Its
other requests go to `forward_mha`, a non-absorbed attention over K/V re-expanded from the latent
cache. kgen's MLA kernels are absorbed (docs/mla.md), so this backend counts every request as an
MQA request (`num_decode_tokens` = every token) and splits them itself, as the dense backend does:
one-token rows to kgen's mla `paged_decode`, the rest (prompt chunks) to its mla `paged_prefill`,
which is causal over each request's prefix and itself.

The cache is vLLM's `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (the layer binds
it with the head axis squeezed): kgen's mla pool as it is, used in place. `cache_write` stores
each token's `[kv_c_normed | k_pe]` row at vLLM's slot.

Sparse MLA (DeepSeek-V3.2's top-k attention) is refused by name: kgen has no sparse MLA kernel to
serve it yet (SPARSE_MLA_REFUSAL says what the plugin would need).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import AttentionType, MLAAttentionImpl

from kgen.errors import KgenError
from kgen.families.registry import family_for
from kgen.model_specs import LayerAttention, kgen_dtype, layer_specs
from kgen.model_specs import kv_cache_dtype as kgen_kv_dtype
from kgen.vllm.backend import (
    _ACCEPTED,
    _VALIDATE_PARAMETERS,
    KgenBackendRules,
    KgenMetadataBuilder,
    _constructing_layer_name,
    _explained,
    step_metadata,
)
from kgen.vllm.buffers import StepBuffers
from kgen.vllm.kernels import (
    LayerKernels,
    count_launch,
    kernels_for,
    serve_regions,
    serving_backend,
)
from kgen.vllm.metadata import KgenAttentionMetadata
from kgen.vllm.names import SPARSE_MLA_REFUSAL, backend_names

log = logging.getLogger("vllm.kgen")


def registered_mla_name() -> str:
    """The vLLM backend name kgen's MLA backend serves as (CUSTOM_MLA, or KGEN_VLLM_BACKEND's MLA name)."""
    return backend_names()["mla"]


# What kgen's MLA backend accepts where it differs from the dense backend's (vLLM's reason -> _ACCEPTED's form)
_MLA_ACCEPTED = _ACCEPTED | {
    "dtype not supported": ("dtype", "dtype", "torch.float16 or torch.bfloat16 (kgen's mla kernels take 16-bit q)"),
    "head_size not supported": ("head_size", "head_size",
                                "kv_lora_rank + qk_rope_head_dim, a multiple of 8 in 32..1024"),
}


class KgenMLABackend(KgenBackendRules, MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]  # kgen's mla kernels: 16-bit q
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return registered_mla_name()

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(32, 1025, 8))  # kv_lora_rank + qk_rope_head_dim; kgen's spec rules decide the rest

    @staticmethod
    def get_impl_cls() -> type[KgenMLAImpl]:
        return KgenMLAImpl

    @staticmethod
    def get_builder_cls() -> type[KgenMLAMetadataBuilder]:
        return KgenMLAMetadataBuilder

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # nothing has checked a connector's reading of these pages against kgen's

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        if use_sparse:
            return SPARSE_MLA_REFUSAL
        return None

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        reasons = super().validate_configuration(*args, **kwargs)
        given = dict(zip(_VALIDATE_PARAMETERS, args, strict=False)) | kwargs
        return [SPARSE_MLA_REFUSAL if r == "sparse not supported" else _explained(r, given, _MLA_ACCEPTED)
                for r in reasons]


@dataclass
class KgenMLAMetadata:
    """What vLLM's MLA layer reads of a batch, and kgen's row groups and plans (`decode`). To the
    layer every request is an MQA ("decode") request: `num_decode_tokens` is every token."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    decode: KgenAttentionMetadata
    buffers: StepBuffers  # the builder's: the joined query, the latent output, the new cache rows
    num_prefills: int = 0
    prefill: Any = None  # vLLM's forward_mha path: never taken
    causal: bool = True


class KgenMLAMetadataBuilder(KgenMetadataBuilder):
    """The dense builder's row groups and plans (kgen/vllm/metadata.py) for mla kernel sets, wrapped
    as vLLM's MLA layer reads them. Speculative decoding's verification requests are prompt chunks
    here (no drafts kernel for mla yet)."""

    drafts_supported: ClassVar[bool] = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.buffers = StepBuffers(self._slots.shape[0])  # as many rows as the slot buffer: a step's most tokens

    @staticmethod
    def _check_cache_spec(kv_cache_spec, layer_names) -> None:
        return None  # one latent row per token (head_size_v 0): kgen's spec rules check its width

    @staticmethod
    def _serves(impl) -> bool:
        return isinstance(impl, KgenMLAImpl)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        return self._wrapped(super().build(common_prefix_len, common_attn_metadata, fast_build), common_attn_metadata)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return self._wrapped(super().build_for_cudagraph_capture(common_attn_metadata), common_attn_metadata)

    def _wrapped(self, meta: KgenAttentionMetadata, common) -> KgenMLAMetadata:
        return KgenMLAMetadata(num_actual_tokens=meta.num_actual_tokens, num_reqs=int(common.num_reqs),
                               max_query_len=int(common.max_query_len), max_seq_len=int(common.max_seq_len),
                               query_start_loc=common.query_start_loc, slot_mapping=meta.slot_mapping,
                               num_decodes=int(common.num_reqs), num_decode_tokens=meta.num_actual_tokens, decode=meta,
                               buffers=self.buffers)


class KgenMLAImpl(MLAAttentionImpl):
    can_return_lse_for_decode: bool = False  # no decode context parallelism (refused below)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None,
                 q_lora_rank: int | None = None, kv_lora_rank: int = 512, qk_nope_head_dim: int = 128,
                 qk_rope_head_dim: int = 64, qk_head_dim: int | None = None, v_head_dim: int = 128,
                 kv_b_proj=None, indexer=None, q_pad_num_heads: int | None = None, **unsupported) -> None:
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank, self.qk_rope_head_dim = int(kv_lora_rank), int(qk_rope_head_dim)
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.q_pad_num_heads = None  # kgen takes any number of query heads
        self.layer_name = _constructing_layer_name()
        if indexer is not None or unsupported.get("topk_indices_buffer") is not None:
            raise NotImplementedError(f"kgen cannot serve attention layer {self.layer_name}: {SPARSE_MLA_REFUSAL}")
        reasons = []
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type} (kgen serves decoder attention)")
        for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                            ("logits_soft_cap", logits_soft_cap),
                            ("kv_sharing_target_layer_name", kv_sharing_target_layer_name)):
            if value:
                reasons.append(f"{name} (kgen's mla kernels take none)")
        reasons += [f"{key} (not supported by kgen's backend)" for key, v in unsupported.items() if v]
        if getattr(self, "dcp_world_size", 1) > 1:
            reasons.append(f"decode context parallelism (size {self.dcp_world_size}; kgen serves size 1)")
        config = get_current_vllm_config()
        self.model_dtype = config.model_config.dtype if config.model_config is not None else torch.bfloat16
        try:
            self.layer = self._layer(getattr(config.cache_config, "block_size", None) or 16)
            for spec in layer_specs(self.layer, prefix="vllm").values():  # refuse what kgen cannot build, at start-up
                family_for(spec)  # the mla kernels' own refusals (16-bit q, the cache dtypes they read)
        except KgenError as e:
            reasons.append(str(e))
        if reasons:
            raise ValueError(f"kgen cannot serve MLA layer {self.layer_name} (heads {num_heads}, kv_lora_rank "
                             f"{kv_lora_rank}, qk_rope_head_dim {qk_rope_head_dim}, dtype {self.model_dtype}, "
                             f"kv cache {kv_cache_dtype}): " + "; ".join(reasons))
        self.kernels: LayerKernels | None = None

    def _layer(self, block_size: int) -> LayerAttention:
        """The absorbed layer as kgen.model_specs derives it from a DeepSeek config (_mla_layers)."""
        dtype = kgen_dtype(self.model_dtype)
        return LayerAttention(self.num_heads, 1, self.kv_lora_rank + self.qk_rope_head_dim, self.scale, dtype,
                              kgen_kv_dtype(self.kv_cache_dtype, dtype), int(block_size),
                              v_head_dim=self.kv_lora_rank, layout="mla")

    def prepare(self, layer_name: str, block_size: int, draft_q_len: int = 1) -> LayerKernels:
        """Build (first use) and verify the layer type's mla kernels for the cache's block size."""
        self.layer_name = layer_name
        self.layer = self._layer(block_size)
        try:
            self.kernels = kernels_for(self.layer, backend=serving_backend())
        except KgenError as e:
            raise ValueError(f"kgen cannot serve MLA layer {layer_name}: {e}") from None
        log.info("kgen: MLA layer %s served by %s (cache_write, decode, prefill)", layer_name, self.kernels.name)
        return self.kernels

    def _scale(self, layer) -> dict[str, torch.Tensor]:
        """vLLM's per-tensor fp8 scale of the latent cache (the layer's k_scale)."""
        return {"kv_scale": layer._k_scale} if self.layer.kv_dtype.startswith("fp8") else {}

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        n = int(slot_mapping.shape[0])
        if n == 0 or kv_cache.numel() == 0:
            return
        meta = step_metadata(self.layer_name, KgenMLAMetadata)
        parts = (kv_c_normed[:n], k_pe[:n].reshape(n, -1))
        rows = _joined(meta, "cache_rows", parts)  # [T, kv_lora_rank + rope]
        scale = {"kv_scale": k_scale} if self.layer.kv_dtype.startswith("fp8") else {}
        # the builder's int32 copy of this step's slots (one narrowing per step, as in the dense impl), else vLLM's
        slots = meta.slot_mapping if meta is not None and meta.slot_mapping.shape[0] == n else slot_mapping.flatten()[:n]
        self.kernels.cache_write(kv=rows, kv_cache=_pool(kv_cache), slot_mapping=slots, **scale)
        count_launch(self.layer_name, "cache_write")

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: KgenMLAMetadata, layer):
        """The absorbed attention of every token: q [T, heads, kv_lora_rank + rope] (or its two parts)
        -> the latent output [T, heads, kv_lora_rank], and no LSE."""
        if isinstance(q, tuple):
            q = _joined(attn_metadata, "q", q)
        shape = (q.shape[0], q.shape[1], self.kv_lora_rank)
        out = attn_metadata.buffers.take("out", shape, q.dtype, q.device)  # read by the layer before the next's call
        common = {"kv_cache": _pool(kv_c_and_k_pe_cache), **self._scale(layer)}
        serve_regions(self.kernels, self.layer_name, attn_metadata.decode, q, out, common)
        return out, None


def _pool(kv_cache: torch.Tensor) -> torch.Tensor:
    """The layer's latent cache as kgen's mla pool [num_blocks, block_size, D] (an fp8 cache as bytes)."""
    if kv_cache.dim() == 4:  # [num_blocks, 1, block_size, D] before the layer squeezes it
        kv_cache = kv_cache.squeeze(1)
    return kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache



def _joined(meta: KgenMLAMetadata | None, name: str, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`parts` joined on their last dimension into the builder's buffer `name` (a new tensor outside a
    model step, where there is no builder's metadata)."""
    if meta is None:
        return torch.cat(parts, dim=-1)
    shape = (*parts[0].shape[:-1], sum(int(p.shape[-1]) for p in parts))
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))  # torch.cat's own result type
    return torch.cat(parts, dim=-1, out=meta.buffers.take(name, shape, dtype, parts[0].device))
