"""The cache-write family's verification cases and benchmark inputs (docs/verification.md).

Pools start as random bytes (a poison pattern a kernel cannot produce by accident); the
expected pools are the same bytes with exactly the documented writes applied (the model of
kgen/quantize.py). A case passes only if every byte of every pool array equals the
expectation: every written slot bit-exact, everything else untouched.
"""

from __future__ import annotations

import numpy as np

from kgen.arrays import args_to_backend, to_numpy
from kgen.families.base import Bench, Case
from kgen.families.cache import nvfp4_cases
from kgen.formats.cache import (
    BLOCK_GROUP,
    CacheFormat,
    from_layout,
    scale_from_layout,
    scale_to_layout,
    to_layout,
)
from kgen.formats.dtypes import dtype
from kgen.quantize import QMAX, per_token_head_scale, quantize
from kgen.verify.judge.bitexact import compare, random_bytes
from kgen.verify.judge.guards import guarded, seal, tripwires
from kgen.verify.judge.report import CaseResult

KINDS = ("scattered", "sequence", "single_token", "edge_values", "all_skipped", "strided_inputs")


def edge_values(spec, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Values (in stored units, before the scale) at rounding ties, beyond the range, tiny, zero."""
    name = spec.kv_cache.dtype
    if name == "int8":
        pool = np.concatenate([np.arange(-128, 128) + 0.5, [-1000.0, 1000.0, -127.6, 127.6, 0.0, 1e-30]])
    else:
        cd = dtype(name).numpy
        if cd.itemsize == 1:
            vals = np.arange(256, dtype=np.uint8).view(cd)
        else:
            vals = random_bytes(rng, (4096,), cd)
        with np.errstate(invalid="ignore"):
            fin = np.unique(vals[np.isfinite(vals)].astype(np.float64))
        mids = (fin[:-1] + fin[1:]) / 2  # exactly halfway: round-half-even decides
        big = float(fin.max())
        pool = np.concatenate([fin, mids, [-4 * big, 4 * big, 0.0]])
        if spec.dtype.q == "fp32" and name != "fp32":
            pool = np.concatenate([pool, [float(np.finfo(np.float32).tiny)]])
    return rng.choice(pool, size=shape)


def _scales(spec, rng: np.random.Generator, pow2: bool) -> dict[str, np.ndarray]:
    """Caller scales for per_tensor/per_head: inputs ~N(0,1) reach about QMAX / 2 (some saturate)."""
    kv, H = spec.kv_cache, spec.attention.num_kv_heads
    if CacheFormat.of(spec).block_scaled:
        return nvfp4_cases.tensor_scales(rng, pow2)
    if kv.scale not in ("per_tensor", "per_head"):
        return {}
    shape = () if kv.scale == "per_tensor" else (H,)
    out = {}
    for i, name in enumerate(("k_scale", "v_scale")):
        if pow2:
            s = np.exp2(rng.integers(-6, 1, size=shape).astype(np.float64))
        else:
            s = (2.5 + i) / QMAX[kv.dtype] * rng.uniform(0.5, 1.5, size=shape)
        out[name] = np.asarray(s, dtype=np.float32).reshape(shape)
    return out


def _write_case(spec, rng: np.random.Generator, kind: str) -> tuple[dict, np.ndarray, np.ndarray, int]:
    """(inputs dict without caches, key, value, num_blocks) for one case kind."""
    a, kv = spec.attention, spec.kv_cache
    H, B = a.num_kv_heads, kv.block_size
    qd = dtype(spec.dtype.q).numpy
    # sizes drawn per run (the verifier's seed), around the shape each kind is about
    extra = int(rng.integers(0, B + 1))
    T = {"scattered": 2 * B + 3 + extra, "sequence": 3 * B + 1 + extra, "single_token": 1, "edge_values": B + 5 + extra,
         "all_skipped": int(rng.integers(1, 9)), "strided_inputs": B + 2 + extra}[kind]
    N = 3 * (-(-T // B)) + int(rng.integers(1, 4))
    if kind == "sequence":  # one sequence through a shuffled block table; two leading padding tokens
        table = rng.permutation(N)[: -(-T // B)]
        pos = np.arange(T)
        slots = (table[pos // B] * B + pos % B).astype(np.int32)
        slots[:2] = -1
    else:
        slots = rng.choice(N * B, size=T, replace=False).astype(np.int32)
        skip = np.ones(T, bool) if kind == "all_skipped" else rng.random(T) < 0.25
        slots[skip] = -1
    pow2 = kind == "edge_values"
    inputs: dict = {"slot_mapping": slots, **_scales(spec, rng, pow2)}
    rows = []
    for name, D in (("k_scale", a.head_dim), ("v_scale", spec.v_head_dim_value)):  # key rows, value rows
        if kind == "edge_values" and CacheFormat.of(spec).block_scaled:
            x = nvfp4_cases.edge_rows((T, H, D), inputs[name[0] + "_tensor_scale"], rng)
        elif kind == "edge_values":
            x = edge_values(spec, (T, H, D), rng)
            if name in inputs:
                x = x * (inputs[name] if inputs[name].ndim == 0 else inputs[name][:, None])
            elif CacheFormat.of(spec).quantized:  # per_token_head: also an all-zero row, on a token that is written
                live = np.nonzero(slots >= 0)[0]
                x[live[0] if live.size else 0, 0] = 0.0
        else:
            spread = 1.0 if CacheFormat.of(spec).quantized else 3.0
            x = rng.standard_normal((T, H, D)) * spread
        with np.errstate(over="ignore"):
            x = x.astype(qd)
        if CacheFormat.of(spec).per_token:  # an infinite row would make its scale inf and the row inf/inf
            x[~np.isfinite(x.astype(np.float32))] = 0
        rows.append(x)
    key, value = rows
    if kind == "strided_inputs":  # key and value as views into one [T, 3, H, max(D, DV)] qkv buffer
        D, DV = key.shape[-1], value.shape[-1]
        qkv = np.zeros((T, 3, H, max(D, DV)), dtype=qd)
        qkv[:, 1, :, :D], qkv[:, 2, :, :DV] = key, value
        key, value = qkv[:, 1, :, :D], qkv[:, 2, :, :DV]
    inputs["key"], inputs["value"] = key, value
    return inputs, key, value, N


def _expected_write(spec, key, value, inputs, k0, v0, sk0, sv0):
    kv = spec.kv_cache
    slots = inputs["slot_mapping"]
    B = kv.block_size
    live = np.nonzero(slots >= 0)[0]
    blk, off = slots[live] // B, slots[live] % B
    k, v = k0.copy(), v0.copy()
    sk = None if sk0 is None else sk0.copy()
    sv = None if sv0 is None else sv0.copy()
    for rows, pool, spool, sname in ((key, k, sk, "k_scale"), (value, v, sv, "v_scale")):
        x = np.asarray(rows)[live]
        if CacheFormat.of(spec).block_scaled:
            pool[blk, off], spool[blk, off] = nvfp4_cases.expected_rows(x, inputs[sname[0] + "_tensor_scale"])
            continue
        if not CacheFormat.of(spec).quantized:
            scale = None
        elif kv.scale == "per_tensor":
            scale = inputs[sname]
        elif kv.scale == "per_head":
            scale = inputs[sname][:, None]
        else:
            with np.errstate(all="ignore"):
                s = per_token_head_scale(x.astype(np.float32), kv.dtype)
            spool[blk, off] = s
            scale = s[..., None]
        with np.errstate(all="ignore"):
            pool[blk, off] = quantize(x, scale, kv.dtype)
    return k, v, sk, sv


def _describe_write(spec, slots, label):
    B = spec.kv_cache.block_size

    def describe(idx):
        blk, off, h = idx[0], idx[1], idx[2]
        writer = np.nonzero(slots == blk * B + off)[0]
        token = int(writer[0]) if writer.size else None
        what = f"written by token {token}" if token is not None else "must be untouched"
        dim = f", dim {idx[3]}" if len(idx) > 3 else ""
        note = f"{label} block {blk}, offset {off}, head {h}{dim}: {what}"
        return note, ({"sequence": token, "head": h, "dim": idx[3] if len(idx) > 3 else None} if token is not None
                      else None)
    return describe


def cases() -> list[Case]:
    return [Case(kind) for kind in KINDS]


def _initial_pools(spec, rng: np.random.Generator, N: int):
    """Canonical K [N, B, H, D], V [N, B, H, DV] pools (nvfp4: [.., D / 2] bytes) and, for per_token_head,
    scale pools [N, B, H] (nvfp4: block scales [N, B, H, D / 16]) of random bytes."""
    kv, f = spec.kv_cache, CacheFormat.of(spec)
    cd = dtype(kv.dtype).numpy
    rows = (N, kv.block_size, f.num_kv_heads, f.row_len)
    k0, v0 = random_bytes(rng, rows, cd), random_bytes(rng, (*rows[:3], f.v_row_len), cd)
    if f.block_scaled:
        scale_rows, sd = (*rows[:3], f.head_dim // BLOCK_GROUP), np.dtype(np.uint8)
    else:
        scale_rows, sd = rows[:3], np.dtype(np.float32)
    sk0 = random_bytes(rng, scale_rows, sd) if f.scale_pools else None
    sv0 = random_bytes(rng, scale_rows, sd) if f.scale_pools else None
    return k0, v0, sk0, sv0


def _pools_in_layout(spec, k0, v0, sk0, sv0) -> dict[str, np.ndarray]:
    pools = to_layout(spec, k0, v0)
    if sk0 is not None:
        pools["k_scale"], pools["v_scale"] = scale_to_layout(spec, sk0), scale_to_layout(spec, sv0)
    return pools


def _judge(spec, name: str, slots, got: dict[str, np.ndarray], exp) -> CaseResult:
    """Compare the call's pool arrays (host copies) with the expected canonical pools."""
    gk, gv = from_layout(spec, got)
    arrays = [("K", gk, exp[0], _describe_write(spec, slots, "K")),
              ("V", gv, exp[1], _describe_write(spec, slots, "V"))]
    if exp[2] is not None:
        arrays += [(n, scale_from_layout(spec, got[n]), e, _describe_write(spec, slots, n))
                   for n, e in (("k_scale", exp[2]), ("v_scale", exp[3]))]
    return compare(name, [len(slots)], arrays)


def run_case(kernel, case: Case, rng: np.random.Generator) -> list[CaseResult]:
    """Inputs sealed (key, value, slot_mapping, caller scales), every pool array inside guard
    bytes (a write past a pool fails), the pools compared bit for bit."""
    spec = kernel.spec
    inputs, key, value, N = _write_case(spec, rng, case.name)
    initial = _initial_pools(spec, rng, N)
    exp = _expected_write(spec, key, value, inputs, *initial)
    pools = {name: guarded(name, p.shape, p.dtype, rng, content=p)
             for name, p in _pools_in_layout(spec, *initial).items()}
    seals = [seal(name, x) for name, x in inputs.items()]
    args = args_to_backend({**inputs, **{name: g.view for name, g in pools.items()}}, kernel.backend)
    kernel(**args)
    got = {name: to_numpy(args[name]) for name in pools}
    result = _judge(spec, case.name, inputs["slot_mapping"], got, exp)
    return [tripwires(result, pools, seals, args)]


def bench(spec, bucket: tuple[int, int], rng: np.random.Generator) -> Bench:
    """One decode step of `batch` sequences of `context` tokens: each writes one new token (its
    last position) into a shuffled pool holding every sequence's blocks."""
    batch, context = bucket
    a, kv = spec.attention, spec.kv_cache
    B, H, D = kv.block_size, a.num_kv_heads, a.head_dim
    per_seq = -(-context // B)
    N = batch * per_seq
    last = rng.permutation(N)[:batch]  # each sequence's last block
    slots = (last * B + (context - 1) % B).astype(np.int32)
    inputs = {"slot_mapping": slots, **_scales(spec, rng, pow2=False)}
    spread = 1.0 if CacheFormat.of(spec).quantized else 3.0
    qd = dtype(spec.dtype.q).numpy
    key, value = ((rng.standard_normal((batch, H, d)) * spread).astype(qd) for d in (D, spec.v_head_dim_value))
    inputs["key"], inputs["value"] = key, value
    initial = _initial_pools(spec, rng, N)
    exp = _expected_write(spec, key, value, inputs, *initial)
    pools = _pools_in_layout(spec, *initial)
    return Bench({**inputs, **pools}, list(pools), lambda got: _judge(spec, "tuning", slots, got, exp))
