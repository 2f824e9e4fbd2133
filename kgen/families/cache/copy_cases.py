"""The copy-blocks family's verification cases and benchmark inputs (docs/verification.md):
pools of random bytes, the expectation is the same bytes with whole blocks copied; every
byte of every pool array of every layer must match.
"""

from __future__ import annotations

import numpy as np

from kgen.arrays import to_backend, to_numpy
from kgen.families.base import Bench, Case
from kgen.formats.cache import CacheFormat, cache_shapes, scale_shape
from kgen.formats.dtypes import dtype
from kgen.verify.judge.bitexact import compare, random_bytes
from kgen.verify.judge.guards import guarded, seal, tripwires
from kgen.verify.judge.report import CaseResult

NUM_BLOCKS = 13  # the least pool size; a run draws NUM_BLOCKS .. 2 * NUM_BLOCKS - 1
LAYERS = {"one_layer": 0, "three_layers": 3, "fork": 2, "empty": 2}  # 0: one array, not a list


def _pairs(rng: np.random.Generator, N: int, kind: str) -> np.ndarray:
    if kind == "empty":
        return np.zeros((0, 2), np.int32)
    perm = rng.permutation(N)
    if kind == "fork":  # one block copied to three
        return np.asarray([[perm[0], perm[1]], [perm[0], perm[2]], [perm[0], perm[3]]], np.int32)
    n = N // 3
    return np.stack([perm[:n], perm[n:2 * n]], axis=1).astype(np.int32)  # srcs and dsts disjoint


def _pool_specs(spec, N: int) -> dict[str, tuple[tuple, np.dtype]]:
    """Every pool array a call copies: the caches, and per_token_head scale pools (nvfp4: the block
    scales, as uint8 e4m3 bits)."""
    kv, f = spec.kv_cache, CacheFormat.of(spec)
    shapes = {n: (s, dtype(kv.dtype).numpy) for n, s in cache_shapes(spec, N).items()}
    if f.scale_pools:
        sd = np.dtype(np.uint8) if f.block_scaled else np.dtype(np.float32)
        shapes |= {n: (scale_shape(spec, N), sd) for n in ("k_scale", "v_scale")}
    return shapes


def _copied(pools: dict[str, list[np.ndarray]], pairs: np.ndarray) -> dict[str, list[np.ndarray]]:
    expected = {n: [p.copy() for p in ps] for n, ps in pools.items()}
    for ps in expected.values():
        for p in ps:
            p[pairs[:, 1]] = p[pairs[:, 0]]
    return expected


def cases() -> list[Case]:
    return [Case(kind, {"layers": layers}) for kind, layers in LAYERS.items()]


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    """Pools of random bytes inside guard bytes (a write past a pool fails), `pairs` sealed,
    every pool compared bit for bit; the pool size is drawn per run."""
    layers = case.params["layers"]
    num_blocks = int(rng.integers(NUM_BLOCKS, 2 * NUM_BLOCKS))
    pairs = _pairs(rng, num_blocks, case.name)
    pools = {n: [random_bytes(rng, s, d) for _ in range(max(layers, 1))]
             for n, (s, d) in _pool_specs(kernel.spec, num_blocks).items()}
    expected = _copied(pools, pairs)
    labels = {n: [f"{n}[layer {i}]" if layers else n for i in range(len(ps))] for n, ps in pools.items()}
    buffers = {label: guarded(label, p.shape, p.dtype, rng, content=p)
               for n, ps in pools.items() for label, p in zip(labels[n], ps, strict=True)}
    given = {label: to_backend(g.view, kernel.backend) for label, g in buffers.items()}
    given["pairs"] = to_backend(pairs, kernel.backend)
    args = {n: [given[label] for label in labels[n]] if layers else given[n] for n in pools}
    seals = [seal("pairs", pairs)]
    kernel(**args, pairs=given["pairs"])
    arrays = [(label, to_numpy(given[label]), expected[n][i], _describe_copy(pairs, label))
              for n in pools for i, label in enumerate(labels[n])]
    return [tripwires(compare(case.name, [len(pairs)], arrays), buffers, seals, given)]


def _describe_copy(pairs: np.ndarray, label: str):
    def describe(idx):
        blk = idx[0]
        src = pairs[pairs[:, 1] == blk, 0]
        what = f"should be a copy of block {int(src[0])}" if src.size else "must be untouched"
        return f"{label} block {blk}: {what}", None
    return describe


def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """A fork of `batch` sequences of `context` tokens: every one of their blocks copied once,
    into a pool of twice as many blocks (sources and destinations disjoint, shuffled)."""
    batch, context = bucket
    n = batch * -(-context // spec.kv_cache.block_size)
    perm = rng.permutation(2 * n)
    pairs = np.stack([perm[:n], perm[n:]], axis=1).astype(np.int32)
    pools = {name: random_bytes(rng, s, d) for name, (s, d) in _pool_specs(spec, 2 * n).items()}
    expected = _copied({name: [p] for name, p in pools.items()}, pairs)

    def check(got: dict) -> CaseResult:
        return compare("tuning", [n], [(name, got[name], expected[name][0], _describe_copy(pairs, name))
                                       for name in pools])

    return Bench({**pools, "pairs": pairs}, list(pools), check)
