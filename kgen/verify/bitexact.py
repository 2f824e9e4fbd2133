"""Bit-exact verification of the cache kernels (cache_write, copy_blocks).

Pools start as random bytes (a poison pattern that a kernel cannot produce by accident);
the expected pools are the same bytes with exactly the documented writes applied
(kgen/quantize.py for cache_write, whole-block copies for copy_blocks). A case passes
only if every byte of every pool array equals the expectation: every written slot
bit-exact, everything else untouched. CaseResult.max_error counts wrong elements
(bound 0); the note names the first one (array, block, slot, head, dim, writer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kgen.arrays import args_to_backend, to_numpy
from kgen.dtypes import QUANTIZED, dtype
from kgen.families.paged_decode import cache_shapes, scale_shape
from kgen.quantize import QMAX, per_token_head_scale, quantize
from kgen.seeds import fresh_seed
from kgen.verify.report import CaseResult, VerificationReport

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])


def _poison(rng: np.random.Generator, shape: tuple, np_dtype: np.dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np_dtype.itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(np_dtype).reshape(shape)


# ---- layouts: the canonical pool is [N, B, H, D] (scales [N, B, H]) ----------------------------
def to_layout(spec, k: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
    """Cache arguments in the spec's layout from canonical [N, B, H, D] K and V."""
    kv = spec.kv_cache
    N, B, H, D = k.shape
    if kv.layout == "vllm":
        x = cache_shapes(spec, N)["k_cache"][-1]
        return {"k_cache": np.ascontiguousarray(k.reshape(N, B, H, D // x, x).transpose(0, 2, 3, 1, 4)),
                "v_cache": np.ascontiguousarray(v.transpose(0, 2, 3, 1))}
    if kv.resolved_order == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if kv.layout == "fused":
        return {"kv_cache": np.ascontiguousarray(np.stack([k, v], axis=1))}
    return {"k_cache": np.ascontiguousarray(k), "v_cache": np.ascontiguousarray(v)}


def from_layout(spec, args: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Canonical [N, B, H, D] K and V from the spec's cache arguments."""
    kv = spec.kv_cache
    if kv.layout == "vllm":
        k, v = args["k_cache"], args["v_cache"]
        N, H, Dx, B, x = k.shape
        return k.transpose(0, 3, 1, 2, 4).reshape(N, B, H, Dx * x), v.transpose(0, 3, 1, 2)
    if kv.layout == "fused":
        k, v = args["kv_cache"][:, 0], args["kv_cache"][:, 1]
    else:
        k, v = args["k_cache"], args["v_cache"]
    if kv.resolved_order == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return k, v


def _scale_layout(spec, s: np.ndarray) -> np.ndarray:
    """[N, B, H] <-> the ABI's scale pool (its own inverse: a transpose or nothing)."""
    return s if spec.kv_cache.resolved_order == "NHD" else np.ascontiguousarray(s.transpose(0, 2, 1))


# ---- moving arguments to the kernel's device and back ---------------------------------------
# ---- comparing ------------------------------------------------------------------------------
def _compare(name: str, count: list[int], arrays: list[tuple[str, np.ndarray, np.ndarray, Callable]]) -> CaseResult:
    """arrays: (label, got, expected, describe(index) -> (note, first_failure)); all must match bitwise."""
    wrong, first = 0, None
    for label, got, exp, describe in arrays:
        bad = _bits(got) != _bits(exp)
        n = int(bad.sum())
        if n and first is None:
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            note, where = describe(idx)
            first = (f"{label}{list(idx)}: got {got[idx]!r} (bits {int(_bits(got)[idx]):#x}), expected {exp[idx]!r} "
                     f"(bits {int(_bits(exp)[idx]):#x}); {note}", where)
        wrong += n
    result = CaseResult(name, count, float(wrong), 0.0, 0.0, wrong == 0)
    if first is not None:
        result.note = f"{wrong} element(s) wrong; first: {first[0]}"
        result.first_failure = first[1]
    return result


# ---- cache_write ----------------------------------------------------------------------------
def _edge_values(spec, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Values (in stored units, before the scale) at rounding ties, beyond the range, tiny, zero."""
    name = spec.kv_cache.dtype
    if name == "int8":
        pool = np.concatenate([np.arange(-128, 128) + 0.5, [-1000.0, 1000.0, -127.6, 127.6, 0.0, 1e-30]])
    else:
        cd = dtype(name).numpy
        if cd.itemsize == 1:
            vals = np.arange(256, dtype=np.uint8).view(cd)
        else:
            vals = _poison(rng, (4096,), cd)
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
    H, D, B = a.num_kv_heads, a.head_dim, kv.block_size
    qd = dtype(spec.dtype.q).numpy
    T = {"scattered": 2 * B + 3, "sequence": 3 * B + 1, "single_token": 1, "edge_values": B + 5,
         "all_skipped": 4, "strided_inputs": B + 2}[kind]
    N = 3 * (-(-T // B)) + 2
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
    for name in ("k_scale", "v_scale"):
        if kind == "edge_values":
            x = _edge_values(spec, (T, H, D), rng)
            if name in inputs:
                x = x * (inputs[name] if inputs[name].ndim == 0 else inputs[name][:, None])
            elif kv.dtype in QUANTIZED:  # per_token_head: also an all-zero row
                x[0, 0] = 0.0
        else:
            spread = 1.0 if kv.dtype in QUANTIZED else 3.0
            x = rng.standard_normal((T, H, D)) * spread
        with np.errstate(over="ignore"):
            x = x.astype(qd)
        if kv.scale == "per_token_head":  # an infinite row would make its scale inf and the row inf/inf
            x[~np.isfinite(x.astype(np.float32))] = 0
        rows.append(x)
    key, value = rows
    if kind == "strided_inputs":  # key and value as views into one [T, 3, H, D] qkv buffer
        qkv = np.zeros((T, 3, H, D), dtype=qd)
        qkv[:, 1], qkv[:, 2] = key, value
        key, value = qkv[:, 1], qkv[:, 2]
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
        if kv.dtype not in QUANTIZED:
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


def verify_cache_write(kernel, rng: np.random.Generator, report: VerificationReport) -> None:
    spec, kv = kernel.spec, kernel.spec.kv_cache
    H, D, B = spec.attention.num_kv_heads, spec.attention.head_dim, kv.block_size
    cd = dtype(kv.dtype).numpy
    for kind in ("scattered", "sequence", "single_token", "edge_values", "all_skipped", "strided_inputs"):
        inputs, key, value, N = _write_case(spec, rng, kind)
        k0, v0 = _poison(rng, (N, B, H, D), cd), _poison(rng, (N, B, H, D), cd)
        ptoken = kv.scale == "per_token_head"
        sk0 = _poison(rng, (N, B, H), np.dtype(np.float32)) if ptoken else None
        sv0 = _poison(rng, (N, B, H), np.dtype(np.float32)) if ptoken else None
        exp = _expected_write(spec, key, value, inputs, k0, v0, sk0, sv0)
        pools = to_layout(spec, k0, v0)
        if ptoken:
            pools["k_scale"], pools["v_scale"] = _scale_layout(spec, sk0), _scale_layout(spec, sv0)
        args = {**inputs, **pools}
        if kernel.backend != "cpu":
            args = args_to_backend({k: np.ascontiguousarray(x) for k, x in args.items()}, kernel.backend)
        kernel(**args)
        got = {name: to_numpy(args[name]) for name in pools}
        gk, gv = from_layout(spec, got)
        slots = inputs["slot_mapping"]
        arrays = [("K", gk, exp[0], _describe_write(spec, slots, "K")),
                  ("V", gv, exp[1], _describe_write(spec, slots, "V"))]
        if ptoken:
            arrays += [("k_scale", _scale_layout(spec, got["k_scale"]), exp[2], _describe_write(spec, slots, "k_scale")),
                       ("v_scale", _scale_layout(spec, got["v_scale"]), exp[3], _describe_write(spec, slots, "v_scale"))]
        report.cases.append(_compare(kind, [len(slots)], arrays))


# ---- copy_blocks ----------------------------------------------------------------------------
def _pairs(rng: np.random.Generator, N: int, kind: str) -> np.ndarray:
    if kind == "empty":
        return np.zeros((0, 2), np.int32)
    perm = rng.permutation(N)
    if kind == "fork":  # one block copied to three
        return np.asarray([[perm[0], perm[1]], [perm[0], perm[2]], [perm[0], perm[3]]], np.int32)
    n = N // 3
    return np.stack([perm[:n], perm[n:2 * n]], axis=1).astype(np.int32)  # srcs and dsts disjoint


def verify_copy_blocks(kernel, rng: np.random.Generator, report: VerificationReport) -> None:
    spec, kv = kernel.spec, kernel.spec.kv_cache
    N = 13
    shapes = {n: (s, dtype(kv.dtype).numpy) for n, s in cache_shapes(spec, N).items()}
    if kv.scale == "per_token_head":
        shapes |= {n: (scale_shape(spec, N), np.dtype(np.float32)) for n in ("k_scale", "v_scale")}
    for kind, layers in (("one_layer", 0), ("three_layers", 3), ("fork", 2), ("empty", 2)):
        pairs = _pairs(rng, N, kind)
        count = max(layers, 1)
        pools = {n: [_poison(rng, s, d) for _ in range(count)] for n, (s, d) in shapes.items()}
        expected = {n: [p.copy() for p in ps] for n, ps in pools.items()}
        for ps in expected.values():
            for p in ps:
                p[pairs[:, 1]] = p[pairs[:, 0]]
        dev = {n: [args_to_backend({"a": p}, kernel.backend)["a"] for p in ps] for n, ps in pools.items()}
        args = {n: (ps if layers else ps[0]) for n, ps in dev.items()}
        kernel(**args, pairs=args_to_backend({"p": pairs}, kernel.backend)["p"])
        arrays = []
        for n, ps in dev.items():
            for i, p in enumerate(ps):
                label = f"{n}[layer {i}]" if layers else n
                arrays.append((label, to_numpy(p), expected[n][i], _describe_copy(pairs, label)))
        report.cases.append(_compare(kind, [len(pairs)], arrays))


def _describe_copy(pairs: np.ndarray, label: str):
    def describe(idx):
        blk = idx[0]
        src = pairs[pairs[:, 1] == blk, 0]
        what = f"should be a copy of block {int(src[0])}" if src.size else "must be untouched"
        return f"{label} block {blk}: {what}", None
    return describe


def verify_cache_kernel(kernel, seed: int | None = None) -> VerificationReport:
    """Run the cache kernel's case matrix with fresh random pools (the seed is recorded)."""
    seed = int(seed if seed is not None else fresh_seed())
    rng = np.random.default_rng(seed)
    report = VerificationReport(kernel.spec.name, kernel.backend, seed, dict(kernel.config))
    start = time.perf_counter()
    if kernel.spec.kind == "cache_write":
        verify_cache_write(kernel, rng, report)
    else:
        verify_copy_blocks(kernel, rng, report)
    report.seconds = time.perf_counter() - start
    return report
