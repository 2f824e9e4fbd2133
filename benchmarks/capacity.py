"""KV-cache capacity: contiguous reservation vs paging, replaying a request trace.

Requests (all queued at t=0, so the pool is the bottleneck) are served FCFS with
continuous batching: each step admits waiting requests while their KV fits, then every
running sequence decodes one token; a finished one releases its memory. Schemes:
  (a) contiguous, reserve L_max per sequence (first-fit in one address space)
  (b) contiguous, reserve the request's final length (the vLLM paper's "oracle")
  (c) kgen.paging.KVCacheManager, block sizes 8/16/32 (on exhaustion: preempt the
      newest sequence and recompute it later, the helper kgen.paging.preempt)
Reported over the saturated window (while requests are still waiting): the share of
reserved KV memory that holds token states, and the mean / peak number of concurrent
sequences. A second workload prefixes every prompt with one shared system prompt and
compares paging with and without prefix caching.

The trace is a log-normal fit to ShareGPT's lengths as the vLLM paper reports them
(mean input 161, mean output 338 tokens), sigma = 1, clipped so prompt + output <= L_max.
It is a documented approximation, not the dataset.

    PYTHONPATH=. .venv/bin/python benchmarks/capacity.py [--requests 1000] [--plot docs/img/capacity.png]
"""

from __future__ import annotations

import argparse
import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from kgen.paging import KVCacheManager, PoolExhausted, preempt

L_MAX = 2048
POOL_TOKENS = 32 * L_MAX  # token slots in the KV pool: room for 32 L_max reservations
SYSTEM_PROMPT = 512


