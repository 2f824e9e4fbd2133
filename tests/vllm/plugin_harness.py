"""kgen's vLLM builder and impl driven the way vLLM's model runner drives them, without starting
vLLM: a VllmConfig, one Attention-like layer per name registered where vLLM's
get_layers_from_vllm_config finds it, vLLM's own CommonAttentionMetadata and forward context."""

from __future__ import annotations

import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kgen.vllm.backend import KgenAttentionImpl, KgenMetadataBuilder
from kgen.vllm.kernels import LayerKernels

HQ, H, D, B = 4, 2, 32, 16


class Layer(torch.nn.Module):
    """What the impl reads of vLLM's Attention layer: its impl and per-tensor fp8 scales."""

    def __init__(self, impl: KgenAttentionImpl, device: torch.device):
        super().__init__()
        self.impl = impl
        self._k_scale = torch.tensor(1.0, dtype=torch.float32, device=device)
        self._v_scale = torch.tensor(1.0, dtype=torch.float32, device=device)
        self._k_scale_float = self._v_scale_float = 1.0


class Plugin:
    """`layers` kgen layers of one KV-cache group, their builder and their pages on `device`."""

    def __init__(self, device: str = "cpu", layers: int = 2, num_blocks: int = 16, alibi: bool = False,
                 sinks: bool = False, max_tokens: int = 256, kv_cache_dtype: str = "auto",
                 draft_tokens: int = 0):
        self.device = torch.device(device)
        self.config = VllmConfig()
        self.config.scheduler_config.max_num_batched_tokens = max_tokens
        if draft_tokens:  # what vLLM's builders read of a SpeculativeConfig
            self.config.speculative_config = types.SimpleNamespace(num_speculative_tokens=draft_tokens,
                                                                   parallel_drafting=False)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        slopes = [2.0 ** (-(i + 1)) for i in range(HQ)] if alibi else None
        self.layers = {}
        with set_current_vllm_config(self.config):
            for name in self.names:
                sink = torch.nn.Parameter(torch.linspace(-1, 1, HQ, device=self.device), requires_grad=False)
                impl = KgenAttentionImpl(HQ, D, D ** -0.5, H, slopes, None, kv_cache_dtype,
                                         sinks=sink if sinks else None)
                self.layers[name] = self.config.compilation_config.static_forward_context[name] = Layer(impl,
                                                                                                        self.device)
        spec = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)
        self.builder = KgenMetadataBuilder(spec, self.names, self.config, self.device)
        stored = torch.uint8 if kv_cache_dtype.startswith("fp8") else torch.float32  # vLLM's fp8 pages: bytes
        self.pages = {n: torch.zeros(num_blocks, H, B, 2 * D, dtype=stored, device=self.device) for n in self.names}

    def step(self, common: CommonAttentionMetadata, q, k, v, outs: dict | None = None) -> dict[str, torch.Tensor]:
        """One model step as vLLM runs it: build the metadata once, then per layer the KV-cache
        update and the attention, inside the forward context. The outputs by layer (`outs`: vLLM's
        output tensors, made before the step; new ones when None)."""
        return self.forward(self.builder.build(0, common), common, q, k, v, outs)

    def forward(self, meta, common: CommonAttentionMetadata, q, k, v, outs: dict | None = None) -> dict:
        """The layers' part of a step, with metadata already built."""
        outs = {n: torch.empty_like(q) for n in self.names} if outs is None else outs
        with set_forward_context({n: meta for n in self.names}, self.config):
            for name, layer in self.layers.items():
                n = common.num_actual_tokens
                layer.impl.do_kv_cache_update(layer, k, v, self.pages[name], common.slot_mapping[:n])
                layer.impl.forward(layer, q, k, v, self.pages[name], meta, outs[name])
        return outs


def common_metadata(query_lens, seq_lens, tables, slots, device="cpu", upper_bounds=None):
    """vLLM's batch metadata: the device-side tensors on `device`, the host-side ones on the CPU."""
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=lens.to(device), num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(tables, dtype=torch.int32).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        seq_lens_cpu_upper_bound=torch.tensor(upper_bounds if upper_bounds is not None else seq_lens,
                                              dtype=torch.int32))


class Recorder:
    """A layer's kernel that records its calls instead of running them (meta tensors hold no
    data); planning, its spec and its backend are the real kernel's."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, **arguments):
        self.calls.append((self.kernel.spec.kind, arguments))


def recording(plugin) -> list:
    """Every layer's kernels of `plugin` (a Plugin or an MlaPlugin) replaced by Recorders: their calls, in order."""
    calls: list = []
    for layer in plugin.layers.values():
        k = layer.impl.kernels
        layer.impl.kernels = LayerKernels(k.layer, *(Recorder(x, calls) for x in (k.cache_write, k.decode, k.prefill)))
    return calls


