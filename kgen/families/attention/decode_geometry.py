"""The geometry of kgen's decode kernel (templates/common/paged_decode.cuh, docs/decode-family.md):
how a config's threads split head_dim and the GQA group, how many tokens a pipeline stage
holds, and the shared memory that takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kgen.families.base import Config
from kgen.formats.cache import BLOCK_GROUP, CacheFormat
from kgen.formats.dtypes import dtype
from kgen.plan.arch import static_smem_limit

TILE_BYTES_PER_THREAD = 64  # K and V bytes each thread requests per tile, at least
# Pipeline depth of `stages: 0`: two tiles in flight while one is computed (the static model of
# docs/performance.md: 48 bytes in flight per thread with 2 stages, 96 with 3, on sm_90).
AUTO_STAGES = 3
BATCH_TOKENS = 8  # logits a thread holds at once (tokens x its heads)
# Elements a lane reads from shared memory and widens at once, at most: 16 bytes of fp16/bf16, 8 of
# fp8/int8 (copies stay 16 bytes). A 1-byte cache's lane then holds 8 elements of a head, and
# heads_per_thread 0 gives each thread 2 heads (when the group has them): as many query elements
# (16) as one head of 16-byte vectors, each K/V element widened once for both.
COMPUTE_VEC = 8


def vector_width(spec) -> int:
    """Elements per load: 16 bytes when head_dim and v_head_dim allow, else the widest power of two
    that divides both (K and V rows are copied with the same vectors)."""
    vec = 16 * 8 // dtype(spec.kv_cache.dtype).bits
    while spec.attention.head_dim % vec or spec.v_head_dim_value % vec:
        vec //= 2
    return vec


def vllm_v_copy(spec) -> int:
    """Bytes of one copy along the token axis of a vLLM V cache: 16, or a whole block when smaller."""
    return min(16, dtype(spec.kv_cache.dtype).bytes_for(spec.kv_cache.block_size))


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(x) - 1).bit_length()


@dataclass(frozen=True)
class DecodeGeometry:
    """How kgen's decode kernel cuts its work (templates/common/paged_decode.cuh, docs/decode-family.md)."""

    threads: int
    vec: int              # head_dim elements a lane reads from shared memory and widens at once
    lanes: int            # lanes of a row group (they split head_dim)
    chunks_per_lane: int   # of head_dim (q . K)
    v_chunks_per_lane: int  # of v_head_dim (P V and the output)
    heads_per_thread: int
    head_sets: int        # row groups needed to cover the GQA group
    token_slots: int      # row groups per head set, each on its own tokens of a tile
    tile_tokens: int      # tokens per pipeline stage
    stages: int
    k_copy: int           # bytes per cp.async of K (and of V, except the vLLM layout)
    v_copy: int           # bytes per cp.async of V
    v_row: int            # elements per shared-memory V row: v_head_dim, or a vLLM tile's ([head_dim][token])
    stage_bytes: int
    smem_bytes: int       # static shared memory: the stages, reused for the token-slot merge
    tile_bytes: int       # cache bytes of one tile (K, V, per-token scales)

    @property
    def tokens_per_thread(self) -> int:
        return self.tile_tokens // self.token_slots

    @property
    def batch_tokens(self) -> int:
        """A thread's tokens of a tile are computed in batches of this many: it holds the batch's logits
        of each of its heads, BATCH_TOKENS at most in all."""
        return min(self.tokens_per_thread, max(1, BATCH_TOKENS // self.heads_per_thread))

    @property
    def bytes_per_tile(self) -> float:
        """Cache bytes each thread requests per tile."""
        return self.tile_bytes / self.threads

    @property
    def bytes_in_flight(self) -> float:
        """Cache bytes each thread has requested ahead while it computes a tile (0 with one stage)."""
        return (self.stages - 1) * self.bytes_per_tile


def decode_geometry(spec, config: Config) -> tuple[DecodeGeometry | None, list[str]]:
    """The kernel's geometry for `config`, or None and why the config cannot be built."""
    a, kv = spec.attention, spec.kv_cache
    D, DV, G, T = a.head_dim, spec.v_head_dim_value, spec.group_size, config["threads"]
    dt = dtype(kv.dtype)
    row, vrow = dt.bytes_for(D), dt.bytes_for(DV)  # bytes of one K and one V head row
    problems = []
    stages, hpt = config["stages"], config["heads_per_thread"]
    if not 0 <= stages <= 4:
        problems.append(f"stages must be 0 (auto) or 1 to 4 (got {stages})")
    if not 0 <= hpt <= G:
        problems.append(f"heads_per_thread must be 0 (auto) or 1 to the GQA group {G} (got {hpt})")
    if problems:
        return None, problems
    load = vector_width(spec)  # elements per copy (16 bytes where head_dim allows)
    vec = min(load, COMPUTE_VEC)
    chunks, v_chunks = D // vec, DV // vec
    lanes = min(32, _pow2_ceil(max(chunks, v_chunks)))  # a row group's lanes split the wider of K and V
    groups = T // lanes
    hpt = hpt or max(-(-G // groups), min(G, load // vec))
    head_sets = -(-G // hpt)
    if head_sets > groups:
        return None, [f"threads {T} make {groups} row groups of {lanes} lanes, fewer than the {head_sets} that "
                      f"heads_per_thread {hpt} needs for {G} query heads: use more threads or more heads per thread"]
    slots = 1 << ((groups // head_sets).bit_length() - 1)
    vllm = CacheFormat.of(spec).vllm
    target = -(-TILE_BYTES_PER_THREAD * T // (row + vrow))  # tokens per tile for the bytes per thread
    tpt = _pow2_ceil(-(-target // slots))
    v_copy = vllm_v_copy(spec) if vllm else dt.bytes_for(load)
    while dt.bytes_for(slots * tpt) < v_copy:
        tpt *= 2
    tile = slots * tpt
    v_row = DV
    if vllm:
        es = dt.itemsize  # the vLLM layout holds whole-byte types only
        row_bytes = tile * es
        v_row = tile + (16 // es if row_bytes >= 16 and row_bytes // 16 % 2 == 0 else 0)  # odd 16-byte rows

    def a16(x: int) -> int:
        return -(-x // 16) * 16

    scales = CacheFormat.of(spec).per_token
    # per token: K and V's fp32 scales, or nvfp4's e4m3 block scales (a byte per 16 elements of each row)
    scale_bytes = 2 * 4 if scales else (D + DV) // BLOCK_GROUP if CacheFormat.of(spec).block_scaled else 0
    stage = a16(tile * row) + a16(dt.bytes_for(DV * v_row) if vllm else tile * vrow) + a16(tile * scale_bytes)
    merge_bytes = slots * G * (DV + 2) * 4
    limit = static_smem_limit(spec.targets)  # the kernel's shared memory is static: 48 KiB on every arch
    if not stages:  # auto: the deepest pipeline up to AUTO_STAGES that fits
        stages = next((n for n in range(AUTO_STAGES, 1, -1) if max(n * stage, merge_bytes) <= limit), 1)
    smem = max(stages * stage, merge_bytes)
    if smem > limit:
        return None, [f"stages {stages} of {tile} tokens need {smem} bytes of shared memory, more than "
                      f"{limit}: use fewer stages or fewer threads"]
    geometry = DecodeGeometry(
        threads=T, vec=vec, lanes=lanes, chunks_per_lane=-(-chunks // lanes),
        v_chunks_per_lane=-(-v_chunks // lanes), heads_per_thread=hpt,
        head_sets=head_sets, token_slots=slots, tile_tokens=tile, stages=stages,
        k_copy=16 if vllm else dt.bytes_for(load), v_copy=v_copy, v_row=v_row, stage_bytes=stage, smem_bytes=smem,
        tile_bytes=tile * (row + vrow + scale_bytes))
    return geometry, []
