"""Random paged-attention inputs that follow a spec's ABI, with the traps of DESIGN.md §6:
physical blocks shuffled over a pool several times larger than needed, optional
prefix blocks shared between two sequences, and poison (NaN, or extreme values for
int8) in every tail slot, every unreferenced block and every unused table entry.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from kgen.dtypes import QUANTIZED, dtype
from kgen.families.paged_decode import cache_shapes

POOL_FACTOR = 3  # pool blocks per block in use


def _cast(values: np.ndarray, name: str) -> np.ndarray:
    d = dtype(name).numpy
    if name == "int8":
        return np.clip(np.rint(values), -127, 127).astype(np.int8)
    if name.startswith("fp8"):
        limit = float(ml_dtypes.finfo(d).max)
        return np.clip(values, -limit, limit).astype(d)
    return values.astype(d)


def _poison(name: str) -> float:
    return 127.0 if name == "int8" else float("nan")  # int8 has no NaN: use its extreme


def _strided(arr: np.ndarray, extra: tuple[int, ...], fill: float) -> np.ndarray:
    """`arr` copied into a poisoned, larger array and returned as a view of it: a pool whose
    strides are not the packed ones (padding between blocks, heads, tokens or K and V)."""
    big = np.empty(tuple(n + e for n, e in zip(arr.shape, extra, strict=True)), dtype=arr.dtype)
    big[...] = np.asarray(fill).astype(arr.dtype)
    view = big[tuple(slice(0, n) for n in arr.shape)]
    view[...] = arr
    return view


def _pool_padding(spec) -> dict[str, tuple[int, ...]]:
    """Extra elements per axis for each cache array of a padded pool. K and V get different
    padding (a kernel that steps V with K's strides fails); the head_dim axis grows by whole
    16-byte vectors, so the strides stay as aligned as the vector loads need."""
    kv = spec.kv_cache
    v16 = 16 // dtype(kv.dtype).itemsize
    if kv.layout == "vllm":  # K [N, H, D/x, B, x]; V [N, H, D, B] takes scalar loads: any stride
        return {"k_cache": (0, 1, 1, 1, 0), "v_cache": (0, 1, 0, 3)}
    if kv.layout == "fused":  # [N, 2, ...]: a gap between the K and V halves too
        return {"kv_cache": (0, 1, 1, 1, v16)}
    return {"k_cache": (0, 1, 1, v16), "v_cache": (0, 2, 0, 2 * v16) if kv.resolved_order == "HND"
            else (0, 0, 2, 2 * v16)}


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's geometric slopes 2^(-8 i / n)."""
    return np.asarray([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], dtype=np.float32)


def make_decode_case(spec, seq_lens: list[int], rng: np.random.Generator, share_prefix: bool = False,
                     extra_table_cols: int = 1, padded: bool = False) -> dict:
    """Keyword arguments for a decode call (numpy arrays) plus out pre-filled with NaN.
    With `padded` the cache pools (and per-token scales) are strided views into larger arrays."""
    a, kv = spec.attention, spec.kv_cache
    B, H, D, Hq = kv.block_size, a.num_kv_heads, a.head_dim, a.num_q_heads
    S = len(seq_lens)
    nblocks = [math.ceil(n / B) for n in seq_lens]
    M = max(nblocks) + extra_table_cols
    shared = 0
    if share_prefix and S >= 2:
        shared = min(seq_lens[0], seq_lens[1]) // B  # full blocks both sequences cover
    needed = sum(nblocks) - shared
    N = POOL_FACTOR * needed + 2
    perm = rng.permutation(N)
    tables = np.empty((S, M), dtype=np.int32)
    used_blocks, nxt = set(), 0
    for i, nb in enumerate(nblocks):
        for j in range(nb):
            if i == 1 and j < shared:
                tables[i, j] = tables[0, j]
            else:
                tables[i, j] = perm[nxt]
                nxt += 1
            used_blocks.add(int(tables[i, j]))
    unused = [int(b) for b in perm[nxt:]]
    for i, nb in enumerate(nblocks):  # never-read entries point at poisoned blocks
        tables[i, nb:] = rng.choice(unused, size=M - nb)

    # canonical storage [N, H, B, D] of stored values, poison everywhere first
    store = np.full((N, H, B, D), _poison(kv.dtype), dtype=np.float64)
    vstore = store.copy()
    quant = kv.dtype in QUANTIZED
    spread = 100.0 if kv.dtype == "int8" else (3.0 if quant else 1.0)
    for i, n in enumerate(seq_lens):
        for j in range(nblocks[i]):
            if i == 1 and j < shared:
                continue  # written by sequence 0: shared prefix tokens are identical
            blk, count = int(tables[i, j]), min(B, n - j * B)
            store[blk, :, :count] = rng.standard_normal((H, count, D)) * spread
            vstore[blk, :, :count] = rng.standard_normal((H, count, D)) * spread
    args: dict = {}
    kq, vq = _cast(store, kv.dtype), _cast(vstore, kv.dtype)
    shapes = cache_shapes(spec, N)
    if kv.layout == "vllm":
        x = shapes["k_cache"][-1]
        args["k_cache"] = np.ascontiguousarray(kq.reshape(N, H, B, D // x, x).transpose(0, 1, 3, 2, 4))
        args["v_cache"] = np.ascontiguousarray(vq.transpose(0, 1, 3, 2))
    else:
        if kv.resolved_order == "NHD":
            kq, vq = kq.transpose(0, 2, 1, 3), vq.transpose(0, 2, 1, 3)
        if kv.layout == "fused":
            args["kv_cache"] = np.ascontiguousarray(np.stack([kq, vq], axis=1))
        else:
            args["k_cache"], args["v_cache"] = np.ascontiguousarray(kq), np.ascontiguousarray(vq)

    if padded:
        for name, extra in _pool_padding(spec).items():
            args[name] = _strided(args[name], extra, _poison(kv.dtype))

    if quant:
        for name in ("k_scale", "v_scale"):
            base = (0.01 if kv.dtype == "int8" else 0.5) * (1.0 if name == "k_scale" else 1.7)
            if kv.scale == "per_tensor":
                args[name] = np.asarray(base * rng.uniform(0.5, 1.5), dtype=np.float32).reshape(())
            elif kv.scale == "per_head":
                args[name] = (base * rng.uniform(0.5, 1.5, H)).astype(np.float32)
            else:
                pool = np.full((N, H, B), np.nan, dtype=np.float32)
                for i, n in enumerate(seq_lens):
                    for j in range(nblocks[i]):
                        count = min(B, n - j * B)
                        pool[int(tables[i, j]), :, :count] = base * rng.uniform(0.5, 1.5, (H, count))
                if kv.resolved_order == "NHD":
                    pool = pool.transpose(0, 2, 1)
                args[name] = np.ascontiguousarray(pool)
                if padded:
                    args[name] = _strided(args[name], (0, 1, 1), np.nan)
    if a.alibi:
        args["alibi_slopes"] = alibi_slopes(Hq)
    args["q"] = _cast(rng.standard_normal((S, Hq, D)), spec.dtype.q)
    args["block_tables"] = tables
    args["seq_lens"] = np.asarray(seq_lens, dtype=np.int32)
    args["out"] = np.full((S, Hq, D), np.nan, dtype=dtype(spec.dtype.resolved_out).numpy)
    return args
