"""Engines' conventions in kgen's terms (docs/interop.md): FlashInfer's page table to and from
kgen's block tables, and FlashInfer's base-2 log-sum-exp to and from kgen's natural-log one.

Every function takes numpy arrays or torch tensors and answers in the same library, on the
same device. The values are checked (ArgumentError) on the host; on a GPU only in debug mode
(KGEN_DEBUG), since reading them there is a device-to-host copy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kgen.arrays import INT32_MAX, checks_values
from kgen.errors import ArgumentError
from kgen.optional import is_torch_tensor

LOG2E = 1.0 / math.log(2.0)  # log2(x) = ln(x) * LOG2E
LN2 = math.log(2.0)


# ---- log-sum-exp ------------------------------------------------------------------------------
def lse_to_base2(lse):
    """kgen's natural-log LSE as FlashInfer's base-2 one (-inf stays -inf), same dtype."""
    return lse * LOG2E


def lse_from_base2(lse2):
    """FlashInfer's base-2 LSE as kgen's natural-log one (-inf stays -inf), same dtype."""
    return lse2 * LN2


# ---- page tables ------------------------------------------------------------------------------
def from_flashinfer(indptr, indices, last_page_len, block_size: int, max_blocks_per_seq: int | None = None):
    """(block_tables [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32) from FlashInfer's
    paged-KV table: request i owns pages indices[indptr[i]:indptr[i+1]], the last one holding
    last_page_len[i] tokens (1..block_size; 0 for a request with no pages). Columns past a sequence's
    pages are 0 (kgen never reads them). `max_blocks_per_seq`: the table's width (default: the most
    pages of any request, which on a GPU costs one device-to-host read)."""
    xp = _Lib(indptr)
    indptr, indices, last = (xp.int64(a) for a in (indptr, indices, last_page_len))
    pages = indptr[1:] - indptr[:-1]
    if checks_values(xp.device):
        _check_flashinfer(xp, indptr, indices, last, pages, block_size, max_blocks_per_seq)
    width = int(pages.max()) if max_blocks_per_seq is None and len(pages) else int(max_blocks_per_seq or 0)
    cols = xp.arange(width)
    used = cols[None, :] < pages[:, None]
    if len(indices):
        at = xp.clip(indptr[:-1, None] + cols[None, :], 0, len(indices) - 1)
        tables = xp.where(used, indices[at], 0)
    else:
        tables = xp.zeros((len(pages), width))
    seq_lens = xp.where(pages > 0, (pages - 1) * block_size + last, 0)
    return xp.int32(tables), xp.int32(seq_lens)


def to_flashinfer(block_tables, seq_lens, block_size: int):
    """(indptr [num_seqs + 1], indices [total pages], last_page_len [num_seqs]), int32, FlashInfer's
    paged-KV table of kgen's block tables: sequence i's first ceil(seq_lens[i] / block_size) blocks;
    a full last page has last_page_len block_size, an empty sequence no pages and last_page_len 0.
    (indices has one entry per used block, so on a GPU its length is read back to the host.)"""
    xp = _Lib(block_tables)
    tables, lens = xp.int64(block_tables), xp.int64(seq_lens)
    if checks_values(xp.device):
        if len(lens) != tables.shape[0]:
            raise ArgumentError(f"seq_lens: {len(lens)} sequences, block_tables {tables.shape[0]} rows")
        bad = (lens < 0) | (lens > tables.shape[1] * block_size)
        if bool(bad.any()):
            i = int(xp.first(bad))
            raise ArgumentError(f"seq_lens[{i}] = {int(lens[i])}: must be in 0..{tables.shape[1] * block_size} "
                                f"(block_tables has {tables.shape[1]} columns of block_size {block_size})")
    pages = (lens + block_size - 1) // block_size
    indptr = xp.concat([xp.zeros((1,)), xp.cumsum(pages)])
    used = xp.arange(tables.shape[1])[None, :] < pages[:, None]
    last = xp.where(pages > 0, lens - (pages - 1) * block_size, 0)
    return xp.int32(indptr), xp.int32(tables[used]), xp.int32(last)


def _check_flashinfer(xp, indptr, indices, last, pages, block_size: int, max_blocks: int | None) -> None:
    n = len(pages)
    if len(last) != n:
        raise ArgumentError(f"last_page_len: {len(last)} entries, but indptr describes {n} requests")
    if n and (int(indptr[0]) < 0 or int(indptr[-1]) > len(indices)):
        raise ArgumentError(f"indptr: [{int(indptr[0])}, {int(indptr[-1])}] is not inside indices "
                            f"(length {len(indices)})")
    for bad, what in (
        (pages < 0, lambda i: f"indptr[{i + 1}] = {int(indptr[i + 1])} < indptr[{i}] = {int(indptr[i])}: indptr must "
                              "be non-decreasing"),
        ((pages > 0) & ((last < 1) | (last > block_size)),
         lambda i: f"last_page_len[{i}] = {int(last[i])}: must be in 1..{block_size} (page_size) for a request "
                   "with pages"),
        ((pages == 0) & (last != 0),
         lambda i: f"last_page_len[{i}] = {int(last[i])}: request {i} has no pages, so it must be 0"),
        (pages > (max_blocks if max_blocks is not None else INT32_MAX),
         lambda i: f"request {i} has {int(pages[i])} pages, more than max_blocks_per_seq = {max_blocks}"),
    ):
        if bool(bad.any()):
            raise ArgumentError(what(int(xp.first(bad))))
    bad = (indices < 0) | (indices > INT32_MAX)
    if bool(bad.any()):
        i = int(xp.first(bad))
        raise ArgumentError(f"indices[{i}] = {int(indices[i])}: not a page id (0..{INT32_MAX}, int32)")


class _Lib:
    """The few array operations numpy and torch spell differently, for arrays like `ref`."""

    def __init__(self, ref: Any):
        self.torch = None
        self.device = "cpu"
        if is_torch_tensor(ref):
            import torch  # the caller passed tensors: torch is loaded already

            self.torch, self.device, self._device = torch, ref.device.type, ref.device

    def int64(self, a):
        if self.torch is not None:
            return self.torch.as_tensor(a, device=self._device).to(self.torch.int64)
        return np.asarray(a).astype(np.int64)

    def int32(self, a):
        return a.to(self.torch.int32) if self.torch is not None else a.astype(np.int32)

    def arange(self, n: int):
        return self.torch.arange(n, device=self._device) if self.torch is not None else np.arange(n, dtype=np.int64)

    def zeros(self, shape: tuple[int, ...]):
        if self.torch is not None:
            return self.torch.zeros(shape, dtype=self.torch.int64, device=self._device)
        return np.zeros(shape, dtype=np.int64)

    def where(self, cond, a, b):
        if self.torch is not None:
            return self.torch.where(cond, a, self.torch.as_tensor(b, dtype=self.torch.int64, device=self._device))
        return np.where(cond, a, b)

    def clip(self, a, lo: int, hi: int):
        return self.torch.clamp(a, lo, hi) if self.torch is not None else np.clip(a, lo, hi)

    def cumsum(self, a):
        return self.torch.cumsum(a, 0) if self.torch is not None else np.cumsum(a)

    def concat(self, parts):
        return self.torch.cat(parts) if self.torch is not None else np.concatenate(parts)

    def first(self, mask) -> int:
        """The index of the first True of a 1-d mask."""
        return int(self.torch.nonzero(mask)[0, 0]) if self.torch is not None else int(np.flatnonzero(mask)[0])
