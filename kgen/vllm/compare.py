"""Serve one model with vLLM's own attention and with kgen's, and compare (docs/vllm.md).

    python -m kgen.vllm.compare MODEL_DIR [--dtype float32] [--kv-cache-dtype auto] [--json OUT]

Each side runs in a fresh process (`serve` below, through `python -m kgen.vllm.compare
--serve ...`), so vLLM's registry, its cached backend choice and kgen's launch counts belong to
one side only. Greedy decoding with top-k logprobs, prefix caching on and a small chunked-prefill
budget, so that long prompts are split into chunks and shared prefixes are served from cache.
Agreement is judged as vLLM's own tests judge it (`check_logprobs_close`): tokens agree until
the first difference; there, each side's token must be among the other's top-k and their
logprobs within the tolerance; the sequences are not compared past it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kgen.settings import child_environment
from kgen.vllm.kernels import launch_counts

TOP_K = 5
RESULT = "serve-result: "  # the line a serving child prints its JSON result on


def default_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that exercise what serving does: short and long (chunked) prompts, two that share a
    72-token prefix (prefix cache hits), and lengths at and around block boundaries."""
    def tokens(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocab_size - 10) + 5 for i in range(n)]
    shared = tokens(1, 72)
    return [tokens(2, 7), tokens(3, 32), tokens(4, 33), shared + tokens(5, 40), shared + tokens(6, 9),
            tokens(7, 150)]


def serve(model: str, backend: str, dtype: str, kv_cache_dtype: str, block_size: int, max_tokens: int,
          chunk: int) -> dict:
    """Generate greedily for default_prompts in this process; the attention is vLLM's own
    (backend "vllm") or kgen's ("kgen": KGEN_VLLM_BACKEND must name the backend kgen replaces)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    config = json.loads((Path(model) / "config.json").read_text())
    llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              block_size=block_size, max_model_len=512, enforce_eager=True, enable_prefix_caching=True,
              max_num_batched_tokens=chunk, max_num_seqs=8, kv_cache_memory_bytes=64 << 20, seed=0)
    started = time.perf_counter()
    prompts = default_prompts(int(config.get("vocab_size") or config["text_config"]["vocab_size"]))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_K, ignore_eos=True)
    # One short request first, so that the timed run measures serving, not first-call set-up.
    llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], SamplingParams(max_tokens=2), use_tqdm=False)
    warm = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    done = time.perf_counter()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "backend": backend,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                     for o in outputs],
        "launches": launch_counts(),
        "startup_s": started - t0,
        "generate_s": done - warm,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": generated,
    }


def run_side(model: str, backend: str, replace: str = "CPU_ATTN", dtype: str = "float32",
             kv_cache_dtype: str = "auto", block_size: int = 32, max_tokens: int = 8, chunk: int = 64,
             extra_env: dict[str, str] | None = None, timeout: float = 900) -> dict:
    """`serve` in a fresh process: backend "vllm" (vLLM's attention) or "kgen" (kgen replacing `replace`)."""
    env = child_environment() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} | (extra_env or {})
    env.pop("KGEN_VLLM_BACKEND", None)
    if backend == "kgen":
        env["KGEN_VLLM_BACKEND"] = replace
    cmd = [sys.executable, "-m", "kgen.vllm.compare", "--serve", model, "--backend", backend, "--dtype", dtype,
           "--kv-cache-dtype", kv_cache_dtype, "--block-size", str(block_size), "--max-tokens", str(max_tokens),
           "--chunk", str(chunk)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"serving {model} with {backend} attention failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


@dataclass
class Agreement:
    compared_tokens: int  # tokens compared before the first difference of each sequence, summed
    max_logprob_diff: float  # over the compared positions, chosen tokens' logprobs
    divergences: list[str]  # one line per sequence that differed (and where), acceptable or not
    problems: list[str]  # disagreements beyond the tolerance

    @property
    def ok(self) -> bool:
        return not self.problems


def compare(ref: dict, test: dict, atol: float) -> Agreement:
    """vLLM's check_logprobs_close, over two `serve` results."""
    compared, worst, divergences, problems = 0, 0.0, [], []
    for s, (r_toks, t_toks, r_lps, t_lps) in enumerate(zip(ref["tokens"], test["tokens"], ref["logprobs"],
                                                           test["logprobs"], strict=True)):
        for i, (rt, tt) in enumerate(zip(r_toks, t_toks, strict=True)):
            r_lp, t_lp = r_lps[i], t_lps[i]
            if rt == tt:
                compared += 1
                worst = max(worst, abs(r_lp[str(rt)] - t_lp[str(tt)]))
                continue
            divergences.append(f"sequence {s} differs at token {i}: {rt} vs {tt}")
            if str(tt) not in r_lp or str(rt) not in t_lp:
                problems.append(f"sequence {s}, token {i}: {rt} (vLLM) vs {tt} (kgen), not in each other's top-{TOP_K}")
            elif abs(r_lp[str(rt)] - r_lp[str(tt)]) > 2 * atol:
                problems.append(f"sequence {s}, token {i}: vLLM's logprobs of {rt} and {tt} are "
                                f"{r_lp[str(rt)]:.4f} and {r_lp[str(tt)]:.4f}, not a near tie")
            break
    if worst > atol:
        problems.append(f"logprobs of agreeing tokens differ by up to {worst:.3g} (tolerance {atol})")
    return Agreement(compared, worst, divergences, problems)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kgen.vllm.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="kgen", choices=("kgen", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--replace", default="CPU_ATTN", help="the vLLM backend kgen replaces (default CPU_ATTN)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens (the chunked-prefill budget)")
    p.add_argument("--atol", type=float, default=1e-3)
    p.add_argument("--json", type=Path, help="write both sides' results here")
    args = p.parse_args(argv)
    if args.serve:
        result = serve(args.model, args.backend, args.dtype, args.kv_cache_dtype, args.block_size,
                       args.max_tokens, args.chunk)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    common = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  max_tokens=args.max_tokens, chunk=args.chunk)
    ref = run_side(args.model, "vllm", **common)
    test = run_side(args.model, "kgen", replace=args.replace, **common)
    agreement = compare(ref, test, args.atol)
    if args.json:
        args.json.write_text(json.dumps({"vllm": ref, "kgen": test}, indent=1))
    print(f"{agreement.compared_tokens} tokens compared, logprobs within {agreement.max_logprob_diff:.3g}; "
          f"kgen launches: {test['launches']}")
    for line in agreement.divergences + agreement.problems:
        print(line)
    return 0 if agreement.ok else 1


if __name__ == "__main__":
    sys.exit(main())
