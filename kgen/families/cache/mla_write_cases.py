"""Verification cases of cache_write for the mla layout (docs/verification.md): the pool (and a
per-token scale pool) starts as random bytes; the expectation is those bytes with exactly the
documented writes applied (kgen/quantize.py); every byte must match. The case kinds are the
other cache_write's (kgen/families/cache/write_cases.py), on latent rows [num_tokens, head_dim].
fp8_ds_mla rows (kgen/formats/ds_mla.py) get tiles of their own magnitudes (2^-20 .. 2^20 and zero),
and the edge_values case puts each tile's values on e4m3 ties of the tile's scale, with a tile
whose amax / 448 is exactly a power of two, one just above, and one under the 1e-4 scale floor."""

from __future__ import annotations

import numpy as np

from kgen.arrays import args_to_backend, to_numpy
from kgen.families.base import Bench, Case
from kgen.families.cache.write_cases import KINDS, edge_values
from kgen.formats import ds_mla
from kgen.formats.cache import CacheFormat
from kgen.formats.dtypes import QMAX, dtype
from kgen.quantize import per_token_head_scale, quantize, quantize_ds_mla_rows
from kgen.verify.judge.bitexact import compare, random_bytes
from kgen.verify.judge.guards import guarded, seal, tripwires
from kgen.verify.judge.report import CaseResult


def cases() -> list[Case]:
    return [Case(kind) for kind in KINDS]


