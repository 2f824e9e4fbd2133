"""The decode matrix's adversarial inputs (docs/verification.md): what a subtle bug or an
adversary hides behind when every test context is short, every logit small and every pool tiny.

Values are drawn in real units by a *profile*, then stored as the cache stores them
(kgen/quantize.py: per_tensor/per_head scales fixed from the profile's range, per_token_head
scales from each row), so the large logits of a quantized cache come through its scales:

- normal: q, K, V ~ N(0, 1).
- large: per KV head a direction u (entries +-1), q = +-a*u, K = b*u + noise: every logit is
  about +-150..600 with a spread of a few units; softmax without the running max overflows
  exp (or underflows it to 0/0).
- uniform: logits within +-0.02 and V = +-1 + noise per KV head: the output is a mean over
  thousands of nearly equal terms, so fp16 accumulation of the sum or the output stalls.
- hot: background logits ~N(0, 0.5) with V = +-1 + noise, and a few "hot" keys (logit +9,
  V ~N(0, 4)) at the last position and past every power of two from 512: a kernel that stops
  early loses one; once a hot key sets the running max, each background term is ~1e-4 of the
  accumulators, so fp16 accumulators drop the background (a third of the mass) entirely.

Pools are built block by block over the blocks in use, so a 32k-token context costs what its
blocks cost. With `huge`, the used blocks sit at the top of a pool of more than 2^32 elements
(kgen/verify/judge/sparse.py: only touched pages are committed) and the region 2^32 elements below
them, where 32-bit offset arithmetic wraps to, is poisoned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kgen.families.attention import case_pools
from kgen.formats.cache import (
    CacheFormat,
    cache_shapes,
    scale_shape,
    scale_to_layout,
    to_layout,
)
from kgen.formats.dtypes import dtype
from kgen.quantize import QMAX, per_token_head_scale, quantize
from kgen.verify.judge.sparse import sparse_zeros

WRAP = 1 << 32  # elements: where 32-bit offset arithmetic wraps
CHUNK_BLOCKS = 256  # blocks generated at a time (bounds the memory of a long context)


def poison(name: str) -> float:
    return 127.0 if name == "int8" else float("nan")  # int8 has no NaN: use its extreme


# ---- the profiles ---------------------------------------------------------------------------
class Profile:
    """Real values of one case: q [S, Hq, D], and K [n, H, D], V [n, H, DV] for positions of a sequence."""

    k_range = v_range = 4.5  # |values| the per_tensor/per_head scales are sized for

    def __init__(self, spec, rng: np.random.Generator, seq_lens: list[int]):
        a = spec.attention
        self.H, self.D, self.G, self.rng = a.num_kv_heads, a.head_dim, spec.group_size, rng
        self.DV = spec.v_head_dim_value
        self.scale = float(spec.softmax_scale_value)
        self.seq_lens = seq_lens

    def q(self) -> np.ndarray:
        return self.rng.standard_normal((len(self.seq_lens), self.H * self.G, self.D))

    def kv(self, seq: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (self.rng.standard_normal((len(pos), self.H, self.D), dtype=np.float32),
                self.rng.standard_normal((len(pos), self.H, self.DV), dtype=np.float32))

    def _directions(self) -> np.ndarray:
        return self.rng.choice(np.float32([-1.0, 1.0]), size=(self.H, self.D))


class Normal(Profile):
    pass


class LargeLogits(Profile):
    SPREAD = 2.0  # logit standard deviation around the centre

    def __init__(self, spec, rng, seq_lens):
        super().__init__(spec, rng, seq_lens)
        self.u = self._directions()
        self.sign = rng.choice([-1.0, 1.0], size=self.H)
        centre = rng.uniform(150.0, 600.0, size=self.H)
        self.a = np.sqrt(centre / (self.scale * self.D))  # q = +-a*u, K = a*u + noise: q.k*scale = centre
        self.noise = self.SPREAD / (self.scale * self.a * math.sqrt(self.D))
        self.k_range = float(np.max(self.a + 4 * self.noise))

    def q(self):
        q = np.repeat(self.sign[:, None, None] * self.a[:, None, None] * self.u[:, None, :], self.G, axis=1)
        q = q.reshape(1, self.H * self.G, self.D)
        return q + 0.01 * self.rng.standard_normal((len(self.seq_lens), *q.shape[1:]))

    def kv(self, seq, pos):
        k, v = super().kv(seq, pos)
        return (self.a[None, :, None] * self.u[None] + self.noise[None, :, None] * k).astype(np.float32), v


class NearUniform(Profile):
    v_range = 2.5

    def __init__(self, spec, rng, seq_lens):
        super().__init__(spec, rng, seq_lens)
        self.v_mean = rng.choice(np.float32([-1.0, 1.0]), size=self.H)

    def q(self):
        return (0.02 / (self.scale * math.sqrt(self.D))) * super().q()  # logits ~N(0, 0.02)

    def kv(self, seq, pos):
        k, v = super().kv(seq, pos)
        return k, (self.v_mean[None, :, None] + 0.25 * v).astype(np.float32)


class HotKeys(Profile):
    HOT = 9.0  # logit of a hot key above the background

    def __init__(self, spec, rng, seq_lens):
        super().__init__(spec, rng, seq_lens)
        self.u = self._directions()
        self.a = 0.5 / (self.scale * math.sqrt(self.D))  # background logits ~N(0, 0.5)
        self.b = self.HOT / (self.scale * self.a * self.D)
        self.k_range = max(4.5, self.b + 1.5)
        self.v_range = 8.0
        self.hot = [hot_positions(n, rng) for n in seq_lens]
        self.v_mean = rng.choice(np.float32([-1.0, 1.0]), size=self.H)

    def q(self):
        q = np.repeat(self.a * self.u[:, None, :], self.G, axis=1).reshape(1, self.H * self.G, self.D)
        return q + 0.2 * self.a * self.rng.standard_normal((len(self.seq_lens), *q.shape[1:]))

    def kv(self, seq, pos):
        k, v = super().kv(seq, pos)
        hot = np.isin(pos, self.hot[seq])
        k[hot] = self.b * self.u[None] + 0.1 * k[hot]
        v[hot] = 2.0 * v[hot]
        v[~hot] = self.v_mean[None, :, None] + 0.5 * v[~hot]  # the background's share of the output is not ~0
        return k, v


def hot_positions(seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """The last position, one early position, and one past every power of two from 512."""
    pos = {seq_len - 1, int(rng.integers(0, min(seq_len, 512)))}
    p = 512
    while p < seq_len:
        pos.add(int(rng.integers(p, min(2 * p, seq_len))))
        p *= 2
    return np.asarray(sorted(pos))


PROFILES = {"normal": Normal, "large": LargeLogits, "uniform": NearUniform, "hot": HotKeys}


# ---- the pool ---------------------------------------------------------------------------------
@dataclass
class PoolCase:
    args: dict  # the call's keyword arguments (numpy), without out
    sparse: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # element ranges written, per array


def _fixed_scales(spec, profile: Profile, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """per_tensor/per_head scales sized so the profile's range fills the stored type."""
    kv, H = spec.kv_cache, spec.attention.num_kv_heads
    if CacheFormat.of(spec).block_scaled:  # nvfp4: the tensor scales (the block scales come with the rows)
        return case_pools.tensor_scales((profile.k_range, profile.v_range), rng)
    if not CacheFormat.of(spec).quantized or kv.scale not in ("per_tensor", "per_head"):
        return {}
    shape = () if kv.scale == "per_tensor" else (H,)
    return {name: np.asarray(r / QMAX[kv.dtype] * rng.uniform(0.9, 1.1, size=shape), dtype=np.float32).reshape(shape)
            for name, r in (("k_scale", profile.k_range), ("v_scale", profile.v_range))}


