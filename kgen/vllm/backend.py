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

import numpy as np
import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from kgen.errors import KgenError
from kgen.model_specs import LayerAttention, kgen_dtype, layer_specs
from kgen.model_specs import kv_cache_dtype as kgen_kv_dtype
from kgen.settings import KGEN_VLLM_MIXED
from kgen.vllm.kernels import (
    LayerKernels,
    count_launch,
    kernels_for,
    serve_regions,
    serving_backend,
)
from kgen.vllm.metadata import KgenAttentionMetadata, translate
from kgen.vllm.names import backend_names

log = logging.getLogger("vllm.kgen")  # under vLLM's logger: its handler and level apply

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # kgen: a power of two up to 256
HEAD_SIZES = list(range(32, 513, 8))  # kgen: a multiple of 8 in 32..512
MIN_COMPUTE_CAPABILITY = (8, 0)  # kgen builds for sm_80 and newer (docs/abi.md)
_VALIDATE_PARAMETERS = list(inspect.signature(AttentionBackend.validate_configuration).parameters)
_ACCEPTED = {  # vLLM's reason -> (the setting it names, its validate_configuration parameter, what kgen accepts)
    "head_size not supported": ("head_size", "head_size", "a multiple of 8 in 32..512"),
    "dtype not supported": ("dtype", "dtype", "torch.float16, torch.bfloat16 or torch.float32"),
    "kv_cache_dtype not supported": ("kv_cache_dtype", "kv_cache_dtype",
                                     "auto, float16, bfloat16, fp8, fp8_e4m3 or fp8_e5m2"),
    "block_size not supported": ("block_size", "block_size", "a power of two up to 256"),
    "compute capability not supported": ("the GPU's compute capability", "device_capability",
                                         "8.0 or newer (Ampere, Ada, Hopper, Blackwell)"),
    "KV connector not supported": (
        "kv_transfer_config", None, "none: kgen's pages hold each block's K rows then its V rows per KV head, not "
        "vLLM's [K | V] per token, so a KV connector or a disaggregated peer on another backend would misread them"),
    "non-causal attention not supported": ("attention_config.use_non_causal", None, "causal attention only"),
    "device-cpu query lens mismatch not supported, this is needed for adaptive verification": (
        "speculative_config.enable_adaptive_verification", None, "off: kgen plans each batch from the host's lengths"),
}


def registered_name() -> str:
    """The vLLM backend name kgen's dense backend serves as (CUSTOM, or KGEN_VLLM_BACKEND's)."""
    return backend_names()["dense"]


