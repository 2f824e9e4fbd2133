"""Token-level sparse attention over the mla layout (attention.sparse_topk, docs/abi.md section 8):
each query row attends only to the N cache slots its `indices` row names. What the sparse kernels
take in place of the block table (the `indices` argument), how a call's indices are checked, and
the ABI notes; the kernels are the mla body's (templates/common/paged_mla.cuh; LatentRows::row in
templates/common/attention/latent_rows.cuh picks the rows)."""

from __future__ import annotations

import numpy as np

from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, array
from kgen.families.binding import host_values


def topk(spec) -> int:
    """N of attention.sparse_topk, 0 for a dense spec."""
    return spec.attention.sparse_topk or 0


def indices_arg(spec, rows: str) -> Arg:
    B = spec.kv_cache.block_size
    return array("indices", "int32", "input", (rows, topk(spec)),
                 f"the cache slots each row attends: block_id * {B} + offset, or -1 for an unused entry; any order, "
                 "a repeated slot counts once per occurrence")


def bind_indices(b, rows: int, num_blocks: int, checked: bool):
    """`indices` [rows, N] int32, C-contiguous; with `checked`, every entry -1 or a slot of the pool."""
    N, B = topk(b.spec), b.spec.kv_cache.block_size
    ind = b.take("indices", True)
    if len(ind.shape) != 2 or ind.shape[1] != N or ind.shape[0] != rows:
        raise ArgumentError(f"indices: expected shape [{rows}, {N}] (one row per query row, attention.sparse_topk "
                            f"{N} entries each), got {list(ind.shape)}")
    b.check(ind, (rows, N), "int32", contiguous=True)
    if checked and rows:
        values = host_values(ind)
        bad = np.argwhere((values < -1) | (values >= num_blocks * B))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise ArgumentError(f"indices[{i}, {j}] = {int(values[i, j])}: not a cache slot (allowed: -1 for an unused "
                                f"entry, or block_id * {B} + offset in 0..{num_blocks * B - 1} for the pool's "
                                f"{num_blocks} blocks of {B})")
    return ind


def refuse_block_tables(b) -> None:
    if b.take("block_tables", False) is not None:
        raise ArgumentError("block_tables: a sparse kernel (attention.sparse_topk) reads no block table: its "
                            "`indices` name physical slots block_id * block_size + offset")


def sparse_notes(spec, kind_rows: str) -> list[str]:
    """The rules a sparse kernel keeps (`kind_rows`: what one indices row belongs to)."""
    N, B = topk(spec), spec.kv_cache.block_size
    return [
        f"Sparse (attention.sparse_topk {N}): {kind_rows} attends only to the {N} slots of its indices row, each a "
        f"physical slot block_id * {B} + offset of kv_cache (no block table is read), or -1 for an unused entry; "
        "entries come in any order and a repeated slot is attended once per occurrence. No causal mask or "
        "window applies. A row with no valid entry writes out 0 and lse -inf. Entries outside "
        f"[-1, num_blocks * {B}) are refused at the call (checked calls); slots no row names are never read.",
    ]
