"""`kgen abi SPEC`: the kernel contract of one spec, as a C header comment plus the
exact signatures — what to hand an engineer or an AI assistant writing a kernel by hand."""

from __future__ import annotations

import re

from kgen.families.paged_decode import cache_shapes, scale_shape, vector_width, vllm_x
from kgen.render import render


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def signatures(source: str) -> list[str]:
    """Every `extern "C" __global__` declaration of a rendered source, up to its body."""
    return [m.group(0).rstrip(" {").strip() for m in re.finditer(r'extern "C" __global__[^{]*', source)]


def abi_text(spec) -> str:
    if spec.kind in ("cache_write", "copy_blocks"):
        return _cache_abi_text(spec)
    a, kv, d = spec.attention, spec.kv_cache, spec.dtype
    rendered = render(spec)
    lines = [
        f"kgen ABI for spec '{spec.name}' (kind {spec.kind}, spec sha256 {spec.spec_hash()[:16]})",
        "",
        f"num_q_heads {a.num_q_heads}, num_kv_heads {a.num_kv_heads} (query head h reads KV head h / "
        f"{spec.group_size}), head_dim {a.head_dim}, block_size {kv.block_size}",
        f"softmax scale {spec.softmax_scale_value!r}"
        + (f", sliding window {a.sliding_window} (query at seq_len-1 sees keys seq_len-{a.sliding_window} .. "
           "seq_len-1)" if a.sliding_window else "")
        + (f", logits soft-cap {a.logits_soft_cap} (s = cap*tanh(s/cap), applied before ALiBi)"
           if a.logits_soft_cap else "")
        + (", ALiBi: logit += alibi_slopes[h] * (j - (seq_len - 1))" if a.alibi else ""),
        "",
        "Arguments (shapes in elements; C-contiguous unless noted):",
        f"  out           [num_seqs, {a.num_q_heads}, {a.head_dim}]  {d.resolved_out}",
        f"  q             [num_seqs, {a.num_q_heads}, {a.head_dim}]  {d.q}",
    ]
    for name, shape in cache_shapes(spec).items():
        lines.append(f"  {name:<13} {_shape(shape)}  {kv.dtype}   (pool strides may be padded; last dim contiguous)")
    if kv.layout == "vllm":
        lines.append(f"                x = 16 bytes / element size = {vllm_x(spec)}")
    lines += [
        "  block_tables  [num_seqs, max_blocks_per_seq]  int32 physical block ids; entries past "
        "ceil(seq_len / block_size) are never read",
        "  seq_lens      [num_seqs]  int32, tokens in the KV cache of each sequence (1 .. max_blocks_per_seq * "
        "block_size)",
    ]
    sshape = scale_shape(spec)
    if sshape is not None:
        lines.append(f"  k_scale, v_scale  {_shape(sshape)}  float32 ({kv.scale}); real = stored * scale")
    if a.alibi:
        lines.append(f"  alibi_slopes  [{a.num_q_heads}]  float32")
    lines += [
        "",
        "Rules: slots past a sequence's length in its last block hold garbage and must not be read"
        + ("" if spec.tail_masking else
           " (tail_masking: false — every seq_len is promised to be a multiple of block_size)") + ".",
        f"Loads: {vector_width(spec)} elements per vector load; pointers and strides must keep them aligned.",
        "",
        "Launch (as kgen does it): grid (num_kv_heads, num_seqs, partitions), block (threads), dynamic smem "
        f"{spec.group_size * a.head_dim * 4} bytes; config {rendered.config}.",
    ]
    header = "/*\n" + "\n".join((" * " + line).rstrip() for line in lines) + "\n */\n"
    return header + "\n".join(sig + ";" for sig in signatures(rendered.source)) + "\n"


def _cache_abi_text(spec) -> str:
    """The cache kernels' contract: the argument table comes from their family module."""
    from kgen.families import cache_write, copy_blocks

    family = cache_write if spec.kind == "cache_write" else copy_blocks
    rendered = render(spec)
    lines = [f"kgen ABI for spec '{spec.name}' (kind {spec.kind}, spec sha256 {spec.spec_hash()[:16]})", "",
             *family.abi_lines(spec), f"Config {rendered.config}; details: docs/cache-kernels.md."]
    header = "/*\n" + "\n".join((" * " + line).rstrip() for line in lines) + "\n */\n"
    return header + "\n".join(sig + ";" for sig in signatures(rendered.source)) + "\n"
