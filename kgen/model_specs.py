"""Specs from a model: the kgen kernels one attention layer type needs (docs/vllm.md).

One derivation serves both users of it: `kgen.specs_for_model(config.json)` / `kgen
specs-for-model` (Hugging Face configs, written as YAML to inspect, tune and build) and the vLLM
backend (kgen/vllm/), which calls `layer_spec_dicts` with the numbers of each attention layer it
is given. A layer type is what one set of kernels serves: heads, head dim, scale, window,
soft-cap, ALiBi, attention sinks, dtypes and block size. A model whose layers alternate windowed and full
attention (Gemma 2/3, gpt-oss) has two.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kgen.errors import KgenUserError, UnsupportedError
from kgen.spec.models import Spec, spec_from_dict

KINDS = ("cache_write", "decode", "prefill")  # the set every layer type gets, in build order
_KIND_OF = {"cache_write": "cache_write", "decode": "paged_decode", "prefill": "paged_prefill"}
# The attention fields each kernel takes (None: all); the write kernel knows nothing of the attention math.
_ATTENTION_FIELDS = {"cache_write": ("num_q_heads", "num_kv_heads", "head_dim", "v_head_dim"), "decode": None,
                     "prefill": None}
_ATTENTION_EXTRA = {"prefill": {"causal": True}}  # chunks attend causally to their prefix and themselves
KV_DTYPES = ("auto", "fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4")
_TORCH_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}
# Model types whose attention is the plain decoder attention kgen derives (others are refused by name).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3",
                         "gpt_oss", *("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"))
# Multi-head latent attention (docs/mla.md): served in its absorbed form over one latent row per token.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
# DeepSeek-V3.2's sparse attention: its indexer picks index_topk tokens per query (attention.sparse_topk).
SPARSE_MLA_MODEL_TYPES = ("deepseek_v32",)


@dataclass(frozen=True)
class LayerAttention:
    """The numbers of one attention layer type that decide its kernels."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    softmax_scale: float | None  # None: 1/sqrt(head_dim)
    dtype: str  # kgen dtype of q and out: fp16 | bf16 | fp32
    kv_dtype: str  # kgen cache dtype
    block_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    order: str = "HND"  # vLLM's pages hold [kv head, token, dim] (kgen/vllm/backend.py)
    sinks: bool = False  # learned per-head sink logits (gpt-oss), passed at call time
    v_head_dim: int | None = None  # V's and the output's head dim when it differs (MLA: the latent rank)
    layout: str = "separate"  # mla: one latent row per token (DeepSeek-V2/V3, Kimi K2)
    sparse_topk: int | None = None  # each query attends the top-k slots its indices name (DeepSeek-V3.2)

    def key(self) -> str:
        """A short stable name for this layer type (part of the spec names)."""
        fields = asdict(self)
        # fields at their defaults are left out, so the names of layer types without them stay as they were
        for name, default in (("sinks", False), ("v_head_dim", None), ("layout", "separate"), ("sparse_topk", None)):
            if fields[name] == default:
                fields.pop(name)
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
        window = f"_w{self.sliding_window}" if self.sliding_window else ""
        return (f"h{self.num_q_heads}kv{self.num_kv_heads}d{self.head_dim}_{self.dtype}_{self.kv_dtype}"
                f"_b{self.block_size}{window}_{digest}")


def kgen_dtype(name: Any) -> str:
    """A torch dtype or a config's dtype string as kgen's name (fp16 | bf16 | fp32)."""
    text = str(name).removeprefix("torch.")
    if text in ("fp16", "bf16", "fp32"):
        return text
    if text not in _TORCH_DTYPES:
        raise UnsupportedError(f"dtype {text}: kgen kernels take fp16, bf16 or fp32 queries")
    return _TORCH_DTYPES[text]