class DeviceTraffic(TorchDispatchMode):
    """Counts what torch ops do on `device`: new allocations (an output whose storage no input has)
    and copies onto it from another device."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.allocations: list[str] = []
        self.copies_in: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        held = {t.untyped_storage()._cdata for t in inputs}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            if t.untyped_storage()._cdata not in held:
                self.allocations.append(str(func))
            if any(i.device != self.device for i in inputs):
                self.copies_in.append(str(func))
        return out


# ---- multi-head latent attention (kgen/vllm/mla.py) -----------------------------------------------
# A small absorbed MLA layer: latent rank 64, rope part 32 (rows of 96), 4 query heads.
MLA_RANK, MLA_ROPE, MLA_HEADS = 64, 32, 4
MLA_D = MLA_RANK + MLA_ROPE
MLA_SCALE = 48 ** -0.5  # 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) of a model with qk_nope_head_dim 16


class MlaPlugin:
    """`layers` kgen MLA layers of one KV-cache group, their builder and their latent caches
    [num_blocks, B, MLA_D] (bf16), driven as vLLM's MLAAttention.forward_impl drives the impl: the
    KV-cache update, then forward_mqa with every token (the builder counts every one as MQA)."""

    def __init__(self, layers: int = 1, num_blocks: int = 16, max_tokens: int = 256, device: str = "cpu"):
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        from kgen.vllm.mla import KgenMLAImpl, KgenMLAMetadataBuilder

        self.device = torch.device(device)
        self.config = VllmConfig()
        self.config.scheduler_config.max_num_batched_tokens = max_tokens
        self.config.cache_config.block_size = B
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.layers = {}
        with set_current_vllm_config(self.config):
            for name in self.names:
                impl = KgenMLAImpl(MLA_HEADS, MLA_D, MLA_SCALE, 1, None, None, "auto", None, AttentionType.DECODER,
                                   None, q_lora_rank=None, kv_lora_rank=MLA_RANK, qk_nope_head_dim=16,
                                   qk_rope_head_dim=MLA_ROPE, qk_head_dim=16 + MLA_ROPE, v_head_dim=16, kv_b_proj=None)
                layer = Layer(impl, self.device)
                self.layers[name] = self.config.compilation_config.static_forward_context[name] = layer
        spec = MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=MLA_D, dtype=torch.bfloat16)
        self.builder = KgenMLAMetadataBuilder(spec, self.names, self.config, self.device)
        self.pages = {n: torch.zeros(num_blocks, B, MLA_D, dtype=torch.bfloat16, device=self.device)
                      for n in self.names}

    def step(self, common: CommonAttentionMetadata, q, kv_c, k_pe) -> dict[str, torch.Tensor]:
        """One step: q [T, heads, MLA_D] (absorbed), kv_c [T, MLA_RANK], k_pe [T, 1, MLA_ROPE]; the
        latent outputs [T, heads, MLA_RANK] by layer."""
        meta = self.builder.build(0, common)
        n = common.num_actual_tokens
        outs = {}
        with set_forward_context({name: meta for name in self.names}, self.config):
            for name, layer in self.layers.items():
                layer.impl.do_kv_cache_update(kv_c, k_pe, self.pages[name], common.slot_mapping[:n], "auto",
                                              layer._k_scale)
                out, lse = layer.impl.forward_mqa((q[:, :, :MLA_RANK], q[:, :, MLA_RANK:]), self.pages[name], meta,
                                                  layer)
                assert lse is None
                outs[name] = out.clone()  # vLLM's layer projects it at once: the buffer is the next layer's
        return outs


def mla_reference(q, pages, table, seq_len, q_len) -> torch.Tensor:
    """float64 absorbed MLA of one request's q_len new tokens [q_len, heads, MLA_D] over its latent
    rows: token j (position seq_len - q_len + j) sees keys 0..its position; V is a row's first MLA_RANK."""
    rows = torch.cat([pages[b] for b in table], 0)[:seq_len].double()  # [seq_len, MLA_D]
    scores = torch.einsum("thd,nd->thn", q.double(), rows) * MLA_SCALE
    positions = torch.arange(seq_len - q_len, seq_len)[:, None, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > positions, float("-inf"))
    return torch.einsum("thn,nd->thd", torch.softmax(scores, -1), rows[:, :MLA_RANK])