class KgenBackendRules:
    """What kgen's dense and MLA backends answer alike (mixed in before vLLM's backend class)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is None or capability.major >= MIN_COMPUTE_CAPABILITY[0]

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the plans are made from the host's lengths (no device-to-host copy per step)


class KgenAttentionBackend(KgenBackendRules, AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3",
                                                       "fp8_e5m2"]

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

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # A page holds each (block, KV head)'s K rows, then its V rows; vLLM's GPU backends store
        # [K | V] per token, so a connector or a non-kgen peer would read one layout as the other.
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        """What kgen's spec rules refuse for this head size, dtype, cache and block size (the head
        counts are the layer's, checked when vLLM constructs it)."""
        vllm_refuses = not (cls.supports_head_size(head_size) and cls.supports_dtype(dtype)
                            and cls.supports_kv_cache_dtype(kv_cache_dtype))
        if use_mla or use_sparse or vllm_refuses:
            return None  # refused by name by validate_configuration itself
        try:
            layer = LayerAttention(1, 1, head_size, 1.0, kgen_dtype(dtype),
                                   kgen_kv_dtype(str(kv_cache_dtype or "auto"), kgen_dtype(dtype)),
                                   int(block_size or 16), sinks=has_sink)
            layer_specs(layer, prefix="vllm")
        except KgenError as e:
            return f"kgen: {e}"
        return None

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's reasons, each with the setting and what kgen accepts, so that vLLM can name them
        when it falls back to another backend (it asks before any layer is constructed)."""
        reasons = super().validate_configuration(*args, **kwargs)
        given = dict(zip(_VALIDATE_PARAMETERS, args, strict=False)) | kwargs
        return [_explained(r, given) for r in reasons]

    @staticmethod
    def get_impl_cls() -> type[KgenAttentionImpl]:
        return KgenAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KgenMetadataBuilder]:
        return KgenMetadataBuilder


class KgenMetadataBuilder(AttentionMetadataBuilder[KgenAttentionMetadata]):
    # Full CUDA graphs of batches of one-token decode rows (padded with rows of seq_len 0): a
    # planned kgen call allocates nothing and never waits (docs/abi.md, Plans), and the capture's
    # plan covers any length the block table can address (build_for_cudagraph_capture).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # Whether speculative decoding's verification requests join the front region (served by the drafts kernel).
    drafts_supported: ClassVar[bool] = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # With speculative decoding vLLM puts the verification requests (1 + draft tokens) at the front
        # with the decode rows; kgen serves them with a prefill kernel fitted to them (translate).
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=self.drafts_supported)
        self._check_cache_spec(kv_cache_spec, layer_names)
        # Build (or load) and verify every layer's kernels now, at start-up, with the block size the
        # KV cache really has, so that a layer kgen cannot serve stops start-up naming the layer.
        self.kernel_sets: dict[str, LayerKernels] = {}
        # On a GPU one-token rows go to paged_decode (paged_prefill would pad each to a 16-row MMA tile);
        # on the CPU backend paged_prefill serves them faster (benchmarks/vllm_cpu.py, docs/vllm.md).
        mode = KGEN_VLLM_MIXED.value()
        self.split_decodes = mode == "split" or (mode == "auto" and serving_backend() != "cpu")
        self.draft_q_len = int(self.reorder_batch_threshold or 1) if self.split_decodes else 1
        layers = get_layers_from_vllm_config(vllm_config, torch.nn.Module, layer_names)
        for name in layer_names:
            impl = getattr(layers.get(name), "impl", None)
            if self._serves(impl):
                kernels = impl.prepare(name, kv_cache_spec.block_size, self.draft_q_len)
                self.kernel_sets.setdefault(kernels.name, kernels)
        # Kept across steps, so a steady-state step allocates nothing: the int32 slot mapping the
        # kernels take (vLLM's is int64) and each kernel's split-KV scratch, shared by its plans.
        tokens = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None) or 0
        self._slots = torch.empty(int(tokens), dtype=torch.int32, device=device)
        self._workspaces: dict[tuple[str, str], dict] = {}
        self._graph_plans: dict[tuple[str, int], object] = {}  # (kernel set, rows) -> the capture's plan

    @staticmethod
    def _check_cache_spec(kv_cache_spec, layer_names) -> None:
        head_size_v = getattr(kv_cache_spec, "head_size_v", None)
        if head_size_v is not None and head_size_v != kv_cache_spec.head_size:
            raise ValueError(f"kgen cannot serve attention layers {', '.join(layer_names)}: head_size_v "
                             f"{head_size_v} differs from head_size {kv_cache_spec.head_size} (kgen's vLLM pages "
                             "hold K and V of one width; accepted: head_size_v == head_size)")

    @staticmethod
    def _serves(impl) -> bool:
        """Whether `impl` is one of this builder's layers (its kernels are built here)."""
        return isinstance(impl, KgenAttentionImpl)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        meta = translate(common_attn_metadata, split=self.split_decodes,
                         slot_mapping=self._int32_slots(common_attn_metadata), draft_q_len=self.draft_q_len)
        for name, kernels in self.kernel_sets.items():
            if meta.drafts is not None:
                meta.draft_plans[name] = kernels.drafts.plan(meta.drafts.seq_lens_cpu, q_indptr=meta.drafts.q_indptr_cpu,
                                                             workspace=self._workspace(name, "drafts"))
            meta.plans[name] = (
                kernels.decode.plan(meta.decode.seq_lens_cpu, workspace=self._workspace(name, "decode"))
                if meta.decode else None,
                self._prefill_plan(name, kernels, meta.prefill) if meta.prefill else None)
        return meta

    def _prefill_plan(self, name: str, kernels: LayerKernels, rows):
        return kernels.prefill.plan(rows.seq_lens_cpu, q_indptr=rows.q_indptr_cpu,
                                    workspace=self._workspace(name, "prefill"))

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """The metadata a full CUDA graph of a one-token decode batch is captured with. The graph
        keeps the launches' grids and every pointer, and replays them with other lengths (vLLM
        rewrites its persistent seq_lens and block tables in place, padded rows get seq_len 0): so
        the plan is made for the longest sequence the block table can address, once per batch size,
        with its own split-KV scratch, and kept as long as the builder (the graphs') lives."""
        common = common_attn_metadata
        meta = translate(common, split=True, slot_mapping=self._int32_slots(common))
        if meta.prefill is not None:
            raise ValueError("kgen's backend captures CUDA graphs of one-token decode batches only "
                             f"(UNIFORM_SINGLE_TOKEN_DECODE); this batch has query lengths up to {common.max_query_len}")
        if meta.decode is None:
            return meta
        rows = meta.decode.num_seqs
        longest = int(common.block_table_tensor.shape[1]) * int(self.kv_cache_spec.block_size)
        for name, kernels in self.kernel_sets.items():
            plan = self._graph_plans.get((name, rows))
            if plan is None:
                plan = self._graph_plans[(name, rows)] = kernels.decode.plan(np.full(rows, longest, dtype=np.int32))
            meta.plans[name] = (plan, None)
        return meta

    def _workspace(self, name: str, kind: str) -> dict:
        return self._workspaces.setdefault((name, kind), {})

    def _int32_slots(self, common) -> torch.Tensor:
        """vLLM's slot mapping narrowed into the persistent int32 buffer (a copy kernel, no allocation
        after the first step); the kernels would otherwise narrow it per layer."""
        n = int(common.num_actual_tokens)
        if self._slots.shape[0] < n:
            self._slots = torch.empty(n, dtype=torch.int32, device=common.slot_mapping.device)
        self._slots[:n].copy_(common.slot_mapping[:n])
        return self._slots[:n]


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
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}  # fp32 slopes and sinks as kernels read them
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
                              kgen_kv_dtype(self.kv_cache_dtype, dtype), int(block_size),
                              sliding_window=self.sliding_window or None, logits_soft_cap=soft_cap or None,
                              alibi=self.alibi_slopes is not None, sinks=self.sinks is not None)

    def prepare(self, layer_name: str, block_size: int, draft_q_len: int = 1) -> LayerKernels:
        """Build (first use) the verified kernels for the cache's block size (and, for `draft_q_len` >
        1, the prefill kernel fitted to speculative decoding's verification requests); log which
        serve the layer."""
        self.layer_name = layer_name
        self.layer = self._layer(block_size, self.layer.logits_soft_cap)
        try:
            self.kernels = kernels_for(self.layer, backend=serving_backend(), draft_q_len=draft_q_len)
        except KgenError as e:
            raise ValueError(f"kgen cannot serve attention layer {layer_name}: {e}") from None
        kinds = "cache_write, decode, prefill" + (f", drafts of up to {draft_q_len} tokens" if draft_q_len > 1 else "")
        log.info("kgen: layer %s served by %s (%s)", layer_name, self.kernels.name, kinds)
        return self.kernels

    def _pools(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return page_pools(kv_cache, self.head_size)

    def _scales(self, layer) -> dict[str, torch.Tensor]:
        """vLLM's per-tensor scales: the layer's own fp32 tensors (a float would be a new device
        array at every call)."""
        if not self.layer.kv_dtype.startswith("fp8"):
            return {}
        return {"k_scale": layer._k_scale, "v_scale": layer._v_scale}

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self._on_device.clear()  # the sinks' weights are (re)loaded: read them again at the next call

    def _persistent(self, what: str, device: torch.device) -> torch.Tensor:
        """The ALiBi slopes or the sinks as fp32 on `device`, made once (not copied at every call)."""
        held = self._on_device.get((what, device))
        if held is None:
            source = self.alibi_slopes if what == "alibi_slopes" else self.sinks.detach()
            held = self._on_device[(what, device)] = source.to(device=device, dtype=torch.float32).contiguous()
        return held

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        n = int(slot_mapping.shape[0])
        if n == 0:
            return
        k_pool, v_pool = self._pools(kv_cache)
        self.kernels.cache_write(key=key[:n], value=value[:n], k_cache=k_pool, v_cache=v_pool,
                                 slot_mapping=_int32_slots(self.layer_name, slot_mapping), **self._scales(layer))
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
            common["alibi_slopes"] = self._persistent("alibi_slopes", query.device)
        if self.sinks is not None:  # the model's bf16 weights as the ABI's fp32, converted once
            common["sinks"] = self._persistent("sinks", query.device)
        serve_regions(self.kernels, self.layer_name, attn_metadata, query, output, common)
        return output


def _int32_slots(layer_name: str, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The builder's int32 copy of this step's slot mapping when vLLM's forward context has it
    (one narrowing per step, not per layer), else vLLM's own (the kernel narrows it)."""
    meta = step_metadata(layer_name, KgenAttentionMetadata)
    if meta is not None and meta.slot_mapping.shape[0] == int(slot_mapping.shape[0]):
        return meta.slot_mapping
    return slot_mapping


def step_metadata(layer_name: str, kind: type):
    """This step's metadata of the layer (an instance of `kind`) when vLLM's forward context holds
    it, else None (a direct call, outside a model step)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # speculative decoding: the base model's first
        metadata = metadata[0] if metadata else None
    meta = metadata.get(layer_name) if isinstance(metadata, dict) else None
    return meta if isinstance(meta, kind) else None


def _explained(reason: str, given: dict, table: dict | None = None) -> str:
    """vLLM's short reason with the setting, the value given and what kgen's backend accepts (`table`:
    another backend's, _ACCEPTED's form)."""
    table = _ACCEPTED if table is None else table
    if reason not in table:
        return reason
    setting, parameter, accepted = table[reason]
    value = given.get(parameter) if parameter else None
    if hasattr(value, "as_version_str"):  # vLLM's DeviceCapability
        value = value.as_version_str()
    shown = f" = {value}" if value is not None else ""
    return f"{reason} by kgen: {setting}{shown}; accepted: {accepted}"


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
