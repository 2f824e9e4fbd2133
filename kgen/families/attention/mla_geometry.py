"""The launch geometry of the mla attention body (templates/common/paged_mla.cuh, docs/mla.md):
how many 16-row tiles of (query token, head) rows a block takes, how many warps split each tile's
V_DIM output columns, how many keys a pipeline stage holds, and the padded shared-memory rows, all
checked against the shared memory of every target arch (kgen/plan/arch.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kgen.families.base import Config
from kgen.formats import ds_mla
from kgen.formats.cache import CacheFormat
from kgen.formats.dtypes import dtype
from kgen.plan.arch import smem_limit

# Output columns one warp accumulates (16 rows x 256 columns = 128 fp32 registers a lane); 512 spill on sm_90.
MAX_WARP_COLUMNS = 256


@dataclass(frozen=True)
class MlaGeometry:
    row_tiles: int  # 16-row tiles a block attends
    col_warps: int  # warps per row tile (each its V_DIM / col_warps output columns and 16 keys of a tile)
    stages: int
    head_dim: int
    kv_bytes: int = 2  # 1: an fp8 cache, staged as stored and converted into a 16-bit tile
    token_scales: bool = False  # per-token kv_scale, staged with each tile
    stored_row: int = 0  # bytes a row is stored as when not head_dim elements (fp8_ds_mla: 656)

    @property
    def threads(self) -> int:
        return 32 * self.row_tiles * self.col_warps

    @property
    def tile_tokens(self) -> int:
        return 16 * self.col_warps

    @property
    def row_bytes(self) -> int:
        return odd_units(2 * self.head_dim)

    @property
    def raw_row_bytes(self) -> int:
        """A staged fp8 row (0: a 16-bit cache lands in the operand tile itself)."""
        return odd_units(self.stored_row or self.head_dim) if self.kv_bytes == 1 else 0

    @property
    def p_row_bytes(self) -> int:
        return odd_units(2 * self.tile_tokens)

    @property
    def smem_bytes(self) -> int:
        q = 16 * self.row_tiles * self.row_bytes
        rows = self.tile_tokens * (self.raw_row_bytes or self.row_bytes)
        tiles = self.stages * (rows + (4 * self.tile_tokens if self.token_scales else 0))
        tiles += self.tile_tokens * self.row_bytes if self.kv_bytes == 1 else 0  # the converted tile
        p = 16 * self.row_tiles * self.p_row_bytes
        red = 2 * self.row_tiles * self.col_warps * 16 * 4
        return q + tiles + p + red

    @property
    def rows(self) -> int:
        return 16 * self.row_tiles


def odd_units(nbytes: int) -> int:
    """`nbytes` rounded up to an odd number of 16-byte units: the eight rows an ldmatrix reads then
    start in eight different bank groups."""
    units = -(-nbytes // 16)
    return 16 * (units if units % 2 else units + 1)


def mla_geometry(spec, config: Config) -> tuple[MlaGeometry | None, list[str]]:
    """The geometry of `config` for `spec`, or None and why it cannot be built."""
    R, C, stages = config["row_tiles"], config["col_warps"], config["stages"]
    dv = spec.v_head_dim_value
    problems = []
    if R not in (1, 2, 4):
        problems.append(f"row_tiles must be 1, 2 or 4 (16 query rows each; got {R})")
    if C not in (1, 2, 4, 8):
        problems.append(f"col_warps must be 1, 2, 4 or 8 (got {C})")
    elif dv % (16 * C):
        problems.append(f"col_warps {C}: v_head_dim {dv} must split into whole 16-column groups per warp "
                        f"(a multiple of {16 * C})")
    elif dv // C > MAX_WARP_COLUMNS:
        problems.append(f"col_warps {C}: a warp would hold 16 x {dv // C} fp32 output accumulators; at most "
                        f"{MAX_WARP_COLUMNS} columns a warp fit in registers (col_warps >= {-(-dv // MAX_WARP_COLUMNS)})")
    if not 1 <= stages <= 4:
        problems.append(f"stages must be 1..4 (got {stages})")
    if problems:
        return None, problems
    f = CacheFormat.of(spec)
    geo = MlaGeometry(R, C, stages, spec.attention.head_dim, dtype(spec.kv_cache.dtype).itemsize, f.per_token,
                      ds_mla.ROW_BYTES if f.ds_mla else 0)
    limit = smem_limit(spec.targets)
    if geo.smem_bytes > limit:
        return None, [f"row_tiles {R}, col_warps {C}, stages {stages}: {geo.smem_bytes} bytes of shared memory > "
                      f"{limit}, the smallest opt-in limit of the targets {', '.join(spec.targets or ['sm_80'])} "
                      "(fewer stages, row tiles or column warps)"]
    return geo, []
