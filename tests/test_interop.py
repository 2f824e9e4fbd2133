"""Interop with the engines' conventions (docs/interop.md): vLLM-style calls (int64 indices, an fp8
cache stored as uint8, scales as Python floats) give the plain call's outputs bit for bit; FlashInfer's
page table converts to block tables and back; the LSE base conversion; and the debug switch that
decides whether a call reads the values the kernel trusts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kgen
from kgen.arrays import checks_values
from kgen.families.attention.decode_cases import make_decode_case
from kgen.formats.cache import cache_shapes
from kgen.formats.dtypes import dtype
from kgen.interop import from_flashinfer, lse_from_base2, lse_to_base2, to_flashinfer

SMALL = {"kgen": 1, "kind": "paged_decode", "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32},
         "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"]}
VLLM_FP8 = {"block_size": 16, "layout": "vllm", "dtype": "fp8_e4m3", "scale": "per_tensor"}


def _build(name: str, kv: dict, kind: str = "paged_decode", **extra):
    spec = kgen.spec_from_dict({**SMALL, "name": name, "kind": kind, "kv_cache": kv, **extra})
    return kgen.build(spec, backend="cpu", archs=[], verify=False)


@pytest.fixture(scope="module")
def vllm_decode():
    return _build("io_vllm_fp8_decode", VLLM_FP8)


@pytest.fixture(scope="module")
def vllm_write():
    return _build("io_vllm_fp8_write", VLLM_FP8, kind="cache_write")


@pytest.fixture(scope="module")
def fp16_decode():
    return _build("io_fp16_decode", {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"})


def _decode_args(kernel, lens=(1, 16, 17, 40), seed=3):
    args = make_decode_case(kernel.spec, list(lens), np.random.default_rng(seed))
    args.pop("out")
    return args


# ---- a vLLM-style call ------------------------------------------------------------------------
def test_vllm_style_decode_call_matches_the_plain_call(vllm_decode):
    args = _decode_args(vllm_decode)
    plain = vllm_decode(**args)
    engine = dict(args, block_tables=args["block_tables"].astype(np.int64), seq_lens=args["seq_lens"].astype(np.int64),
                  k_cache=args["k_cache"].view(np.uint8), v_cache=args["v_cache"].view(np.uint8),
                  k_scale=float(args["k_scale"]), v_scale=float(args["v_scale"]))
    assert np.array_equal(vllm_decode(**engine), plain)
    as_torch = {n: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
                for n, v in engine.items()}
    assert np.array_equal(vllm_decode(**as_torch).numpy(), plain)


@pytest.mark.parametrize("scale", [
    lambda s: float(s), lambda s: np.float32(s), lambda s: np.asarray(s, np.float64),
    lambda s: np.asarray([s], np.float32), lambda s: torch.tensor(float(s), dtype=torch.float64), lambda s: 1,
], ids=["float", "np.float32", "0-d float64", "one-element", "torch 0-d float64", "int"])
def test_per_tensor_scale_in_any_form_reads_as_the_fp32_array(vllm_decode, scale):
    args = _decode_args(vllm_decode)
    if isinstance(scale(0.5), int):  # compare against the fp32 array of that value
        args["k_scale"] = args["v_scale"] = np.asarray(1.0, np.float32)
    plain = vllm_decode(**args)
    given = dict(args, k_scale=scale(args["k_scale"]), v_scale=scale(args["v_scale"]))
    assert np.array_equal(vllm_decode(**given), plain)


def test_a_bool_scale_is_refused(vllm_decode):
    with pytest.raises(kgen.ArgumentError, match="k_scale: expected a number or an fp32 array, got a bool"):
        vllm_decode(**dict(_decode_args(vllm_decode), k_scale=True))


def test_vllm_style_cache_write_stores_the_same_bytes(vllm_write):
    spec, rng = vllm_write.spec, np.random.default_rng(5)
    N, B = 6, spec.kv_cache.block_size
    key, value = (rng.standard_normal((9, 2, 32)).astype(np.float16) for _ in range(2))
    slots = rng.choice(N * B, size=9, replace=False).astype(np.int32)
    slots[[2, 5]] = -1
    shapes = cache_shapes(spec, N)

    def run(cache_dtype, slot_dtype, scales):
        caches = {n: np.zeros(s, cache_dtype) for n, s in shapes.items()}
        vllm_write(key=key, value=value, slot_mapping=slots.astype(slot_dtype), **caches, **scales)
        return {n: c.view(np.uint8) for n, c in caches.items()}

    arrays = {"k_scale": np.asarray(0.02, np.float32), "v_scale": np.asarray(0.03, np.float32)}
    plain = run(dtype("fp8_e4m3").numpy, np.int32, arrays)
    engine = run(np.uint8, np.int64, {"k_scale": 0.02, "v_scale": 0.03})
    assert any(c.any() for c in plain.values())
    for name in plain:
        assert np.array_equal(engine[name], plain[name]), name


def test_int64_indices_of_any_layout_read_like_int32(fp16_decode):
    args = _decode_args(fp16_decode)
    plain = fp16_decode(**args)
    wide = np.full((args["block_tables"].shape[0], 9), 7, np.int64)  # a slice of an engine's wider table
    wide[:, :args["block_tables"].shape[1]] = args["block_tables"]
    sliced = wide[:, :args["block_tables"].shape[1]]
    assert not sliced.flags.c_contiguous
    out = fp16_decode(**dict(args, block_tables=sliced, seq_lens=torch.from_numpy(args["seq_lens"]).long()))
    assert np.array_equal(out, plain)


@pytest.mark.parametrize("name,value,at", [("block_tables", 1 << 31, "[1, 0]"), ("seq_lens", -(1 << 31) - 1, "[2]")])
def test_int64_values_outside_int32_are_refused(fp16_decode, name, value, at):
    args = _decode_args(fp16_decode)
    wide = args[name].astype(np.int64)
    wide[(1, 0) if name == "block_tables" else 2] = value
    with pytest.raises(kgen.ArgumentError, match=rf"{name}\{at[:-1]}\] = {value} does not fit in int32"):
        fp16_decode(**dict(args, **{name: wide}))
    args[name] = wide
    fp16_decode.debug = False  # refused even without value checks: narrowing would change the value
    try:
        with pytest.raises(kgen.ArgumentError, match="does not fit in int32"):
            fp16_decode(**args)
    finally:
        fp16_decode.debug = None


def test_int64_slot_mapping_out_of_int32_is_refused(vllm_write):
    shapes = cache_shapes(vllm_write.spec, 4)
    caches = {n: np.zeros(s, np.uint8) for n, s in shapes.items()}
    key = np.zeros((2, 2, 32), np.float16)
    with pytest.raises(kgen.ArgumentError, match=r"slot_mapping\[1\] = 1099511627776 does not fit in int32"):
        vllm_write(key=key, value=key, slot_mapping=np.asarray([0, 1 << 40], np.int64), k_scale=1.0, v_scale=1.0,
                   **caches)


def test_uint8_is_viewed_only_where_an_fp8_array_is_expected(vllm_decode):
    """A uint8 array where fp16 (or int8) is expected is still refused."""
    args = _decode_args(vllm_decode)
    with pytest.raises(kgen.ArgumentError, match="q: expected dtype fp16, got uint8"):
        vllm_decode(**dict(args, q=args["q"].view(np.uint8)[..., ::2]))


# ---- FlashInfer's page table ------------------------------------------------------------------
def _random_tables(rng, B: int, lens: list[int], width: int):
    pages = [math.ceil(n / B) for n in lens]
    ids = rng.permutation(sum(pages) + 5)
    tables = rng.integers(0, 1000, size=(len(lens), width)).astype(np.int32)  # columns past a sequence: junk
    at = 0
    for i, p in enumerate(pages):
        tables[i, :p] = ids[at:at + p]
        at += p
    return tables, np.asarray(lens, np.int32)


@pytest.mark.parametrize("seed", range(4))
def test_flashinfer_round_trip_with_empty_sequences_and_full_last_pages(seed):
    rng, B = np.random.default_rng(seed), 16
    lens = [0, B, 3 * B, 1, 2 * B + 5, 0, *rng.integers(0, 6 * B, size=5).tolist()]
    tables, seq_lens = _random_tables(rng, B, lens, width=7)
    indptr, indices, last = to_flashinfer(tables, seq_lens, B)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    pages = np.asarray([math.ceil(n / B) for n in lens])
    assert np.array_equal(np.diff(indptr), pages) and indptr[0] == 0
    assert last[0] == 0 and last[1] == B and last[2] == B and last[3] == 1 and last[4] == 5
    back_tables, back_lens = from_flashinfer(indptr, indices, last, B)
    assert np.array_equal(back_lens, seq_lens) and back_tables.shape == (len(lens), pages.max())
    for i, p in enumerate(pages):
        assert np.array_equal(back_tables[i, :p], tables[i, :p])
        assert not back_tables[i, p:].any()
    again = to_flashinfer(back_tables, back_lens, B)
    for a, b in zip(again, (indptr, indices, last), strict=True):
        assert np.array_equal(a, b)


def test_flashinfer_tables_in_torch_match_numpy():
    rng, B = np.random.default_rng(9), 8
    tables, lens = _random_tables(rng, B, [0, 8, 9, 30, 1], width=5)
    want = to_flashinfer(tables, lens, B)
    got = to_flashinfer(torch.from_numpy(tables), torch.from_numpy(lens), B)
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.int32 for g in got)
    assert all(np.array_equal(g.numpy(), w) for g, w in zip(got, want, strict=True))
    back = from_flashinfer(*got, B, max_blocks_per_seq=6)
    assert back[0].shape == (5, 6) and back[0].dtype == torch.int32
    assert np.array_equal(back[1].numpy(), lens)


def test_flashinfer_docs_example_reads_as_kgen_tables():
    """FlashInfer's own example: 7 requests over 128 pages, 1 <= last_page_len <= page_size."""
    indptr = np.asarray([0, 17, 29, 44, 48, 66, 100, 128], np.int32)
    last = np.asarray([1, 7, 14, 4, 3, 1, 16], np.int32)
    tables, lens = from_flashinfer(indptr, np.arange(128, dtype=np.int32), last, 16)
    assert lens.tolist() == [(p - 1) * 16 + n for p, n in zip(np.diff(indptr), last, strict=True)]
    assert tables.shape == (7, 34) and tables[6, :28].tolist() == list(range(100, 128))


