"""The tensor-core decode body (templates/common/paged_decode_mma.cuh, docs/decode-family.md
"Tensor cores for grouped query heads"): when it is taken, and how it cuts its work.

The GQA group's query heads are the 16 rows of mma.sync m16n8k16 (rows past the group are zero
queries, dropped at the end); each warp takes WARP_TOKENS (16) tokens of a tile, so a tile is
16 * warps tokens, K and V rows landing in shared memory as stored (row stride padded so that
ldmatrix's eight rows fall in different banks)."""

from __future__ import annotations

from dataclasses import dataclass

from kgen.families.base import Config
from kgen.formats.cache import BLOCK_GROUP, CacheFormat
from kgen.formats.dtypes import dtype
from kgen.plan.arch import static_smem_limit

WARP_TOKENS = 16  # tokens of a tile per warp: one k16 step of P V
MMA_ROWS = 16     # query heads per MMA row tile
AUTO_STAGES = 3
EIGHT_BIT = ("fp8_e4m3", "fp8_e5m2", "int8")


def mma_unsupported(spec) -> str | None:
    """Why the tensor-core body cannot serve this spec (None: it can)."""
    a, kv = spec.attention, spec.kv_cache
    q = spec.dtype.q
    if q not in ("fp16", "bf16"):
        return f"q is {q}: the MMA operands are fp16 or bf16"
    if kv.dtype != q and kv.dtype not in EIGHT_BIT and not CacheFormat.of(spec).block_scaled:
        return f"a {kv.dtype} cache with {q} q (the tensor-core body takes a cache in q's dtype, fp8 or int8)"
    if CacheFormat.of(spec).vllm:
        return "the vLLM layout (its V is head_dim-major)"
    for name, dim in (("head_dim", a.head_dim), ("v_head_dim", spec.v_head_dim_value)):
        if dim % 16 or dim > 256:
            return f"{name} {dim} (the tensor-core body needs a multiple of 16 up to 256)"
    if spec.group_size > MMA_ROWS:
        return f"GQA group {spec.group_size} (more than the {MMA_ROWS} rows of one MMA tile)"
    old = [t for t in spec.targets if int(t.removeprefix("sm_")) < 80]
    if old:
        return f"target {old[0]} (mma.sync m16n8k16 and cp.async need sm_80)"
    return None


AUTO = -1  # mma_min_group's default: AUTO_MIN_GROUP by the cache's element width
# From the static model's issue term (docs/performance.md, benchmarks/static_perf.py): a 16-bit cache's
# CUDA-core loop stays under the issue limit up to GQA 4 and keeps more bytes in flight than the
# tensor-core launch (fewer threads, more registers), so tensor cores from 8 heads; an 8-bit cache's
# CUDA-core loop converts twice the elements per byte and is issue-bound already at GQA 4.
AUTO_MIN_GROUP = {2: 8, 1: 4}
# nvfp4: two elements a byte, so a CUDA-core loop does twice the 8-bit one's multiply-adds per byte (and
# unpacks nibbles besides): issue-bound from GQA 2 on, by the same static model.
AUTO_MIN_GROUP_PACKED = 2


def min_group(spec, config: Config) -> int:
    """mma_min_group with auto (-1) resolved for this spec's cache."""
    n = config.get("mma_min_group", 0)
    if n != AUTO:
        return n
    dt = dtype(spec.kv_cache.dtype)
    return AUTO_MIN_GROUP_PACKED if dt.packed else AUTO_MIN_GROUP.get(dt.itemsize, 0)


def uses_tensor_cores(spec, config: Config) -> bool:
    """Whether `config` renders the tensor-core body: group >= mma_min_group (0: never; -1: auto, see
    AUTO_MIN_GROUP) and supported."""
    n = min_group(spec, config)
    return n > 0 and spec.group_size >= n and mma_unsupported(spec) is None


