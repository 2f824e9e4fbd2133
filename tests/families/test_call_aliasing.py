"""Buffers a kernel writes may not overlap buffers it reads (every family, CPU backend), and argument
messages spell dtypes one way (kgen's names, numpy's where kgen has none)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import kgen
from kgen.errors import ArgumentError
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.attention.reference import attention_outputs

DECODE = {
    "kgen": 1, "name": "alias_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}


def _build(spec):
    return kgen.build(spec, backend="cpu", verify=False, archs=[])


@pytest.fixture(scope="module")
def decode():
    return _build(kgen.spec_from_dict(DECODE))


@pytest.fixture(scope="module")
def decode_int8():
    return _build(kgen.spec_from_dict(DECODE).with_overrides(
        name="alias_decode_int8", **{"kv_cache.dtype": "int8", "kv_cache.scale": "per_head"}))


def _decode_args(kernel, lens=(20, 5)):
    return make_decode_case(kernel.spec, list(lens), np.random.default_rng(11))


def test_out_that_is_q_is_refused(decode):
    args = _decode_args(decode)
    with pytest.raises(ArgumentError, match="out overlaps q in memory"):
        decode(**(args | {"out": args["q"]}))


def test_out_inside_the_k_cache_is_refused(decode):
    args = _decode_args(decode)
    q = args["q"]
    out = args["k_cache"].reshape(-1)[16: 16 + q.size].reshape(q.shape)  # a view into the pool
    with pytest.raises(ArgumentError, match="out overlaps k_cache in memory"):
        decode(**(args | {"out": out}))


def test_out_overlapping_a_torch_input_is_refused(decode):
    args = _decode_args(decode)
    q = torch.from_numpy(args["q"])
    with pytest.raises(ArgumentError, match="out overlaps q in memory"):
        decode(**(args | {"q": q, "out": q}))


def test_out_interleaved_with_q_in_one_buffer_is_accepted(decode):
    """Spans that meet without a common byte: q and out as the two halves of each row of one buffer."""
    args = _decode_args(decode)
    S, H, D = args["q"].shape
    buffer = np.zeros((S, H, 2 * D), np.float16)
    q, out = buffer[..., :D], buffer[..., D:]
    q[...] = args["q"]
    result = decode(**(args | {"q": q, "out": out}))
    assert result is out
    ref, _ = attention_outputs(decode.spec, args["q"], args)
    bound = 4 * float(np.abs(ref).max()) * 2.0 ** -10  # a few fp16 ulps at the output's scale
    assert float(np.abs(out.astype(np.float64) - ref).max()) <= bound
    assert np.array_equal(q, args["q"])


@pytest.fixture(scope="module")
def cache_write():
    return _build(kgen.load_spec("specs/cache_write_fp8_e4m3.yaml").with_overrides(
        name="alias_cache_write", targets=["sm_90"], kv_cache={"dtype": "fp16", "scale": "none", "layout": "separate",
                                                                 "order": "NHD"},
        **{"attention.head_dim": 64, "kv_cache.block_size": 8, "dtype.q": "fp16"}))


def _write_args(kernel, T=3):
    a, B = kernel.spec.attention, kernel.spec.kv_cache.block_size
    rng = np.random.default_rng(5)
    return {"key": rng.standard_normal((T, a.num_kv_heads, a.head_dim)).astype(np.float16),
            "value": rng.standard_normal((T, a.num_kv_heads, a.head_dim)).astype(np.float16),
            "k_cache": np.zeros((4, B, a.num_kv_heads, a.head_dim), np.float16),
            "v_cache": np.zeros((4, B, a.num_kv_heads, a.head_dim), np.float16),
            "slot_mapping": np.arange(T, dtype=np.int32)}


@pytest.mark.parametrize("source,cache", [("key", "k_cache"), ("value", "k_cache"), ("value", "v_cache")])
def test_cache_write_input_inside_a_cache_is_refused(cache_write, source, cache):
    args = _write_args(cache_write)
    shape = args[source].shape
    args[source] = args[cache].reshape(-1)[-np.prod(shape):].reshape(shape)
    with pytest.raises(ArgumentError, match=f"{cache} overlaps {source} in memory"):
        cache_write(**args)


def test_cache_write_with_disjoint_inputs_writes(cache_write):
    args = _write_args(cache_write)
    cache_write(**args)
    B = cache_write.spec.kv_cache.block_size
    for t, slot in enumerate(args["slot_mapping"]):
        assert np.array_equal(args["k_cache"][slot // B, slot % B], args["key"][t])


def test_copy_blocks_pairs_inside_a_cache_are_refused():
    kernel = _build(kgen.load_spec("specs/copy_blocks_fp16.yaml").with_overrides(
        name="alias_copy_blocks", targets=["sm_90"], **{"attention.head_dim": 64, "kv_cache.block_size": 8}))
    rng = np.random.default_rng(2)
    k = rng.standard_normal((6, 8, kernel.spec.attention.num_kv_heads, 64)).astype(np.float16)
    v = rng.standard_normal(k.shape).astype(np.float16)
    flat = v.reshape(-1).view(np.int32)
    flat[:2] = (0, 3)  # one pair (0 -> 3) stored in the first bytes of the V pool
    with pytest.raises(ArgumentError, match=r"v_cache overlaps pairs in memory"):
        kernel(k_cache=k, v_cache=v, pairs=flat[:2].reshape(1, 2))


# ---- dtype spelling -----------------------------------------------------------------------------------

def test_float64_reads_the_same_from_numpy_and_torch(decode):
    args = _decode_args(decode)
    for q in (args["q"].astype(np.float64), torch.from_numpy(args["q"].astype(np.float64))):
        with pytest.raises(ArgumentError, match=r"^q: expected dtype fp16, got float64$"):
            decode(**(args | {"q": q}))


def test_torch_and_numpy_fp32_read_fp32(decode):
    args = _decode_args(decode)
    for q in (args["q"].astype(np.float32), torch.from_numpy(args["q"].astype(np.float32))):
        with pytest.raises(ArgumentError, match=r"^q: expected dtype fp16, got fp32$"):
            decode(**(args | {"q": q}))


def test_bf16_given_for_fp16_reads_bf16(decode):
    args = _decode_args(decode)
    with pytest.raises(ArgumentError, match=r"^k_cache: expected dtype fp16, got bf16$"):
        decode(**(args | {"k_cache": args["k_cache"].astype(ml_dtypes.bfloat16)}))


def test_required_scale_is_described_as_fp32(decode_int8):
    args = _decode_args(decode_int8)
    del args["k_scale"]
    with pytest.raises(ArgumentError, match=r"k_scale: required .*\(fp32, shape") as e:
        decode_int8(**args)
    assert "float32" not in str(e.value)