def test_decode_reads_a_flashinfer_table_like_its_own(fp16_decode):
    args = _decode_args(fp16_decode, lens=(16, 3, 33))
    plain = fp16_decode(**args)
    tables, lens = from_flashinfer(*to_flashinfer(args["block_tables"], args["seq_lens"], 16), 16)
    assert np.array_equal(fp16_decode(**dict(args, block_tables=tables, seq_lens=lens)), plain)


@pytest.mark.parametrize("indptr,last,max_blocks,message", [
    ([0, 2, 1], [3, 3], None, r"indptr\[2\] = 1 < indptr\[1\] = 2: indptr must be non-decreasing"),
    ([0, 2, 3], [0, 3], None, r"last_page_len\[0\] = 0: must be in 1..16"),
    ([0, 2, 3], [3, 17], None, r"last_page_len\[1\] = 17: must be in 1..16"),
    ([0, 0, 3], [5, 3], None, r"last_page_len\[0\] = 5: request 0 has no pages, so it must be 0"),
    ([0, 2, 3], [3], None, r"last_page_len: 1 entries, but indptr describes 2 requests"),
    ([0, 2, 9], [3, 3], None, r"indptr: \[0, 9\] is not inside indices \(length 3\)"),
    ([0, 2, 3], [3, 3], 1, r"request 0 has 2 pages, more than max_blocks_per_seq = 1"),
])
def test_flashinfer_table_errors_name_the_entry(indptr, last, max_blocks, message):
    with pytest.raises(kgen.ArgumentError, match=message):
        from_flashinfer(np.asarray(indptr), np.asarray([4, 5, 6]), np.asarray(last), 16, max_blocks_per_seq=max_blocks)


