"""Serve one model with vLLM's own attention and with kgen's, and compare (docs/vllm.md).

    python -m kgen.vllm.compare MODEL_DIR [--dtype float32] [--kv-cache-dtype auto] [--json OUT]
    python -m kgen.vllm.compare MODEL_DIR --gpu [--dry-run] [--json OUT]

`--gpu` is the GPU comparison: FLASH_ATTN against kgen (replacing it) in bf16 with CUDA graphs on,
`gpu_memory_utilization` 0.9, 48 prompts at once and `VLLM_GPU_SYNC_CHECK=error`; both sides'
logprobs are also compared against an independent float64 reference (the model run by
transformers in float64 on each side's own tokens), and both are timed. `--dry-run` runs the same
steps on vLLM's CPU build (CPU_ATTN, eager, a 64 MiB KV cache): how it is tested without a GPU.

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
from dataclasses import asdict, dataclass
from pathlib import Path

from kgen.model_specs import MLA_MODEL_TYPES
from kgen.settings import child_environment
from kgen.vllm.kernels import audit_counts, launch_counts

TOP_K = 5
RESULT = "serve-result: "  # the line a serving child prints its JSON result on


@dataclass(frozen=True)
class Profile:
    """How both sides serve: the model's dtype and cache, the batch, CUDA graphs, memory."""

    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    block_size: int = 32
    max_tokens: int = 8
    chunk: int = 64  # max_num_batched_tokens: the chunked-prefill budget
    prompts: int = 6  # default_prompts(vocab, prompts)
    max_num_seqs: int = 8
    eager: bool = True  # False: vLLM's CUDA graphs
    gpu_memory_utilization: float | None = None  # None: a 64 MiB KV cache (vLLM's CPU build)
    attention_backend: str | None = None  # vLLM's attention_backend= (kgen registered in its place)


# The GPU comparison (--gpu) and its run on vLLM's CPU build (--gpu --dry-run).
GPU_PROFILE = Profile(dtype="bfloat16", block_size=16, max_tokens=32, chunk=2048, prompts=48, max_num_seqs=64,
                      eager=False, gpu_memory_utilization=0.9, attention_backend="FLASH_ATTN")
DRY_RUN_PROFILE = Profile(dtype="bfloat16", block_size=32, max_tokens=8, chunk=256, prompts=32, max_num_seqs=32)


def default_prompts(vocab_size: int, count: int = 6) -> list[list[int]]:
    """Prompts that exercise what serving does: short and long (chunked) prompts, two that share a
    72-token prefix (prefix cache hits), and lengths at and around block boundaries; past the first
    six, more of lengths 5..200 (a serving batch)."""
    def tokens(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocab_size - 10) + 5 for i in range(n)]
    shared = tokens(1, 72)
    prompts = [tokens(2, 7), tokens(3, 32), tokens(4, 33), shared + tokens(5, 40), shared + tokens(6, 9),
               tokens(7, 150)]
    prompts += [tokens(8 + i, 5 + (i * 37) % 196) for i in range(max(0, count - len(prompts)))]
    return prompts[:count]