def trace(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs from the log-normal ShareGPT fit."""
    rng = np.random.default_rng(seed)
    sigma = 1.0

    def draw(mean: float) -> np.ndarray:
        return np.maximum(1, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)).astype(int)

    p = np.minimum(draw(161.31), L_MAX // 2)
    o = np.minimum(draw(337.99), L_MAX - p)
    return list(zip(p.tolist(), o.tolist(), strict=True))


@dataclass
class Result:
    name: str
    token_share: float  # token states / reserved KV memory
    pool_share: float  # token states / whole pool
    mean_running: float
    peak_running: int
    kv_per_seq: float  # reserved token slots per running sequence


class FirstFit:
    """Contiguous allocation of token ranges in [0, size): free holes kept sorted."""

    def __init__(self, size: int):
        self.holes = [(0, size)]  # (start, length), by start

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                self.holes[i] = (start + n, length - n)
                if length == n:
                    del self.holes[i]
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, 0))
        self.holes.insert(i, (start, n))
        merged: list[tuple[int, int]] = []
        for s, length in self.holes:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self.holes = merged


def contiguous(reqs: list[tuple[int, int]], oracle: bool) -> Result:
    mem = FirstFit(POOL_TOKENS)
    waiting = deque(range(len(reqs)))
    running: dict[int, list[int]] = {}  # req -> [start, reserved, length, generated]
    samples = []
    while waiting or running:
        while waiting:
            p, o = reqs[waiting[0]]
            size = p + o if oracle else L_MAX
            start = mem.alloc(size)
            if start is None:
                break
            running[waiting.popleft()] = [start, size, p, 0]
        if waiting:  # saturated: measure
            held = sum(r[2] for r in running.values())
            reserved = sum(r[1] for r in running.values())
            samples.append((held, reserved, len(running)))
        for req in list(running):
            r = running[req]
            r[2] += 1
            r[3] += 1
            if r[3] == reqs[req][1]:
                mem.free(r[0], r[1])
                del running[req]
    return _summary(
        "contiguous, reserve L_max" if not oracle else "contiguous, reserve final length", samples
    )


def paged(reqs: list[tuple[int, int]], block_size: int, caching: bool = False, system: int = 0) -> Result:
    rng = np.random.default_rng(1)
    sys_prompt = rng.integers(0, 32000, system).tolist()
    mgr = KVCacheManager(POOL_TOKENS // block_size, block_size, enable_prefix_caching=caching)
    watermark = mgr.num_blocks // 100  # admit only while 1% stays free (less preemption)
    waiting = deque((i, sys_prompt + rng.integers(0, 32000, p).tolist(), o) for i, (p, o) in enumerate(reqs))
    running: dict[int, list[int]] = {}  # seq id -> [tokens left to generate]
    prompts: dict[int, list[int]] = {}
    next_id = 0
    samples = []
    while waiting or running:
        while waiting:
            req, prompt, left = waiting[0]
            if mgr.num_available_blocks() - -(-len(prompt) // block_size) < watermark:
                break
            try:
                mgr.add_sequence(next_id, prompt)
            except PoolExhausted:
                break
            waiting.popleft()
            running[next_id], prompts[next_id] = [left], prompt
            next_id += 1
        if waiting:
            used = mgr.num_blocks - mgr.num_available_blocks()
            held = sum(len(prompts[s]) for s in running)
            samples.append((held, used * block_size, len(running)))
        ids = np.fromiter(running, dtype=np.int64, count=len(running))
        toks = rng.integers(0, 32000, len(ids)).astype(np.int32)
        while True:
            try:
                mgr.append_tokens(ids, toks)
                break
            except PoolExhausted as e:  # recompute the newest later, with what it generated
                r = preempt(mgr, e.needed + mgr.num_available_blocks(), mode="recompute")
                for s in r.freed:
                    waiting.appendleft((s, prompts.pop(s), running.pop(s)[0]))
                keep = np.isin(ids, list(running))
                ids, toks = ids[keep], toks[keep]
        for s, t in zip(ids.tolist(), toks.tolist(), strict=True):
            prompts[s].append(t)
            running[s][0] -= 1
            if running[s][0] == 0:
                mgr.free(s)
                del running[s], prompts[s]
    name = f"paging, block size {block_size}" + (", prefix caching" if caching else "")
    return _summary(name, samples)


def _summary(name: str, samples: list[tuple[int, int, int]]) -> Result:
    a = np.asarray(samples, dtype=np.float64)
    held, reserved, running = a[:, 0].sum(), a[:, 1].sum(), a[:, 2]
    return Result(name, held / reserved, held / (POOL_TOKENS * len(a)), running.mean(), int(running.max()),
                  reserved / running.sum())  # fmt: skip


def table(title: str, rows: list[Result], base: Result) -> None:
    print(f"\n{title}")
    print(
        f"{'scheme':42s} {'tokens/reserved':>15s} {'tokens/pool':>11s} {'mean seqs':>9s} {'peak':>5s} {'vs row 1':>8s}"
    )
    for r in rows:
        print(f"{r.name:42s} {r.token_share:15.1%} {r.pool_share:11.1%} {r.mean_running:9.1f} "
              f"{r.peak_running:5d} {r.mean_running / base.mean_running:7.2f}x")  # fmt: skip


def plot(rows: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name.replace("contiguous, ", "contig.\n").replace("paging, ", "paged\n") for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar(names, [100 * r.token_share for r in rows], color=["#c44"] * 2 + ["#48c"] * (len(rows) - 2))
    ax1.set_ylabel("% of reserved KV memory holding tokens")
    ax1.axhline(96, ls="--", c="k", lw=0.8)
    ax2.bar(names, [r.mean_running for r in rows], color=["#c44"] * 2 + ["#48c"] * (len(rows) - 2))
    ax2.set_ylabel(f"mean concurrent sequences ({POOL_TOKENS} token pool)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("KV capacity, ShareGPT-like log-normal trace (benchmarks/capacity.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--plot", default="docs/img/capacity.png")
    a = ap.parse_args()
    reqs = trace(a.requests)
    p, o = np.asarray(reqs).T
    print(f"trace: {len(reqs)} requests, prompt mean {p.mean():.0f} (max {p.max()}), output mean {o.mean():.0f} "
          f"(max {o.max()}); L_max {L_MAX}; pool {POOL_TOKENS} token slots")  # fmt: skip
    rows = [contiguous(reqs, oracle=False), contiguous(reqs, oracle=True)]
    rows += [paged(reqs, b) for b in (8, 16, 32)]
    table("Capacity (saturated window)", rows, rows[0])
    if a.plot:
        plot(rows, a.plot)

    sysreqs = trace(a.requests // 2, seed=1)
    off = paged(sysreqs, 16, caching=False, system=SYSTEM_PROMPT)
    on = paged(sysreqs, 16, caching=True, system=SYSTEM_PROMPT)
    table(f"Shared {SYSTEM_PROMPT}-token system prompt, block size 16", [off, on], off)
    print("(with prefix caching, shared tokens count once per sequence: logical tokens / physical memory)")
    print(f"KV memory per running sequence: {off.kv_per_seq:.0f} -> {on.kv_per_seq:.0f} token slots "
          f"({1 - on.kv_per_seq / off.kv_per_seq:.1%} saved by prefix caching)")  # fmt: skip


if __name__ == "__main__":
    main()
