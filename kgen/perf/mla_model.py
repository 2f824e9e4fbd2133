"""A static estimate of MLA decode (kgen/families/attention/mla.py, docs/mla.md) on one GPU, no GPU
needed: ESTIMATES, from the launch geometry, ptxas's registers and the split-KV plan kgen's calls
make, through kgen/perf/model.py's wave model (Little's law on the bytes in flight, copy bandwidth,
tensor-core FLOP; its Device figures and assumptions, docs/performance.md).

What the model takes from the kernel (the body the arch gets: kgen/families/attention/mla.py's
decode_geometry): a block of `rows` query heads (16 * row_tiles; 64 for the Hopper body) streams
every latent row of its sequence (or partition) once, 576 elements, through `stages` tiles of
`tile_tokens` rows (`stages - 1` of them in flight while one is computed; one stage overlaps nothing); the row
blocks of a sequence read the same rows (L2 serves the repeats: `dedupe`); each latent row costs
2 x rows x (head_dim + v_head_dim) tensor FLOP per block (padding rows included); a split adds the
merge launch and the partials written and read back. A sparse spec (attention.sparse_topk N) iterates
its N entries whatever the context: min(context, N) of them name rows (read), the rest are -1
(zero-filled, no bytes, but their tiles' tensor FLOP still run); the indices' own 4 bytes an entry are
not counted. The SASS-level terms (instruction issue,
shared-memory wavefronts) are not counted: the fractions are upper bounds where those bind."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kgen.families.attention.mla import decode_geometry, row_blocks
from kgen.families.pool import pool_of
from kgen.families.registry import family_for
from kgen.perf import model as pm
from kgen.plan import target_blocks

BATCHES = (1, 16, 64, 128)
CONTEXTS = (1024, 4096, 32768)


@dataclass(frozen=True)
class MlaEstimate:
    batch: int
    context: int
    estimate: pm.Estimate  # seconds, fraction of the copy bandwidth, the binding term
    tensor_fraction: float  # useful tensor FLOP (real heads only) / (seconds x the device's tensor peak)
    partitions: int


def decode_estimate(spec, config: dict, registers: int, batch: int, context: int,
                    dev: pm.Device = pm.H200) -> MlaEstimate:
    """One decode call of `batch` sequences of `context` tokens with kgen's plan for those lengths."""
    a = spec.attention
    geo = decode_geometry(spec, config)  # the Hopper body's or the mma.sync body's
    row = pool_of(spec).bytes_per_token()  # a latent row as stored (fp8_ds_mla: 656 bytes) and a per-token scale
    occ = pm.occupancy(geo.threads, registers, geo.smem_bytes, dev)
    blocks_per_sm = max(1, occ.blocks)
    lens = np.full(batch, context)
    N = a.sparse_topk or 0
    keys = min(context, N) if N else context  # the rows each sequence's blocks read
    loop = N or context  # the entries (keys) its tiles compute over
    sizes, kernels = family_for(spec).schedule(spec, config, {"seq_lens": lens},
                                         target_blocks(dev.sms, blocks_per_sm * dev.sms))
    parts = sizes["max_partitions"]
    rb = row_blocks(spec, config)
    blocks = rb * batch * parts
    kv_bytes = float(batch * keys * row)
    in_flight = max(1, geo.stages - 1) * geo.tile_tokens * row / geo.threads
    work = pm.Work(flop_per_byte=2.0 * geo.rows * (a.head_dim + spec.v_head_dim_value) / row * loop / keys)
    partials = batch * a.num_q_heads * parts * (spec.v_head_dim_value + 2) * 4 * 2 if parts > 1 else 0
    est = pm.estimate_seconds(kv_bytes, blocks, geo.threads, in_flight, blocks_per_sm,
                              extra_launches=len(kernels) - 1, partial_bytes=partials, dedupe=rb, dev=dev, work=work)
    useful = 2.0 * batch * keys * a.num_q_heads * (a.head_dim + spec.v_head_dim_value)
    peak = dev.sms * dev.clock_hz * dev.tensor_flop_per_sm_clock
    return MlaEstimate(batch, context, est, useful / est.seconds / peak, parts)


def decode_table(spec, config: dict, registers: int, dev: pm.Device = pm.H200) -> list[MlaEstimate]:
    return [decode_estimate(spec, config, registers, b, c, dev) for b in BATCHES for c in CONTEXTS]
