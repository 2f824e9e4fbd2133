"""kgen inside vLLM on this machine: start-up cost and tokens/s, vLLM's CPU attention vs kgen's.

    PYTHONPATH=. python benchmarks/vllm_cpu.py [--model-dir DIR] [--max-tokens 32] [--doc docs/vllm.md]

Every run serves the same tiny Llama (kgen/vllm/tiny_models.py: 2 layers, GQA 4/2, head_dim 32,
fp32, random weights) in a fresh process through kgen.vllm.compare.run_side: six prompts
(7-150 tokens, two sharing a 72-token prefix), 64-token chunked-prefill budget, greedy.
Rows: vLLM's own CPU attention; kgen with an empty artifact cache (cold: NVRTC + g++ compiles and
verification); kgen again on that cache (warm; KGEN_VLLM_MIXED=auto, which on the CPU backend serves
one-token rows with paged_prefill); kgen with those rows on paged_decode (KGEN_VLLM_MIXED=split). Then
one layer's decode step at the op level: vLLM's CPU attention op, kgen's paged_decode and paged_prefill. kgen's CPU backend emulates a GPU (a fiber per CUDA thread): it
exists to prove the kernels right, not to serve on a CPU, and the table says how much slower it is.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kgen.vllm.tiny_models import write_model

ROOT = Path(__file__).resolve().parents[1]


def measure(model: str, max_tokens: int, cache_dir: Path, repeats: int) -> list[tuple[str, dict]]:
    """Each row's best of `repeats` fresh processes (the cold row: its first, on an empty cache)."""
    from kgen.vllm.compare import run_side

    env = {"KGEN_CACHE_DIR": str(cache_dir)}

    def best(backend: str, extra: dict[str, str]) -> dict:
        runs = [run_side(model, backend, max_tokens=max_tokens, extra_env=env | extra) for _ in range(repeats)]
        return min(runs, key=lambda r: r["generate_s"]) | {"startup_s": min(r["startup_s"] for r in runs)}

    cold = run_side(model, "kgen", max_tokens=max_tokens, extra_env=env)
    return [
        ("vLLM CPU_ATTN", best("vllm", {})),
        ("kgen, cold artifact cache (first run)", cold),
        ("kgen, warm artifact cache (one-token rows by paged_prefill: auto)", best("kgen", {})),
        ("kgen, warm, one-token rows by paged_decode (split)", best("kgen", {"KGEN_VLLM_MIXED": "split"})),
    ]


def op_level(batch: int = 8, context: int = 1024, repeats: int = 5) -> str:
    """One decode step of one layer (32 query / 8 KV heads, head_dim 128, fp32, block 32) on vLLM's pages:
    vLLM's CPU attention op vs kgen's paged_decode and, for the same rows, kgen's paged_prefill."""
    import time

    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kgen.model_specs import LayerAttention
    from kgen.vllm.backend import page_pools
    from kgen.vllm.kernels import kernels_for

    hq, h, d, b = 32, 8, 128, 32
    nb = batch * context // b
    torch.manual_seed(0)
    page = torch.randn(nb, h, b, 2 * d)
    k_pool, v_pool = page_pools(page, d)
    q, out = torch.randn(batch, hq, d), torch.zeros(batch, hq, d)
    table = torch.randperm(nb, dtype=torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    isa = _get_attn_isa(torch.float32, b, d, "auto")
    meta = ops.cpu_attn_get_scheduler_metadata(batch, hq, h, d, lens, torch.float32, qsl, True, -1, isa, True)
    kc, vc = page.view(nb, h, 2 * b, d).chunk(2, dim=2)
    kernels = kernels_for(LayerAttention(hq, h, d, d ** -0.5, "fp32", "fp32", b), backend="cpu")
    calls = {
        "vLLM CPU_ATTN op": lambda: ops.cpu_attention_with_kv_cache(
            q, kc, vc, out, qsl, lens, d ** -0.5, True, None, -1, table, 0.0, meta, None),
        "kgen paged_decode (CPU backend)": lambda: kernels.decode(
            q=q, out=out, k_cache=k_pool, v_cache=v_pool, block_tables=table, seq_lens=lens),
        "kgen paged_prefill, same rows (CPU backend)": lambda: kernels.prefill(
            q=q, out=out, k_cache=k_pool, v_cache=v_pool, block_tables=table, seq_lens=lens, q_indptr=qsl),
    }
    times = {}
    for name, call in calls.items():
        call()
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t)
        times[name] = sorted(samples)[len(samples) // 2]
    base = times["vLLM CPU_ATTN op"]
    lines = [f"One layer's decode step, batch {batch} x context {context}, 32/8 heads, head_dim 128, fp32 "
             f"(median of {repeats}):", "", "| call | ms | vs vLLM's op |", "|---|---|---|"]
    lines += [f"| {name} | {t * 1e3:.2f} | {t / base:.0f}× the time |" for name, t in times.items()]
    return "\n".join(lines)


def table(rows: list[tuple[str, dict]]) -> str:
    base = rows[0][1]
    lines = ["| attention | start-up s | added start-up s | generate s | generated tokens/s | tokens/s (prompt + "
             "generated) | vs vLLM |", "|---|---|---|---|---|---|---|"]
    for name, r in rows:
        tokens = r["prompt_tokens"] + r["generated_tokens"]
        rate = tokens / r["generate_s"]
        base_rate = (base["prompt_tokens"] + base["generated_tokens"]) / base["generate_s"]
        lines.append(f"| {name} | {r['startup_s']:.1f} | {r['startup_s'] - base['startup_s']:+.1f} | "
                     f"{r['generate_s']:.2f} | {r['generated_tokens'] / r['generate_s']:.1f} | {rate:.0f} | "
                     f"{rate / base_rate:.2f}× |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="where to write the tiny model (default: a temp dir)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per row; the best is shown")
    p.add_argument("--doc", type=Path, help="also replace the table between the markers in this Markdown file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model("llama", args.model_dir or Path(tmp))
        rows = measure(str(model), args.max_tokens, Path(tmp) / "kgen-cache", args.repeats)
    text = table(rows) + "\n\n" + op_level()
    print(text)
    if args.doc:
        doc = args.doc.read_text()
        start, end = "<!-- vllm_cpu table -->", "<!-- /vllm_cpu table -->"
        head, rest = doc.split(start, 1)
        args.doc.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
