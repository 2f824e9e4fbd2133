"""Tiny models written as real checkpoints (transformers, random weights, `save_pretrained`): what
vLLM loads in the end-to-end tests, the benchmark and `kgen selftest`'s vLLM comparison. No download: the configs are
made here."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.08,
              tie_word_embeddings=False)

MODELS = {
    # GQA (4 query heads over 2 KV heads), full attention on every layer
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # a 48-token sliding window on every layer: the chunked prompts of the tests run past it
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 48}),
    # Gemma 2: logit soft-cap, windowed and full layers alternating, scale from query_pre_attn_scalar
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 48, "attn_logit_softcapping": 20.0,
                                                     "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24,
                                                     "num_hidden_layers": 4, "tie_word_embeddings": True}),
    # Qwen 2 (attention biases), served in bf16
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # BLOOM: ALiBi position biases instead of rotary embeddings (4 heads of 32, no GQA)
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}),
    # DeepSeek-V2 multi-head latent attention: the latent rank 512 and rope part 64 that vLLM's CPU
    # MLA kernel takes (576-element rows), small nope/V heads, dense MLPs on both layers (no MoE)
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32, "v_head_dim": 32, "head_dim": 64, "first_k_dense_replace": 2,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
}


def write_model(name: str, folder: Path, dtype: str = "float32") -> Path:
    """Write model `name` of MODELS to folder/name (weights seeded, so every run writes the same model)."""
    import torch
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    fields = COMMON if name != "bloom" else {"vocab_size": 512, "hidden_size": 128, "initializer_range": 0.08}
    config = getattr(transformers, config_cls)(**(fields | extra))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(getattr(torch, dtype))
    path = Path(folder) / f"{name}_{dtype}"
    model.save_pretrained(path)
    return path