def _slots(kind: str, T: int, N: int, B: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "sequence":  # one sequence through a shuffled block table; two leading padding tokens
        table = rng.permutation(N)[: -(-T // B)]
        pos = np.arange(T)
        slots = (table[pos // B] * B + pos % B).astype(np.int32)
        slots[:2] = -1
        return slots
    slots = rng.choice(N * B, size=T, replace=False).astype(np.int32)
    slots[np.ones(T, bool) if kind == "all_skipped" else rng.random(T) < 0.25] = -1
    return slots


def _case(spec, rng: np.random.Generator, kind: str) -> tuple[dict, int]:
    """(inputs: kv, slot_mapping and a caller's kv_scale, num_blocks) of one case kind."""
    D, B, kvd = spec.attention.head_dim, spec.kv_cache.block_size, spec.kv_cache.dtype
    f = CacheFormat.of(spec)
    extra = int(rng.integers(0, B + 1))
    T = {"scattered": 2 * B + 3 + extra, "sequence": 3 * B + 1 + extra, "single_token": 1, "edge_values": B + 5 + extra,
         "all_skipped": int(rng.integers(1, 9)), "strided_inputs": B + 2 + extra}[kind]
    N = 3 * (-(-T // B)) + int(rng.integers(1, 4))
    inputs: dict = {"slot_mapping": _slots(kind, T, N, B, rng)}
    if f.scaled and not f.per_token:  # inputs ~N(0,1) reach about QMAX / 2 (some saturate); powers of two at the edges
        s = np.exp2(float(rng.integers(-6, 1))) if kind == "edge_values" else 2.5 / QMAX[kvd] * rng.uniform(0.5, 1.5)
        inputs["kv_scale"] = np.asarray(s, dtype=np.float32).reshape(())
    if f.ds_mla:
        x = _ds_mla_rows(T, kind == "edge_values", rng)
    elif kind == "edge_values":
        x = edge_values(spec, (T, D), rng) * (inputs["kv_scale"] if "kv_scale" in inputs else 1.0)
        if f.per_token:  # an all-zero row, on a token that is written
            live = np.nonzero(inputs["slot_mapping"] >= 0)[0]
            x[live[0] if live.size else 0] = 0.0
    else:
        x = rng.standard_normal((T, D)) * (1.0 if f.quantized else 3.0)
    with np.errstate(over="ignore"):
        x = x.astype(dtype(spec.dtype.q).numpy)
    if f.per_token:  # an infinite row would make its scale inf and the row inf/inf
        x[~np.isfinite(x.astype(np.float32))] = 0
    if kind == "strided_inputs":  # kv as a view into a wider [T, 2, D] buffer
        wide = np.zeros((T, 2, D), dtype=x.dtype)
        wide[:, 1] = x
        x = wide[:, 1]
    inputs["kv"] = x
    return inputs, N


def _ds_mla_rows(T: int, edges: bool, rng: np.random.Generator) -> np.ndarray:
    """Latent rows [T, 576] (float64, bf16-exact) whose four tiles have magnitudes of their own."""
    x = rng.standard_normal((T, ds_mla.HEAD_DIM))
    gains = np.exp2(rng.integers(-20, 21, (T, ds_mla.TILES))).astype(np.float64)
    gains[rng.random((T, ds_mla.TILES)) < 0.1] = 0.0  # all-zero tiles: the floor scale, zeros stored
    x[:, :ds_mla.LATENT] *= np.repeat(gains, ds_mla.TILE, axis=1)
    if edges:  # each tile on the e4m3 grid (and its midpoints) of a power-of-two scale s = 2^k
        grid = np.arange(256, dtype=np.uint8).view(dtype("fp8_e4m3").numpy).astype(np.float64)
        fin = np.unique(grid[np.isfinite(grid)])
        pool = np.concatenate([fin, (fin[:-1] + fin[1:]) / 2])
        for t in range(ds_mla.TILES):
            s = np.exp2(rng.integers(-10, 11, T))[:, None]
            tile = rng.choice(pool, (T, ds_mla.TILE)) * s
            tile[:, 0] = 448.0 * s[:, 0] * np.where(rng.random(T) < 0.5, 1.0, 1.0 + 2.0 ** -7)  # scale s, or 2s
            tiny = rng.random(T) < 0.15  # amax / 448 under the floor: scale 2^-13
            tile[tiny] *= 1e-4 / 448 / s[tiny]
            x[:, t * ds_mla.TILE:(t + 1) * ds_mla.TILE] = tile
    return x


def _initial(spec, rng: np.random.Generator, N: int) -> dict[str, np.ndarray]:
    B = spec.kv_cache.block_size
    shape = (N, B, ds_mla.ROW_BYTES if CacheFormat.of(spec).ds_mla else spec.attention.head_dim)
    pools = {"kv_cache": random_bytes(rng, shape, dtype(spec.kv_cache.dtype).numpy)}
    if CacheFormat.of(spec).per_token:
        pools["kv_scale"] = random_bytes(rng, (N, B), np.dtype(np.float32))
    return pools


def _expected(spec, inputs: dict, initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The initial pools with the documented writes applied."""
    kvd, B = spec.kv_cache.dtype, spec.kv_cache.block_size
    slots = inputs["slot_mapping"]
    live = np.nonzero(slots >= 0)[0]
    blk, off = slots[live] // B, slots[live] % B
    exp = {name: p.copy() for name, p in initial.items()}
    x = np.asarray(inputs["kv"])[live]
    f = CacheFormat.of(spec)
    scale = None
    with np.errstate(all="ignore"):
        if f.ds_mla:
            exp["kv_cache"][blk, off] = quantize_ds_mla_rows(x)
            return exp
        if f.per_token:
            s = per_token_head_scale(x.astype(np.float32), kvd)
            exp["kv_scale"][blk, off] = s
            scale = s[:, None]
        elif f.scaled:
            scale = inputs["kv_scale"]
        exp["kv_cache"][blk, off] = quantize(x, scale, kvd)
    return exp


def _judge(spec, name: str, slots: np.ndarray, got: dict[str, np.ndarray], exp: dict[str, np.ndarray]) -> CaseResult:
    B = spec.kv_cache.block_size

    def describe(idx):
        writer = np.nonzero(slots == idx[0] * B + idx[1])[0]
        token = int(writer[0]) if writer.size else None
        dim = f", dim {idx[2]}" if len(idx) > 2 else ""
        what = f"written by token {token}" if token is not None else "must be untouched"
        return (f"block {idx[0]}, offset {idx[1]}{dim}: {what}",
                {"sequence": token, "dim": idx[2] if len(idx) > 2 else None} if token is not None else None)

    return compare(name, [len(slots)], [(n, got[n], exp[n], describe) for n in exp])


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    """Inputs sealed, the pools inside guard bytes, compared bit for bit with the expectation."""
    spec = kernel.spec
    inputs, N = _case(spec, rng, case.name)
    initial = _initial(spec, rng, N)
    exp = _expected(spec, inputs, initial)
    pools = {name: guarded(name, p.shape, p.dtype, rng, content=p) for name, p in initial.items()}
    seals = [seal(name, x) for name, x in inputs.items()]
    args = args_to_backend({**inputs, **{name: g.view for name, g in pools.items()}}, kernel.backend)
    kernel(**args)
    got = {name: to_numpy(args[name]) for name in pools}
    return [tripwires(_judge(spec, case.name, inputs["slot_mapping"], got, exp), pools, seals, args)]


def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """One decode step of `batch` sequences of `context` tokens: each writes its last position."""
    batch, context = bucket
    B, D = spec.kv_cache.block_size, spec.attention.head_dim
    N = batch * -(-context // B)
    slots = (rng.permutation(N)[:batch] * B + (context - 1) % B).astype(np.int32)
    inputs = {"slot_mapping": slots, "kv": rng.standard_normal((batch, D)).astype(dtype(spec.dtype.q).numpy)}
    f = CacheFormat.of(spec)
    if f.scaled and not f.per_token:
        inputs["kv_scale"] = np.asarray(2.5 / QMAX[spec.kv_cache.dtype], dtype=np.float32).reshape(())
    initial = _initial(spec, rng, N)
    exp = _expected(spec, inputs, initial)
    return Bench({**inputs, **initial}, list(initial), lambda got: _judge(spec, "tuning", slots, got, exp))