def kv_cache_dtype(kv_dtype: str, dtype: str) -> str:
    """vLLM's or kgen's cache dtype name as kgen's (auto: the model's dtype)."""
    aliases = {"auto": dtype, "fp8": "fp8_e4m3", "float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
    resolved = aliases.get(kv_dtype, kv_dtype)
    if resolved not in KV_DTYPES[1:]:
        raise UnsupportedError(f"kv cache dtype {kv_dtype}: kgen serves auto, fp8 (fp8_e4m3) and "
                               f"{', '.join(KV_DTYPES[1:])} caches")
    return resolved


def layer_spec_dicts(layer: LayerAttention, prefix: str = "kgen") -> dict[str, dict[str, Any]]:
    """The cache_write, decode and prefill spec documents of one layer type (not yet validated)."""
    quantized = layer.kv_dtype.startswith("fp8")
    attention: dict[str, Any] = {"num_q_heads": layer.num_q_heads, "num_kv_heads": layer.num_kv_heads,
                                 "head_dim": layer.head_dim}
    if layer.softmax_scale is not None:
        attention["softmax_scale"] = float(layer.softmax_scale)
    if layer.sliding_window:
        attention["sliding_window"] = int(layer.sliding_window)
    if layer.logits_soft_cap:
        attention["logits_soft_cap"] = float(layer.logits_soft_cap)
    if layer.alibi:
        attention["alibi"] = True
    if layer.sinks:
        attention["sinks"] = True
    if layer.v_head_dim is not None:
        attention["v_head_dim"] = int(layer.v_head_dim)
    if layer.sparse_topk:
        attention["sparse_topk"] = int(layer.sparse_topk)
    kv = {"block_size": layer.block_size, "layout": layer.layout, "order": layer.order, "dtype": layer.kv_dtype,
          "scale": "per_tensor" if quantized else "none"}
    if layer.layout == "mla":  # one row per token: no head axis to order
        kv.pop("order")
    docs = {}
    for kind in KINDS:
        doc: dict[str, Any] = {"kgen": 1, "name": f"{prefix}_{layer.key()}_{kind}", "kind": _KIND_OF[kind],
                               "kv_cache": dict(kv), "dtype": {"q": layer.dtype}, "tail_masking": True}
        if quantized:  # fp8 conversions need sm_89 or newer
            doc["targets"] = ["sm_89", "sm_90"]
        fields = _ATTENTION_FIELDS[kind]
        doc["attention"] = {k: v for k, v in attention.items() if fields is None or k in fields}
        if not layer.sparse_topk:  # a sparse kernel has no causal mask: the indices name what a row sees
            doc["attention"].update(_ATTENTION_EXTRA.get(kind, {}))
        docs[kind] = doc
    return docs


def layer_specs(layer: LayerAttention, prefix: str = "kgen") -> dict[str, Spec]:
    """layer_spec_dicts, validated into Specs (kgen.SpecError names the field that kgen refuses)."""
    return {kind: spec_from_dict(doc) for kind, doc in layer_spec_dicts(layer, prefix).items()}


# ---- Hugging Face model configs -------------------------------------------------------------------


def _load_config(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KgenUserError(f"{path}: no such model config (give a config.json or the folder holding it)") from None
    except json.JSONDecodeError as e:
        raise KgenUserError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal configs nest it)."""
    return cfg.get("text_config") or cfg


def _layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from the config's own description."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise KgenUserError(f"layer_types has {len(types)} entries for {n} layers")
        return [window if t == "sliding_attention" else None for t in types]
    model_type = cfg.get("model_type")
    if model_type == "gemma2":  # every other layer, starting with the first, is windowed
        return [window if i % 2 == 0 else None for i in range(n)]
    if model_type == "gemma3" or model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return [None if (i + 1) % pattern == 0 else window for i in range(n)]
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window") or not window:
            return [None] * n
        first_full = int(cfg.get("max_window_layers", n))
        return [None if i < first_full else window for i in range(n)]
    return [window or None] * n  # llama (None), mistral and phi3 (every layer when set)


def model_layers(config: Any, kv_dtype: str = "auto", block_size: int = 16, dtype: str | None = None
                 ) -> tuple[str, list[LayerAttention]]:
    """(model_type, one LayerAttention per decoder layer) of a Hugging Face config."""
    cfg = _text_config(_load_config(config))
    model_type = str(cfg.get("model_type", "?"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(f"model_type {model_type}: kgen derives specs for "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type in MLA_MODEL_TYPES:
        return model_type, _mla_layers(cfg, kv_dtype, block_size, dtype)
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except KeyError as e:
        raise KgenUserError(f"model config: missing {e.args[0]}") from None
    q_dtype = kgen_dtype(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    scale = None
    if cfg.get("query_pre_attn_scalar"):  # Gemma: 1/sqrt(query_pre_attn_scalar), not 1/sqrt(head_dim)
        scale = 1.0 / math.sqrt(float(cfg["query_pre_attn_scalar"]))
    cap = cfg.get("attn_logit_softcapping") or None
    layers = [LayerAttention(heads, kv_heads, head_dim, scale, q_dtype, kv_cache_dtype(kv_dtype, q_dtype),
                             int(block_size), sliding_window=w, logits_soft_cap=cap,
                             sinks=model_type == "gpt_oss")  # every gpt-oss layer has learned sinks
              for w in _layer_windows(cfg)]
    return model_type, layers


def mla_softmax_scale(cfg: dict[str, Any]) -> float:
    """DeepSeek's attention scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale^2 under
    YaRN rope scaling with mscale_all_dim (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for a factor
    above 1), as its modeling code computes it."""
    scale = (int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])) ** -0.5
    rope = cfg.get("rope_scaling") or {}
    factor, mscale_all_dim = float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim", 0) or 0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _sparse_topk(cfg: dict[str, Any]) -> int | None:
    """DeepSeek-V3.2's index_topk (the tokens its indexer picks per query), None for dense attention."""
    topk = cfg.get("index_topk")
    if topk is None and cfg.get("model_type") in SPARSE_MLA_MODEL_TYPES:
        raise KgenUserError(f"model config: missing index_topk (a {cfg['model_type']} config names the tokens its "
                            "sparse attention's indexer picks per query, e.g. 2048)")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise KgenUserError(f"model config: index_topk must be a positive integer (got {topk!r})")
    return topk


def _mla_layers(cfg: dict[str, Any], kv_dtype: str, block_size: int, dtype: str | None) -> list[LayerAttention]:
    """Every layer of a DeepSeek-style model as absorbed MLA: all query heads on one latent row of
    kv_lora_rank + qk_rope_head_dim elements, V (and the output) its first kv_lora_rank; with
    index_topk (DeepSeek-V3.2) sparse: each query attends the top-k slots its indexer names."""
    try:
        heads, rank, rope = int(cfg["num_attention_heads"]), int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        scale = mla_softmax_scale(cfg)
        n = int(cfg["num_hidden_layers"])
    except KeyError as e:
        raise KgenUserError(f"model config: missing {e.args[0]} (an MLA model's config has kv_lora_rank, "
                            "qk_nope_head_dim and qk_rope_head_dim)") from None
    q_dtype = kgen_dtype(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    layer = LayerAttention(heads, 1, rank + rope, scale, q_dtype, kv_cache_dtype(kv_dtype, q_dtype), int(block_size),
                           v_head_dim=rank, layout="mla", sparse_topk=_sparse_topk(cfg))
    return [layer] * n


def specs_for_model(config: Any, kv_dtype: str = "auto", block_size: int = 16, dtype: str | None = None,
                    prefix: str | None = None) -> dict[str, Spec]:
    """The kgen specs a Hugging Face model's attention needs: {"decode", "prefill", "cache_write"}
    for its full-attention layers (or its only layer type); a model with windowed layers beside
    them also gets "decode_window<W>", "prefill_window<W>", "cache_write_window<W>". `config`: a config.json path, the folder
    holding it, or the parsed dict."""
    model_type, layers = model_layers(config, kv_dtype, block_size, dtype)
    prefix = prefix or model_type
    distinct = sorted(dict.fromkeys(layers), key=lambda layer: layer.sliding_window is not None)  # full first
    result: dict[str, Spec] = {}
    for i, layer in enumerate(distinct):
        suffix = "" if i == 0 else ("_full" if not layer.sliding_window else f"_window{layer.sliding_window}")
        for kind, spec in layer_specs(layer, prefix=prefix).items():
            result[kind + suffix] = spec
    return result