def _store(spec, real: np.ndarray, scale: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Stored values [n, H, D] of real rows, and their per_token_head scales [n, H] (else None)."""
    kv = spec.kv_cache
    if not CacheFormat.of(spec).quantized:
        return quantize(real, None, kv.dtype), None
    if CacheFormat.of(spec).per_token:
        s = per_token_head_scale(real, kv.dtype)
        return quantize(real, s[..., None], kv.dtype), s
    s = np.asarray(scale, dtype=np.float32)
    return quantize(real, s if s.ndim == 0 else s[None, :, None], kv.dtype), None


def _block_stride(spec) -> int:
    """Elements per block of the largest cache array (a fused pool holds K and V)."""
    return max(int(np.prod(s[1:])) for s in cache_shapes(spec, 1).values())


def huge_pool_bytes(spec) -> int:
    """The device bytes of a `huge` pool case's cache arrays (and scale pools): each holds blocks past
    2^32 elements, and every byte below them is allocated on the device too (build_pool_case)."""
    N = WRAP // _block_stride(spec) + 2
    f = CacheFormat.of(spec)
    total = sum(int(np.prod(shape)) for shape in cache_shapes(spec, N).values()) * dtype(spec.kv_cache.dtype).numpy.itemsize
    if f.quantized and f.scale_pools:  # fp32 per-token scales, or nvfp4's e4m3 block scales
        total += 2 * int(np.prod(scale_shape(spec, N))) * (1 if f.block_scaled else 4)
    return total


def build_pool_case(spec, seq_lens: list[int], rng: np.random.Generator, profile: str = "normal",
                    huge: bool = False, spare: float = 0.25) -> PoolCase:
    """A decode call's inputs for `seq_lens` with values from `profile`: shuffled tables over a
    pool with `spare` more blocks than in use (poisoned, like every tail slot and unused table
    entry); with `huge`, at the top of a pool past 2^32 elements."""
    a, kv = spec.attention, spec.kv_cache
    B, H = kv.block_size, a.num_kv_heads
    prof = PROFILES[profile](spec, rng, seq_lens)
    nblocks = [-(-n // B) for n in seq_lens]
    needed = sum(nblocks)
    region = needed + max(2, int(needed * spare))
    base = WRAP // _block_stride(spec) + 1 if huge else 0
    N = base + region
    perm = base + rng.permutation(region)
    M = max(nblocks) + 1
    tables = np.empty((len(seq_lens), M), dtype=np.int32)
    start = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[start:start + nb]
        start += nb
        tables[i, nb:] = rng.choice(perm[needed:], size=M - nb)  # never-read entries point at poisoned blocks

    cd = dtype(kv.dtype).numpy
    fp4 = CacheFormat.of(spec).block_scaled
    fill = np.asarray(case_pools.PAD_BYTE if fp4 else poison(kv.dtype)).astype(cd)
    case = PoolCase({})
    for name, shape in cache_shapes(spec, N).items():
        if not huge:
            case.args[name] = np.full(shape, fill, dtype=cd)
            continue
        pool = case.args[name] = sparse_zeros(shape, cd)
        bs = int(np.prod(shape[1:]))
        ranges = [(base * bs - WRAP, N * bs - WRAP), (base * bs, N * bs)]  # the wrap-around mirror, the region
        for lo, hi in ranges:
            pool.reshape(-1)[lo:hi] = fill
        case.sparse[name] = ranges
    scales = _fixed_scales(spec, prof, rng)
    case.args.update(scales)
    ptoken = CacheFormat.of(spec).quantized and CacheFormat.of(spec).scale_pools
    if ptoken:  # NaN scales (nvfp4: e4m3 NaN bytes) wherever no row is written
        sd, snan = (np.dtype(np.uint8), case_pools.NAN_SCALES[0]) if fp4 else (np.dtype(np.float32), np.nan)
        for name in ("k_scale", "v_scale"):
            shape = scale_shape(spec, N)
            if huge:
                pool = case.args[name] = sparse_zeros(shape, sd)
                bs = int(np.prod(shape[1:]))
                pool.reshape(-1)[base * bs:N * bs] = snan
                case.sparse[name] = [(base * bs, N * bs)]
            else:
                case.args[name] = np.full(shape, snan, dtype=sd)

    for i, n in enumerate(seq_lens):
        for j0 in range(0, nblocks[i], CHUNK_BLOCKS):
            ids = tables[i, j0:min(nblocks[i], j0 + CHUNK_BLOCKS)].astype(np.int64)
            pos = np.arange(j0 * B, min(n, (j0 + len(ids)) * B))
            k, v = prof.kv(i, pos)
            if fp4:
                real = {w: np.full((len(ids), B, H, x.shape[-1]), np.nan) for w, x in (("k", k), ("v", v))}
                real["k"].reshape(-1, H, k.shape[-1])[:len(pos)] = k
                real["v"].reshape(-1, H, v.shape[-1])[:len(pos)] = v
                for name, arr in case_pools.layout_pools(spec, real["k"], real["v"], scales, rng).items():
                    case.args[name][ids] = arr
                continue
            blocks, sblocks = {}, {}
            for which, real in (("k", k), ("v", v)):
                stored, srows = _store(spec, real, scales.get(f"{which}_scale"))
                canon = np.full((len(ids), B, H, real.shape[-1]), fill, dtype=cd)  # head_dim or v_head_dim
                canon.reshape(-1, H, real.shape[-1])[:len(pos)] = stored
                blocks[which] = canon
                if srows is not None:
                    s = np.full((len(ids), B, H), np.nan, dtype=np.float32)
                    s.reshape(-1, H)[:len(pos)] = srows
                    sblocks[f"{which}_scale"] = scale_to_layout(spec, s)
            for name, arr in to_layout(spec, blocks["k"], blocks["v"]).items():
                case.args[name][ids] = arr
            for name, arr in sblocks.items():
                case.args[name][ids] = arr
    case.args["q"] = prof.q().astype(dtype(spec.dtype.q).numpy)
    case.args["block_tables"] = tables
    case.args["seq_lens"] = np.asarray(seq_lens, dtype=np.int32)
    return case


# ---- the cases --------------------------------------------------------------------------------
# What each adversarial case draws its values from and how it calls the kernel.
ADVERSARIAL = {
    "strided_q_out": {"profile": "normal", "strided": True, "lse": True},  # q and out as strided views
    "large_logits": {"profile": "large", "lse": True},
    "long_uniform": {"profile": "uniform"},  # >= 4096 tokens
    "long_32k": {"profile": "hot", "lse": True},  # >= 32768 tokens
    "huge_pool": {"profile": "normal", "huge": True},  # blocks past 2^32 elements
}


def adversarial_cases(spec, rng: np.random.Generator) -> list[tuple[str, list[int]]]:
    """(name, seq_lens) of the adversarial cases; batch sizes and lengths drawn from `rng`."""
    B = spec.kv_cache.block_size

    def lens(values) -> list[int]:
        values = [int(v) for v in values]
        return values if spec.tail_masking else [max(B, -(-v // B) * B) for v in values]

    return [
        ("strided_q_out", lens(rng.integers(1, 700, size=int(rng.integers(2, 7))))),
        ("large_logits", lens(rng.integers(1, 400, size=int(rng.integers(2, 5))))),
        ("long_uniform", lens([4096 + rng.integers(1, 4 * B + 1)])),
        ("long_32k", lens([32768 + rng.integers(1, 4 * B + 1)])),
        ("huge_pool", lens(rng.integers(B + 1, 300, size=2))),
    ]