def test_to_flashinfer_refuses_a_length_the_table_cannot_hold():
    with pytest.raises(kgen.ArgumentError, match=r"seq_lens\[1\] = 33: must be in 0..32"):
        to_flashinfer(np.zeros((2, 2), np.int32), np.asarray([3, 33]), 16)


# ---- LSE ---------------------------------------------------------------------------------------
def test_lse_base_conversion_numpy_and_torch():
    lse = np.asarray([0.0, 1.0, -np.inf, math.log(8.0)], np.float32)
    base2 = lse_to_base2(lse)
    assert base2.dtype == np.float32 and base2[2] == -np.inf
    assert np.allclose(base2[[0, 1, 3]], [0.0, 1.0 / math.log(2.0), 3.0], rtol=1e-6)
    assert np.allclose(lse_from_base2(base2), lse, rtol=1e-6) and lse_from_base2(base2)[2] == -np.inf
    t = lse_to_base2(torch.from_numpy(lse))
    assert t.dtype == torch.float32 and np.allclose(t.numpy(), base2)


def test_kernel_lse_in_base_2_is_log2_of_the_softmax_sum(fp16_decode):
    """The natural-log LSE converted equals log2 of sum(2^(logit * log2 e)), FlashInfer's definition."""
    args = _decode_args(fp16_decode, lens=(5,))
    _, lse = fp16_decode(**args, return_lse=True)
    q = args["q"].astype(np.float64)[0]  # [Hq, D]
    k = args["k_cache"].astype(np.float64)[args["block_tables"][0, 0], :5]  # [5, H, D]
    logits = np.einsum("hd,thd->ht", q, np.repeat(k, 2, axis=1)) * fp16_decode.spec.softmax_scale_value
    want = np.log2(np.exp2(logits / math.log(2.0)).sum(axis=1))
    assert np.allclose(lse_to_base2(lse[0]), want, atol=1e-4)


