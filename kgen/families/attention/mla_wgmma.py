"""The Hopper (wgmma) body of mla decode and sparse mla prefill (templates/common/paged_mla_wgmma.cuh,
docs/mla.md): when an arch's render takes it, why not otherwise, and its launch geometry: 64 query
heads a block (decode: of a sequence; sparse prefill: of a query token) in two
warpgroups of 128 threads, key tiles of 64 in a ring of two stages (at head_dim 576, 231,424 bytes
of shared memory: the largest mla row the spec allows fits sm_90's 232,448)."""

from __future__ import annotations

from dataclasses import dataclass

from kgen.families.base import Config
from kgen.formats.cache import CacheFormat
from kgen.formats.ds_mla import ROW_BYTES as DS_ROW_BYTES
from kgen.plan.arch import smem_limit

PATHS = ("auto", "mma", "wgmma")  # the `path` parameter's values (its index): auto = wgmma where it builds
ROWS = 64  # query heads a block: wgmma's M
THREADS = 256  # two warpgroups: each half of a tile's keys for S, half of V's columns for O
KV_TILE = 64  # keys a stage
STAGES = 2  # one tile in flight while one is computed; more does not fit at head_dim 576


DS_KV_TILE = 32  # fp8_ds_mla: stored stages plus the dequantized tile; 64-key tiles do not fit


@dataclass(frozen=True)
class MlaWgmmaGeometry:
    head_dim: int
    kv_tile: int
    stages: int
    stored_row: int = 0  # fp8_ds_mla: the bytes of a row as stored and staged (656); 0: the 16-bit row itself

    rows = ROWS
    threads = THREADS

    @property
    def tile_tokens(self) -> int:  # the mma.sync geometry's name for the keys a stage
        return self.kv_tile

    @property
    def smem_bytes(self) -> int:
        """MlaWgmmaShape's: 1024 bytes of alignment slack, Q [64 x head_dim], `stages` tiles
        [kv_tile x head_dim] (fp8_ds_mla: `stages` tiles of stored rows, then the dequantized tile),
        P [64 x 64], the row maxima and sums of both warpgroups (fp32)."""
        operand = 2 * self.kv_tile * self.head_dim
        stage = self.kv_tile * self.stored_row if self.stored_row else operand
        return (1024 + 2 * ROWS * self.head_dim + self.stages * stage + (operand if self.stored_row else 0)
                + ROWS * 128 + 4 * ROWS * 4)


def _geometry(spec) -> MlaWgmmaGeometry:
    if CacheFormat.of(spec).ds_mla:
        return MlaWgmmaGeometry(spec.attention.head_dim, DS_KV_TILE, STAGES, DS_ROW_BYTES)
    return MlaWgmmaGeometry(spec.attention.head_dim, KV_TILE, STAGES)


def wgmma_geometry(spec) -> MlaWgmmaGeometry | None:
    """The Hopper body's geometry for `spec`, or None where it does not fit the targets' shared memory."""
    geo = _geometry(spec)
    return geo if geo.smem_bytes <= smem_limit(spec.targets) else None


def wgmma_refusal(spec) -> str | None:
    """Why the Hopper body cannot build `spec` (None: it can). A spec renders once per target arch
    (kgen/bodies.py), so `spec.targets` is the one arch being rendered: it must be sm_90 (wgmma is an
    sm_90a instruction)."""
    for target in spec.targets:
        if target != "sm_90":
            return ("no wgmma before sm_90" if int(target.removeprefix("sm_")) < 90 else
                    f"{target} has no wgmma (an sm_90a instruction)")
    if spec.kind == "paged_prefill" and not spec.attention.sparse_topk:
        return "dense mla prefill has no Hopper body (only a sparse one: attention.sparse_topk)"
    kv, q = spec.kv_cache, spec.dtype.q
    if q not in ("fp16", "bf16"):
        return f"wgmma takes fp16 or bf16 operands (q is {q})"
    if kv.dtype == "fp8_ds_mla" and not spec.attention.sparse_topk:
        return "a dense spec over the fp8_ds_mla cache takes the mma.sync body (the Hopper body reads it for sparse specs)"
    if kv.dtype != q and kv.dtype != "fp8_ds_mla" or kv.scale not in (None, "none"):
        return (f"it reads a cache in q's type ({q}) without scales (this one is {kv.dtype}, scale {kv.scale}); "
                "fp8 caches take the mma.sync body")
    D, Dv = spec.attention.head_dim, spec.v_head_dim_value
    if D % 64 or Dv % 128 or Dv > 512 or Dv > D:
        return (f"head_dim must be a multiple of 64 and v_head_dim a multiple of 128 up to 512 and head_dim "
                f"(two warpgroups of wgmma n <= 256 in 64-column blocks; got {D} and {Dv})")
    if wgmma_geometry(spec) is None:
        geo = _geometry(spec)
        return (f"head_dim {D}: {STAGES} stages of {KV_TILE}-key tiles need {geo.smem_bytes} bytes of shared memory, "
                f"more than {smem_limit(spec.targets)}")
    return None


def path_of(spec, config: Config) -> str:
    """The body a config builds: "wgmma" (paged_mla_wgmma.cuh) or "mma" (paged_mla.cuh). `path` 0
    (auto) takes wgmma where wgmma_refusal finds nothing."""
    chosen = PATHS[config.get("path", 0)] if config.get("path", 0) in range(len(PATHS)) else "mma"
    if chosen == "auto":
        return "mma" if wgmma_refusal(spec) else "wgmma"
    return chosen


def path_problems(spec, config: Config) -> list[str]:
    """What is wrong with the config's `path` for the arch being rendered."""
    p = config.get("path", 0)
    if p not in range(len(PATHS)):
        return [f"path must be 0 (auto), 1 (mma) or 2 (wgmma) (got {p})"]
    refusal = wgmma_refusal(spec) if p == 2 else None
    if refusal:
        return [f"path 2 (wgmma) cannot build for {', '.join(spec.targets)}: {refusal} (accepted there: path 0, "
                "auto, or 1, mma.sync)"]
    return []
