"""kgen inside vLLM on this machine: start-up cost and tokens/s, vLLM's CPU attention vs kgen's.

    python benchmarks/vllm_cpu.py [--model-dir DIR] [--max-tokens 32] [--doc docs/vllm.md]

Every run serves the same tiny Llama (tests/vllm/tiny_models.py: 2 layers, GQA 4/2, head_dim 32,
fp32, random weights) in a fresh process through kgen.vllm.compare.run_side: six prompts
(7-150 tokens, two sharing a 72-token prefix), 64-token chunked-prefill budget, greedy.
Rows: vLLM's own CPU attention; kgen with an empty artifact cache (cold: NVRTC + g++ compiles and
verification); kgen again on that cache (warm); kgen serving mixed batches with paged_prefill
alone (KGEN_VLLM_MIXED=prefill). kgen's CPU backend emulates a GPU (a fiber per CUDA thread): it
exists to prove the kernels right, not to serve on a CPU, and the table says how much slower it is.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

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
        ("kgen, warm artifact cache", best("kgen", {})),
        ("kgen, mixed batches by prefill alone (warm)", best("kgen", {"KGEN_VLLM_MIXED": "prefill"})),
    ]


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
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from tiny_models import write_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_model("llama", args.model_dir or Path(tmp))
        rows = measure(str(model), args.max_tokens, Path(tmp) / "kgen-cache", args.repeats)
    text = table(rows)
    print(text)
    if args.doc:
        doc = args.doc.read_text()
        start, end = "<!-- vllm_cpu table -->", "<!-- /vllm_cpu table -->"
        head, rest = doc.split(start, 1)
        args.doc.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