def body_note(spec, config: Config) -> str:
    """One line naming the body a config renders, and why."""
    n = min_group(spec, config)
    auto = " (auto)" if config.get("mma_min_group", 0) == AUTO else ""
    why = mma_unsupported(spec)
    if uses_tensor_cores(spec, config):
        return (f"Body: tensor cores (mma.sync m16n8k16, fp32 accumulate; the group's {spec.group_size} query heads "
                f"are the MMA rows), since group {spec.group_size} >= mma_min_group {n}{auto}.")
    if config.get("mma_min_group", 0) == 0:
        return "Body: CUDA cores (mma_min_group 0: the tensor-core body is off)."
    if why is not None:
        return f"Body: CUDA cores; the tensor-core body does not support {why}."
    if n <= 0:
        return f"Body: CUDA cores (mma_min_group {n}{auto}: the tensor-core body is off)."
    return f"Body: CUDA cores (group {spec.group_size} < mma_min_group {n}{auto})."


@dataclass(frozen=True)
class MmaGeometry:
    warps: int
    tile_tokens: int   # tokens per pipeline stage (WARP_TOKENS per warp)
    stages: int
    row_bytes: int     # bytes per shared-memory K row (padded)
    v_row_bytes: int   # bytes per shared-memory V row (padded)
    stage_bytes: int
    merge_bytes: int
    red_bytes: int     # the per-warp maxima of the V scales (fp16 q, per-token scales)
    smem_bytes: int

    @property
    def threads(self) -> int:
        return 32 * self.warps


def _padded_row(nbytes: int) -> int:
    """Bytes of a shared-memory row holding `nbytes`: an odd number of 16-byte units (ldmatrix's
    eight rows in different banks)."""
    return nbytes + (16 if (nbytes // 16) % 2 == 0 else 0)


def _sizes(spec, warps: int) -> tuple[int, int, int, int, int]:
    a, kv = spec.attention, spec.kv_cache
    DV, G = spec.v_head_dim_value, spec.group_size
    nbytes = dtype(kv.dtype).bytes_for
    row, v_row = _padded_row(nbytes(a.head_dim)), _padded_row(nbytes(DV))
    tile = WARP_TOKENS * warps
    token_scales = CacheFormat.of(spec).per_token
    # nvfp4's e4m3 block scales: a byte per 16 elements of each K and V row
    block_scales = tile * ((a.head_dim + DV) // BLOCK_GROUP) if CacheFormat.of(spec).block_scaled else 0
    stage = tile * (row + v_row) + (8 * tile if token_scales else 0) + block_scales
    merge = G * DV * 4 + warps * G * 8
    red = 128 if token_scales and spec.dtype.q == "fp16" else 0
    return row, v_row, stage, merge, red


def mma_geometry(spec, config: Config) -> tuple[MmaGeometry | None, list[str]]:
    """The tensor-core body's geometry: the most warps (up to threads / 32) whose tiles fit at
    least two stages (or the configured stages) in static shared memory; auto stages: the
    deepest up to AUTO_STAGES that fits."""
    limit = static_smem_limit(spec.targets)
    want = config["stages"]
    if not 0 <= want <= 4:
        return None, [f"stages must be 0 (auto) or 1 to 4 (got {want})"]
    for warps in range(max(1, config["threads"] // 32), 0, -1):
        row, v_row, stage, merge, red = _sizes(spec, warps)

        def need(n: int, stage: int = stage, merge: int = merge, red: int = red) -> int:
            return max(n * stage, merge) + red

        if want:
            if need(want) <= limit:
                stages = want
                break
        else:
            fits = [n for n in range(AUTO_STAGES, 0, -1) if need(n) <= limit]
            if fits and (fits[0] >= 2 or warps == 1):
                stages = fits[0]
                break
    else:
        return None, [f"stages {want or 1} of {WARP_TOKENS} tokens need {need(want or 1)} bytes of shared memory, "
                      f"more than {limit}: use fewer stages"]
    return MmaGeometry(warps=warps, tile_tokens=WARP_TOKENS * warps, stages=stages, row_bytes=row,
                       v_row_bytes=v_row, stage_bytes=stage, merge_bytes=merge, red_bytes=red, smem_bytes=need(stages)), []
