"""Host overhead of one decode step for a batch of sequences.

kgen.paging (append_tokens + block_tables + seq_lens) against the seed's toy per-token
allocator plus rebuilding the padded int32 table from its Python lists every step, which
is what a naive engine does. Prints a table; no assertions.

    PYTHONPATH=. .venv/bin/python benchmarks/host_overhead.py [--seqs 256] [--steps 512]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np

from kgen.paging import KVCacheManager

B = 16


# ---- baseline: the seed's toy_block_table.py, rewritten --------------------------------


@dataclass
class ToySeq:
    table: list[int] = field(default_factory=list)  # physical ids
    filled: int = 0  # tokens used in the last block
    length: int = 0


class ToyPool:
    def __init__(self, n: int):
        self.free = list(range(n))

    def alloc(self) -> int:
        if not self.free:
            raise MemoryError("KV pool exhausted")
        return self.free.pop()


def toy_append(seq: ToySeq, pool: ToyPool) -> None:
    if not seq.table or seq.filled == B:
        seq.table.append(pool.alloc())
        seq.filled = 0
    seq.filled += 1
    seq.length += 1


def toy_step(seqs: list[ToySeq], pool: ToyPool) -> tuple[np.ndarray, np.ndarray]:
    for s in seqs:
        toy_append(s, pool)
    width = max(len(s.table) for s in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.table)] = s.table
    return tables, np.array([s.length for s in seqs], dtype=np.int32)


def toy_setup(prompts: list[int], num_blocks: int) -> tuple[list[ToySeq], ToyPool]:
    pool = ToyPool(num_blocks)
    seqs = []
    for n in prompts:
        s = ToySeq()
        for _ in range(n):
            toy_append(s, pool)
        seqs.append(s)
    return seqs, pool


# ---- kgen.paging -------------------------------------------------------------------------


def toy_time(prompts: list[int], num_blocks: int, steps: int, churn: bool) -> float:
    seqs, pool = toy_setup(prompts, num_blocks)
    t0 = time.perf_counter()
    for i in range(steps):
        if churn:  # one sequence finishes, a new one arrives with its prompt
            pool.free.extend(seqs.pop(0).table)
            s = ToySeq()
            for _ in range(prompts[i % len(prompts)]):
                toy_append(s, pool)
            seqs.append(s)
        toy_step(seqs, pool)
    return (time.perf_counter() - t0) / steps


def mgr_time(prompts: list[int], num_blocks: int, steps: int, churn: bool, caching: bool) -> float:
    rng = np.random.default_rng(1)
    n = len(prompts)
    mgr = KVCacheManager(num_blocks, B, enable_prefix_caching=caching)
    for i, length in enumerate(prompts):
        mgr.add_sequence(i, rng.integers(0, 32000, length))
    toks = rng.integers(0, 32000, (steps, n)).astype(np.int32)
    new_prompts = rng.integers(0, 32000, (steps, max(prompts))).astype(np.int32)
    ids = np.arange(n, dtype=np.int64)
    t0 = time.perf_counter()
    for i in range(steps):
        if churn:
            mgr.free(int(ids[0]))
            mgr.add_sequence(n + i, new_prompts[i, : prompts[i % n]])
            ids = np.append(ids[1:], n + i)
        mgr.append_tokens(ids, toks[i])
        mgr.block_tables(ids)
        mgr.seq_lens(ids)
    return (time.perf_counter() - t0) / steps


def run(n_seqs: int, steps: int, repeats: int, churn: bool) -> list[tuple[str, float]]:
    prompts = np.random.default_rng(0).integers(128, 1024, n_seqs).tolist()
    num_blocks = n_seqs * (1024 + steps + 2 * B) // B * 2
    rows = [
        ("toy per-token + rebuild", min(toy_time(prompts, num_blocks, steps, churn) for _ in range(repeats)))
    ]
    for caching in (False, True):
        t = min(mgr_time(prompts, num_blocks, steps, churn, caching) for _ in range(repeats))
        rows.append((f"kgen.paging, prefix caching {'on' if caching else 'off'}", t))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    for churn in (False, True):
        title = "batch changes every step (1 finishes, 1 arrives)" if churn else "steady batch"
        print(
            f"\nOne decode step, {a.seqs} sequences, block size {B}, {title}; best of {a.repeats} x {a.steps} steps"
        )
        rows = run(a.seqs, a.steps, a.repeats, churn)
        base = rows[0][1]
        print(f"{'implementation':40s} {'us/step':>10s} {'speed-up':>9s}")
        for name, t in rows:
            print(f"{name:40s} {t * 1e6:10.1f} {base / t:8.1f}x")


if __name__ == "__main__":
    main()