# ---- debug: the value checks -------------------------------------------------------------------
def test_value_checks_on_host_arrays_by_default_and_by_setting(monkeypatch):
    monkeypatch.delenv("KGEN_DEBUG", raising=False)
    assert checks_values("cpu") and not checks_values("cuda")
    assert checks_values("cuda", debug=True) and not checks_values("cpu", debug=False)
    monkeypatch.setenv("KGEN_DEBUG", "1")
    assert checks_values("cuda") and not checks_values("cuda", debug=False)
    monkeypatch.setenv("KGEN_DEBUG", "0")
    assert not checks_values("cpu")
    monkeypatch.setenv("KGEN_DEBUG", "sometimes")
    with pytest.raises(kgen.KgenUserError, match="KGEN_DEBUG='sometimes'"):
        checks_values("cpu")


def test_debug_off_skips_the_value_checks_debug_on_keeps_them(monkeypatch):
    monkeypatch.delenv("KGEN_DEBUG", raising=False)
    spec = kgen.spec_from_dict({**SMALL, "name": "io_no_tail", "tail_masking": False,
                                "kv_cache": {"block_size": 16, "layout": "separate", "dtype": "fp16"}})
    kern = kgen.build(spec, backend="cpu", archs=[], verify=False, debug=False)
    args = _decode_args(kern, lens=(32, 16))
    bad = dict(args, seq_lens=np.asarray([32, 17], np.int32))  # breaks the tail_masking: false promise
    kern(**bad)  # not read: the kernel trusts it (it stays inside the sequence's blocks)
    kern.debug = None  # the default on the CPU backend: checked
    with pytest.raises(kgen.ArgumentError, match=r"seq_lens\[1\] = 17 is not a multiple of block_size 16"):
        kern(**bad)
    monkeypatch.setenv("KGEN_DEBUG", "0")
    kern(**bad)
    kern.debug = True
    with pytest.raises(kgen.ArgumentError, match=r"seq_lens\[1\] = 17"):
        kern(**bad)


def test_a_fused_pool_with_hnd_physical_order_behind_an_nhd_shape_is_read_in_place():
    """vLLM's v1 backends may lay a [N, 2, B, H, D] cache out HND in memory (their stride order)."""
    kern = _build("io_fused_nhd", {"block_size": 16, "layout": "fused", "order": "NHD", "dtype": "fp16"})
    args = _decode_args(kern)
    plain = kern(**args)
    physical = np.ascontiguousarray(args["kv_cache"].transpose(0, 1, 3, 2, 4))  # [N, 2, H, B, D] in memory
    logical = torch.from_numpy(physical).permute(0, 1, 3, 2, 4)  # the NHD shape over HND memory
    assert not logical.is_contiguous()
    assert np.array_equal(kern(**dict(args, kv_cache=logical)), plain)
