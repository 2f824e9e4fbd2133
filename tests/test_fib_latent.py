"""kgen/fib/latent.py: FlashInfer's MLA tensors (q_nope/q_pe, ckv_cache/kpe_cache, kv_indptr/kv_indices) as
kgen's MLA call: one pool read in place, separate arrays joined page by page, the page table renumbered, and
shapes or pages that do not fit refused naming the argument."""

from __future__ import annotations

import numpy as np
import pytest

from kgen.errors import ArgumentError
from kgen.fib.latent import latent_arguments
from kgen.interop import to_flashinfer

DC, DP, PAGE, H = 32, 16, 4, 2


def _workload(rng, pages=7):
    pool = rng.standard_normal((pages, PAGE, DC + DP)).astype(np.float16)
    q = rng.standard_normal((3, H, DC + DP)).astype(np.float16)
    tables = np.array([[5, 2], [0, 0], [6, 1]], dtype=np.int32)
    indptr, indices, last = to_flashinfer(tables, np.array([6, 0, 5], dtype=np.int32), PAGE)
    return pool, q, indptr, indices, last


def _tokens(cache, tables, seq_lens):
    """Each sequence's latent rows [seq_len, D] read through kgen's block table."""
    return [cache[t[: -(-int(n) // PAGE)]].reshape(-1, cache.shape[-1])[: int(n)]
            for t, n in zip(tables, seq_lens, strict=True)]


def test_views_of_one_pool_are_read_in_place():
    pool, q, indptr, indices, last = _workload(np.random.default_rng(0))
    call = latent_arguments(q[..., :DC], q[..., DC:], pool[..., :DC], pool[..., DC:], indptr, indices, last, PAGE)
    assert np.shares_memory(call["kv_cache"], pool) and call["kv_cache"].shape == pool.shape
    assert np.array_equal(call["kv_cache"], pool) and np.array_equal(call["q"], q)
    assert call["seq_lens"].tolist() == [6, 0, 5] and call["block_tables"][0].tolist() == [5, 2]


def test_separate_arrays_are_joined_for_the_named_pages_only_in_kgens_order():
    pool, q, indptr, indices, last = _workload(np.random.default_rng(1))
    ckv, kpe = pool[..., :DC].copy(), pool[..., DC:].copy()  # two buffers
    call = latent_arguments(q[..., :DC], q[..., DC:], ckv, kpe, indptr, indices, last, PAGE)
    assert call["kv_cache"].shape == (len(indices), PAGE, DC + DP) and not np.shares_memory(call["kv_cache"], ckv)
    got = _tokens(call["kv_cache"], call["block_tables"], call["seq_lens"])
    want = _tokens(pool, np.array([[5, 2], [0, 0], [6, 1]]), [6, 0, 5])
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)  # latent first, then rope, token by token


def test_views_out_of_order_are_joined_rather_than_read_as_one_row():
    pool, q, indptr, indices, last = _workload(np.random.default_rng(2))
    swapped = np.concatenate([pool[..., DC:], pool[..., :DC]], axis=-1)  # rope first: not kgen's row
    call = latent_arguments(q[..., :DC], q[..., DC:], swapped[..., DP:], swapped[..., :DP], indptr, indices, last, PAGE)
    assert not np.shares_memory(call["kv_cache"], swapped)
    assert np.array_equal(_tokens(call["kv_cache"], call["block_tables"], call["seq_lens"])[0],
                          _tokens(pool, [[5, 2]], [6])[0])


def test_page_size_one_without_last_page_lengths():
    pool, q, _, _, _ = _workload(np.random.default_rng(3), pages=9)
    pool = pool.reshape(-1, 1, DC + DP)
    indptr, indices = np.array([0, 3, 3, 5], dtype=np.int32), np.array([7, 2, 30, 4, 4], dtype=np.int32)
    call = latent_arguments(q[..., :DC], q[..., DC:], pool[..., :DC], pool[..., DC:], indptr, indices, None, 1)
    assert call["seq_lens"].tolist() == [3, 0, 2]


def test_torch_views_of_one_pool_are_read_in_place():
    torch = pytest.importorskip("torch")
    pool, q, indptr, indices, last = (torch.from_numpy(x) for x in _workload(np.random.default_rng(4)))
    call = latent_arguments(q[..., :DC], q[..., DC:], pool[..., :DC], pool[..., DC:], indptr, indices, last, PAGE)
    assert call["kv_cache"].data_ptr() == pool.data_ptr() and torch.equal(call["kv_cache"], pool)
    joined = latent_arguments(q[..., :DC], q[..., DC:], pool[..., :DC].clone(), pool[..., DC:].clone(), indptr,
                              indices, last, PAGE)
    assert joined["kv_cache"].shape == (len(indices), PAGE, DC + DP) and joined["kv_cache"].dtype == torch.float16
    with pytest.raises(ArgumentError, match=r"kv_indices\[0\] = 7: not a page of ckv_cache \(0..6\)"):
        latent_arguments(q[..., :DC], q[..., DC:], pool[..., :DC].clone(), pool[..., DC:].clone(), indptr,
                         torch.full_like(indices, 7), last, PAGE)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(kpe=a["kpe"][:, :, :8]), r"kpe_cache \[7, 4, 8\]: expected \[7, 4, 16\]"),
    (lambda a: a.update(ckv=a["ckv"][:, :2]), r"ckv_cache \[7, 2, 32\]: expected \[num_pages, 4, 32\]"),
    (lambda a: a.update(q_pe=a["q_pe"][:2]), r"q_nope \[3, 2, 32\], q_pe \[2, 2, 16\]"),
    (lambda a: a.update(ckv=a["ckv"].copy(), indices=np.array([5, 2, 9, 1, 6], dtype=np.int32)),
     r"kv_indices\[2\] = 9: not a page of ckv_cache \(0..6\)"),
])
def test_arguments_that_do_not_fit_are_refused_naming_them(change, message):
    pool, q, indptr, indices, last = _workload(np.random.default_rng(5))
    a = {"q_nope": q[..., :DC], "q_pe": q[..., DC:], "ckv": pool[..., :DC], "kpe": pool[..., DC:], "indices": indices}
    change(a)
    with pytest.raises(ArgumentError, match=message):
        latent_arguments(a["q_nope"], a["q_pe"], a["ckv"], a["kpe"], indptr, a["indices"], last, PAGE)
