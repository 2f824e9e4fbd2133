"""FlashInfer's MLA tensors as kgen's MLA call (docs/interop.md §6): FlashInfer and FlashInfer-Bench
(`mla_paged`) keep the absorbed query as `q_nope` [rows, H, Dc] and `q_pe` [rows, H, Dp] and the cache as
`ckv_cache` [num_pages, page_size, Dc] and `kpe_cache` [num_pages, page_size, Dp], paged by
`kv_indptr`/`kv_indices` (and `kv_last_page_len`); kgen's MLA kernels read one latent row per token,
`kv_cache` [num_blocks, block_size, Dc + Dp] (latent first, then rope), `q` [rows, H, Dc + Dp],
and a block table (docs/abi.md "MLA").

q is joined (a copy: rows x H x (Dc + Dp) elements). The cache is not copied when ckv_cache and
kpe_cache are two views of one buffer, each token's rope values right after its latent ones (SGLang's
MLA pool, `buf[..., :Dc]` and `buf[..., Dc:]`): kgen reads that buffer through a strided view. Otherwise
only the pages the call names are joined, one per kv_indices entry, and the table is renumbered: the
copy is as large as what the call attends, never the whole pool.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kgen.arrays import checks_values
from kgen.errors import ArgumentError
from kgen.interop import from_flashinfer
from kgen.optional import is_torch_tensor


def latent_arguments(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len,
                     page_size: int) -> dict[str, Any]:
    """kgen's MLA call arguments {q, kv_cache, block_tables, seq_lens} for FlashInfer's MLA tensors (numpy
    arrays or torch tensors; the answer in the same library, on the same device). `kv_last_page_len` None:
    every page full (page_size 1's convention, where FlashInfer-Bench has no such input)."""
    torch = _torch_of(q_nope)
    _check(q_nope, q_pe, ckv_cache, kpe_cache, page_size)
    q = torch.cat([q_nope, q_pe], dim=-1) if torch else np.concatenate([q_nope, q_pe], axis=-1)
    cache = _adjacent_view(ckv_cache, kpe_cache)
    indices = kv_indices
    if cache is None:
        cache, indices = _joined_pages(torch, ckv_cache, kpe_cache, kv_indices)
    if kv_last_page_len is None:
        pages = kv_indptr[1:] - kv_indptr[:-1]
        kv_last_page_len = (pages > 0) * page_size
    block_tables, seq_lens = from_flashinfer(kv_indptr, indices, kv_last_page_len, page_size)
    return {"q": q, "kv_cache": cache, "block_tables": block_tables, "seq_lens": seq_lens}


def _torch_of(x):
    if is_torch_tensor(x):
        import torch

        return torch
    return None


def _check(q_nope, q_pe, ckv, kpe, page_size: int) -> None:
    """Shapes that FlashInfer's MLA call has: ArgumentError naming the argument and the expected shape."""
    def shape(x) -> tuple[int, ...]:
        return tuple(int(n) for n in x.shape)

    qn, qp, c, k = shape(q_nope), shape(q_pe), shape(ckv), shape(kpe)
    if len(qn) != 3 or len(qp) != 3 or qn[:2] != qp[:2]:
        raise ArgumentError(f"q_nope {list(qn)}, q_pe {list(qp)}: expected [rows, num_qo_heads, head_dim_ckv] and "
                            "[rows, num_qo_heads, head_dim_kpe] (the same rows and heads)")
    if len(c) != 3 or c[1:] != (page_size, qn[2]):
        raise ArgumentError(f"ckv_cache {list(c)}: expected [num_pages, {page_size}, {qn[2]}] "
                            "(page_size, q_nope's head_dim_ckv)")
    if k != (c[0], page_size, qp[2]):
        raise ArgumentError(f"kpe_cache {list(k)}: expected [{c[0]}, {page_size}, {qp[2]}] "
                            "(ckv_cache's pages, page_size, q_pe's head_dim_kpe)")


def _layout(x) -> tuple[int, tuple[int, ...], int]:
    """(address, strides in elements, element size) of a numpy array or torch tensor."""
    if is_torch_tensor(x):
        return x.data_ptr(), tuple(x.stride()), x.element_size()
    return x.__array_interface__["data"][0], tuple(s // x.itemsize for s in x.strides), x.itemsize


def _adjacent_view(ckv, kpe):
    """A [num_pages, page_size, Dc + Dp] view of the one buffer that holds ckv's and kpe's rows side by side,
    or None when they are not laid out so (then they are joined by copying)."""
    if ckv.dtype != kpe.dtype or is_torch_tensor(ckv) != is_torch_tensor(kpe):
        return None
    (c_ptr, c_strides, size), (k_ptr, k_strides, _) = _layout(ckv), _layout(kpe)
    dc, dp = int(ckv.shape[2]), int(kpe.shape[2])
    width = dc + dp
    if c_strides[:2] != k_strides[:2] or c_strides[2] != 1 or k_strides[2] != 1 or k_ptr != c_ptr + dc * size:
        return None
    if (int(ckv.shape[1]) > 1 and c_strides[1] < width) or (int(ckv.shape[0]) > 1 and c_strides[0] < width):
        return None  # rows of the view would overlap: not one row per token
    shape = (int(ckv.shape[0]), int(ckv.shape[1]), width)
    if is_torch_tensor(ckv):
        if ckv.device != kpe.device or ckv.untyped_storage().data_ptr() != kpe.untyped_storage().data_ptr():
            return None
        return ckv.as_strided(shape, c_strides)
    # every element the view reads is one of ckv's or kpe's (kpe's rows are the gaps of ckv's)
    return np.lib.stride_tricks.as_strided(ckv, shape, ckv.strides, writeable=False)


def _joined_pages(torch, ckv, kpe, kv_indices):
    """(the pages kv_indices names, joined [n, page_size, Dc + Dp], in kv_indices' order; kv_indices
    renumbered 0..n-1). A call that names no page gets one unread page (kgen's cache is never empty). The
    page ids are checked where kgen checks values (host arrays; device arrays in debug mode)."""
    if torch:
        idx = kv_indices.to(device=ckv.device, dtype=torch.int64)
        if checks_values(idx.device.type):
            _check_pages(idx.cpu().numpy(), int(ckv.shape[0]))
        picked = idx if idx.numel() else torch.zeros(1, dtype=torch.int64, device=ckv.device)
        cache = torch.cat([ckv[picked], kpe[picked]], dim=-1)
        return cache, torch.arange(idx.numel(), dtype=torch.int32, device=kv_indices.device)
    idx = np.asarray(kv_indices, dtype=np.int64)
    _check_pages(idx, int(ckv.shape[0]))
    picked = idx if idx.size else np.zeros(1, dtype=np.int64)
    return np.concatenate([ckv[picked], kpe[picked]], axis=-1), np.arange(idx.size, dtype=np.int32)


def _check_pages(idx: np.ndarray, num_pages: int) -> None:
    bad = (idx < 0) | (idx >= num_pages)
    if bad.any():
        i = int(np.argmax(bad))
        raise ArgumentError(f"kv_indices[{i}] = {int(idx[i])}: not a page of ckv_cache (0..{num_pages - 1})")
