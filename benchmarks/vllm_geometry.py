"""vLLM's paged attention v1/v2 launch geometry (vllm 0.10.x csrc/attention/paged_attention_v{1,2}.cu),
restated from its source for benchmarks/static_perf.py."""

from __future__ import annotations


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


VLLM_THREADS = 128
VLLM_PARTITION = 512


def vllm_v1_smem(context: int, head_dim: int, block_size: int) -> int:
    """Dynamic smem of v1: fp32 logits of the whole padded context, or the output reduction buffer."""
    return max(_round_up(context, block_size) * 4, (VLLM_THREADS // 32 // 2) * head_dim * 4)


def vllm_v2_smem(head_dim: int) -> int:
    return max(VLLM_PARTITION * 4, (VLLM_THREADS // 32 // 2) * head_dim * 4)


def vllm_uses_v1(batch: int, context: int, num_heads: int) -> bool:
    """vLLM's own choice (vllm/attention/ops/paged_attn.py): v1 when the context is at most 8192 and
    either one partition suffices or the grid is already large."""
    parts = -(-context // VLLM_PARTITION)
    return context <= 8192 and (parts == 1 or batch * num_heads > 512)