def serve(model: str, backend: str, profile: Profile) -> dict:
    """Generate greedily for default_prompts in this process; the attention is vLLM's own
    (backend "vllm") or kgen's ("kgen": KGEN_VLLM_BACKEND must name the backend kgen replaces)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    config = json.loads((Path(model) / "config.json").read_text())
    memory = ({"gpu_memory_utilization": profile.gpu_memory_utilization} if profile.gpu_memory_utilization
              else {"kv_cache_memory_bytes": 64 << 20})
    backend_choice = {"attention_backend": profile.attention_backend} if profile.attention_backend else {}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype=profile.dtype, kv_cache_dtype=profile.kv_cache_dtype,
              block_size=profile.block_size, max_model_len=512, enforce_eager=profile.eager,
              enable_prefix_caching=True, max_num_batched_tokens=profile.chunk, max_num_seqs=profile.max_num_seqs,
              seed=0, **memory, **backend_choice)
    started = time.perf_counter()
    prompts = default_prompts(int(config.get("vocab_size") or config["text_config"]["vocab_size"]), profile.prompts)
    params = SamplingParams(max_tokens=profile.max_tokens, temperature=0.0, logprobs=TOP_K, ignore_eos=True)
    # One short request first, so that the timed run measures serving, not first-call set-up.
    llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], SamplingParams(max_tokens=2), use_tqdm=False)
    warm = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    done = time.perf_counter()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "backend": backend,
        "prompts": prompts,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                     for o in outputs],
        "launches": launch_counts(),
        "audits": audit_counts(),
        "startup_s": started - t0,
        "generate_s": done - warm,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": generated,
    }


def run_side(model: str, backend: str, replace: str = "CPU_ATTN", dtype: str = "float32",
             kv_cache_dtype: str = "auto", block_size: int = 32, max_tokens: int = 8, chunk: int = 64,
             extra_env: dict[str, str] | None = None, timeout: float = 900, profile: Profile | None = None) -> dict:
    """`serve` in a fresh process: backend "vllm" (vLLM's attention) or "kgen" (kgen replacing `replace`).
    `profile` in place of the separate settings."""
    profile = profile or Profile(dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                                 max_tokens=max_tokens, chunk=chunk)
    env = child_environment() | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} | (extra_env or {})
    env.pop("KGEN_VLLM_BACKEND", None)
    if backend == "kgen":
        env["KGEN_VLLM_BACKEND"] = replace
    cmd = [sys.executable, "-m", "kgen.vllm.compare", "--serve", model, "--backend", backend,
           "--profile", json.dumps(asdict(profile))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"serving {model} with {backend} attention failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


def cpu_backend_for(model: str) -> str:
    """The backend vLLM's CPU platform serves `model`'s attention with: CPU_MLA for an MLA model
    (DeepSeek-V2/V3, Kimi K2), CPU_ATTN otherwise."""
    config = json.loads((Path(model) / "config.json").read_text())
    model_type = (config.get("text_config") or config).get("model_type")
    return "CPU_MLA" if model_type in MLA_MODEL_TYPES else "CPU_ATTN"


def float64_errors(model: str, side: dict) -> dict:
    """An independent reference for one side: the model run by transformers in float64 (on the GPU
    when torch sees one) over the side's own prompts and tokens; the largest and mean absolute
    difference between the side's logprob of each token it chose and float64's."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).to(device).eval()
    diffs = []
    with torch.no_grad():
        for prompt, tokens, steps in zip(side["prompts"], side["tokens"], side["logprobs"], strict=True):
            ids = torch.tensor([prompt + tokens[:-1]], device=device)
            logits = net(input_ids=ids).logits[0, len(prompt) - 1:].double()
            exact = torch.log_softmax(logits, dim=-1)
            diffs += [abs(steps[i][str(t)] - float(exact[i, t])) for i, t in enumerate(tokens)]
    return {"max": max(diffs, default=0.0), "mean": sum(diffs) / max(1, len(diffs)), "tokens": len(diffs),
            "device": device}


def gpu_comparison(model: str, dry_run: bool, atol: float) -> dict:
    """Both sides served with the GPU profile (the CPU build's stand-ins with `dry_run`), each judged
    against float64, against each other, and timed. "ok": they agree within `atol` and kgen is no
    further from float64 than twice vLLM's own distance plus `atol`."""
    profile, replace = (DRY_RUN_PROFILE, "CPU_ATTN") if dry_run else (GPU_PROFILE, GPU_PROFILE.attention_backend)
    env = {} if dry_run else {"VLLM_GPU_SYNC_CHECK": "error"}
    sides = {"vllm": run_side(model, "vllm", profile=profile, extra_env=env),
             "kgen": run_side(model, "kgen", replace=replace, profile=profile, extra_env=env)}
    agreement = compare(sides["vllm"], sides["kgen"], atol)
    f64 = {name: float64_errors(model, side) for name, side in sides.items()}
    ok = agreement.ok and f64["kgen"]["max"] <= 2 * f64["vllm"]["max"] + atol
    timing = {name: {k: side[k] for k in ("startup_s", "generate_s", "prompt_tokens", "generated_tokens")}
              for name, side in sides.items()}
    return {"profile": asdict(profile), "replaced": replace, "dry_run": dry_run, "ok": ok,
            "agreement": asdict(agreement), "float64": f64, "timing": timing,
            "kgen_launches": sides["kgen"]["launches"]}


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
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.add_argument("--gpu", action="store_true", help="the GPU comparison against FLASH_ATTN (module docstring)")
    p.add_argument("--dry-run", action="store_true", help="with --gpu: the same steps on vLLM's CPU build")
    p.add_argument("--replace", default=None,
                   help="the vLLM backend kgen replaces (default CPU_MLA for an MLA model, else CPU_ATTN)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens (the chunked-prefill budget)")
    p.add_argument("--atol", type=float, default=None, help="logprob tolerance (default 1e-3; 0.05 with --gpu)")
    p.add_argument("--json", type=Path, help="write both sides' results (with --gpu: the comparison) here")
    args = p.parse_args(argv)
    if args.serve:
        result = serve(args.model, args.backend, Profile(**json.loads(args.profile)))
        print(RESULT + json.dumps(result), flush=True)
        return 0
    if args.dry_run and not args.gpu:
        p.error("--dry-run goes with --gpu")
    if args.gpu:
        report = gpu_comparison(args.model, args.dry_run, 0.05 if args.atol is None else args.atol)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        print(gpu_summary(report))
        return 0 if report["ok"] else 1
    common = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  max_tokens=args.max_tokens, chunk=args.chunk)
    atol = 1e-3 if args.atol is None else args.atol
    ref = run_side(args.model, "vllm", **common)
    test = run_side(args.model, "kgen", replace=args.replace or cpu_backend_for(args.model), **common)
    agreement = compare(ref, test, atol)
    if args.json:
        args.json.write_text(json.dumps({"vllm": ref, "kgen": test}, indent=1))
    print(f"{agreement.compared_tokens} tokens compared, logprobs within {agreement.max_logprob_diff:.3g}; "
          f"kgen launches: {test['launches']}")
    for line in agreement.divergences + agreement.problems:
        print(line)
    return 0 if agreement.ok else 1


def gpu_summary(report: dict) -> str:
    """The comparison in a few lines: agreement, distance from float64, timing."""
    a, f, t = report["agreement"], report["float64"], report["timing"]
    mode = "dry run on vLLM's CPU build" if report["dry_run"] else "GPU"
    lines = [f"kgen in place of {report['replaced']} ({mode}, {report['profile']['dtype']}, "
             f"{report['profile']['prompts']} prompts): {'OK' if report['ok'] else 'FAILED'}",
             f"  agreement: {a['compared_tokens']} tokens compared, logprobs within {a['max_logprob_diff']:.3g}",
             *(f"  {line}" for line in a["divergences"] + a["problems"])]
    for name in ("vllm", "kgen"):
        lines.append(f"  {name}: float64 distance max {f[name]['max']:.3g}, mean {f[name]['mean']:.3g} over "
                     f"{f[name]['tokens']} tokens; start-up {t[name]['startup_s']:.1f} s, "
                     f"{t[name]['generated_tokens'] / max(t[name]['generate_s'], 1e-9):.1f} generated tokens/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
