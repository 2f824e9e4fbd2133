"""kgen's vLLM v1 attention backend: decoder attention served by kgen kernels (docs/vllm.md).

The KV cache is the one vLLM allocates, used in place: each layer's pages are vLLM's logical
`[num_blocks, num_kv_heads, block_size, 2 * head_dim]` (layout LBHNC), and kgen reads each
(block, KV head) cell as its K rows `[block_size, head_dim]` followed by its V rows, i.e. two
strided `separate`/HND pools (block stride `num_kv_heads * 2 * block_size * head_dim`). The same
reading is vLLM's CPU backend's, so nothing about the page differs from what vLLM sizes.

Per layer and step: `cache_write` stores the new K/V (with vLLM's per-tensor fp8 scales), then
`paged_decode` serves the one-token requests and `paged_prefill` the chunks (kgen/vllm/metadata.py).
The builder makes the kgen plans once per step, not per layer call.
"""

from __future__ import annotations

import inspect
import logging
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from kgen.errors import KgenError
from kgen.model_specs import LayerAttention, kgen_dtype, kv_cache_dtype, layer_specs
from kgen.settings import KGEN_VLLM_BACKEND, KGEN_VLLM_MIXED
from kgen.vllm.kernels import LayerKernels, count_launch, kernels_for
from kgen.vllm.metadata import KgenAttentionMetadata, translate

log = logging.getLogger("vllm.kgen")  # under vLLM's logger: its handler and level apply

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # kgen: a power of two up to 256
HEAD_SIZES = list(range(32, 513, 8))  # kgen: a multiple of 8 in 32..512


def registered_name() -> str:
    """The vLLM backend name kgen serves as (CUSTOM, or KGEN_VLLM_BACKEND's)."""
    return KGEN_VLLM_BACKEND.value() or "CUSTOM"


class KgenAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3",
                                                       "fp8_e5m2"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return registered_name()

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:  # gpt-oss's learned per-head sinks (docs/abi.md)
        return True

    @staticmethod
    def get_impl_cls() -> type[KgenAttentionImpl]:
        return KgenAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KgenMetadataBuilder]:
        return KgenMetadataBuilder


class KgenMetadataBuilder(AttentionMetadataBuilder[KgenAttentionMetadata]):
    # kgen's plans are capture-safe (docs/abi.md, Plans), but this backend has not been run under
    # vLLM's CUDA graphs: it declares none rather than a support nobody has tested.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        # Build (or load) and verify every layer's kernels now, at start-up, with the block size the
        # KV cache really has, so that a layer kgen cannot serve stops start-up naming the layer.
        self.kernel_sets: dict[str, LayerKernels] = {}
        self.split_decodes = True
        layers = get_layers_from_vllm_config(vllm_config, torch.nn.Module, layer_names)
        for name in layer_names:
            impl = getattr(layers.get(name), "impl", None)
            if isinstance(impl, KgenAttentionImpl):
                kernels = impl.prepare(name, kv_cache_spec.block_size)
                self.kernel_sets.setdefault(kernels.name, kernels)
        # On a GPU one-token rows go to paged_decode (paged_prefill would pad each to a 16-row MMA tile);
        # on the CPU backend paged_prefill serves them faster (benchmarks/vllm_cpu.py, docs/vllm.md).
        mode = KGEN_VLLM_MIXED.value()
        backends = {k.decode.backend for k in self.kernel_sets.values()}
        self.split_decodes = mode == "split" or (mode == "auto" and backends != {"cpu"})

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        meta = translate(common_attn_metadata, split=self.split_decodes)
        for name, kernels in self.kernel_sets.items():
            meta.plans[name] = (
                kernels.decode.plan(meta.decode.seq_lens) if meta.decode else None,
                kernels.prefill.plan(meta.prefill.seq_lens, q_indptr=meta.prefill.q_indptr_cpu)
                if meta.prefill else None)
        return meta


class KgenAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 **unsupported) -> None:
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes = (torch.tensor(alibi_slopes, dtype=torch.float32) if alibi_slopes is not None
                             else None)
        self.sinks = sinks  # the layer's parameter [num_heads]: its weights are loaded after this
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"attention sinks of shape {list(sinks.shape)}: expected one per query head "
                             f"[{num_heads}]")
        self.layer_name = _constructing_layer_name()
        reasons = []
        if attn_type != AttentionType.DECODER:
            reasons.append(f"attention type {attn_type} (kgen serves decoder attention)")
        reasons += [f"{key} (not supported by kgen's backend)" for key, v in unsupported.items() if v]
        config = get_current_vllm_config()
        self.model_dtype = config.model_config.dtype if config.model_config is not None else torch.float32
        block_size = getattr(config.cache_config, "block_size", None) or 16
        try:
            self.layer = self._layer(block_size, logits_soft_cap)
            layer_specs(self.layer, prefix="vllm")  # refuse what kgen cannot build, at start-up
        except KgenError as e:
            reasons.append(str(e))
        if reasons:
            raise ValueError(f"kgen cannot serve attention layer {self.layer_name} (heads {num_heads}, kv heads "
                             f"{num_kv_heads}, head size {head_size}, dtype {self.model_dtype}, kv cache "
                             f"{kv_cache_dtype}): " + "; ".join(reasons))
        self.kernels: LayerKernels | None = None

    def _layer(self, block_size: int, soft_cap: float | None) -> LayerAttention:
        dtype = kgen_dtype(self.model_dtype)
        return LayerAttention(self.num_heads, self.num_kv_heads, self.head_size, self.scale, dtype,
                              kv_cache_dtype(self.kv_cache_dtype, dtype), int(block_size),
                              sliding_window=self.sliding_window or None, logits_soft_cap=soft_cap or None,
                              alibi=self.alibi_slopes is not None, sinks=self.sinks is not None)

    def prepare(self, layer_name: str, block_size: int) -> LayerKernels:
        """Build (first use) the verified kernels for the cache's block size; log which serve the layer."""
        self.layer_name = layer_name
        self.layer = self._layer(block_size, self.layer.logits_soft_cap)
        try:
            self.kernels = kernels_for(self.layer)
        except KgenError as e:
            raise ValueError(f"kgen cannot serve attention layer {layer_name}: {e}") from None
        log.info("kgen: layer %s served by %s (cache_write, decode, prefill)", layer_name, self.kernels.name)
        return self.kernels

    def _pools(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return page_pools(kv_cache, self.head_size)

    def _scales(self, layer) -> dict[str, float]:
        if not self.layer.kv_dtype.startswith("fp8"):
            return {}
        return {"k_scale": float(layer._k_scale_float), "v_scale": float(layer._v_scale_float)}

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        n = int(slot_mapping.shape[0])
        if n == 0:
            return
        k_pool, v_pool = self._pools(kv_cache)
        self.kernels.cache_write(key=key[:n], value=value[:n], k_cache=k_pool, v_cache=v_pool,
                                 slot_mapping=slot_mapping, **self._scales(layer))
        count_launch(self.layer_name, "cache_write")

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KgenAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kgen's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output
        k_pool, v_pool = self._pools(kv_cache)
        common = {"k_cache": k_pool, "v_cache": v_pool, **self._scales(layer)}
        if self.alibi_slopes is not None:
            common["alibi_slopes"] = self.alibi_slopes.to(query.device)
        if self.sinks is not None:  # read at each call: the model's bf16 weights as the ABI's fp32
            common["sinks"] = self.sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
        decode_plan, prefill_plan = attn_metadata.plans.get(self.kernels.name, (None, None))
        if (rows := attn_metadata.decode) is not None:
            self.kernels.decode(q=query[rows.row_start:rows.row_end], out=output[rows.row_start:rows.row_end],
                                block_tables=rows.block_tables, seq_lens=rows.seq_lens, plan=decode_plan, **common)
            count_launch(self.layer_name, "decode")
        if (rows := attn_metadata.prefill) is not None:
            self.kernels.prefill(q=query[rows.row_start:rows.row_end], out=output[rows.row_start:rows.row_end],
                                 q_indptr=rows.q_indptr, block_tables=rows.block_tables, seq_lens=rows.seq_lens,
                                 plan=prefill_plan, **common)
            count_launch(self.layer_name, "prefill")
        return output


def page_pools(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools [num_blocks, H, B, D] of one layer's vLLM pages [num_blocks, H, B, 2 * D]: strided
    views, no copy (an fp8 cache is read as uint8, which kgen takes as the spec's fp8 type)."""
    nb, h, b, _ = kv_cache.shape
    if kv_cache.element_size() == 1:
        kv_cache = kv_cache.view(torch.uint8)
    rows = kv_cache.view(nb, h, 2 * b, head_size)
    return rows[:, :, :b], rows[:, :, b:]


def _constructing_layer_name() -> str:
    """The name (prefix) of the vLLM Attention layer whose __init__ is constructing this impl, for
    messages; vLLM passes the impl no name of its own."""
    frame = inspect.currentframe()
    for _ in range(6):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            break
        prefix = frame.f_locals.get("prefix")
        if isinstance(prefix, str) and prefix:
            return prefix
    return "(unnamed)"
