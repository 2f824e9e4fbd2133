"""Array adapters: numpy/torch views with kgen dtype names, and bit-exact moves between libraries."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kgen.arrays import (
    INT32_MAX,
    INT32_MIN,
    adapt,
    args_to_backend,
    as_array_arg,
    full_like_library,
    overlaps,
    refuse_aliasing,
    scale_value,
    to_numpy,
)
from kgen.errors import ArgumentError
from kgen.formats.dtypes import dtype_label

DTYPES = [("fp16", np.float16, torch.float16), ("bf16", ml_dtypes.bfloat16, torch.bfloat16),
          ("fp32", np.float32, torch.float32), ("fp8_e4m3", ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
          ("fp8_e5m2", ml_dtypes.float8_e5m2, torch.float8_e5m2), ("int8", np.int8, torch.int8),
          ("int32", np.int32, torch.int32)]


@pytest.mark.parametrize("name,np_dtype,torch_dtype", DTYPES, ids=[d[0] for d in DTYPES])
def test_torch_cpu_tensor_is_described_and_read_bit_exactly(name, np_dtype, torch_dtype):
    values = (np.arange(24).reshape(2, 3, 4) % 7 - 3).astype(np.float32)
    t = torch.from_numpy(values).to(torch_dtype)
    arg = as_array_arg("x", t)
    assert (arg.dtype, arg.shape, arg.strides, arg.device) == (name, (2, 3, 4), (12, 4, 1), "cpu")
    assert arg.ptr == t.data_ptr()  # a view, not a copy
    back = to_numpy(t)
    assert back.dtype == np.dtype(np_dtype)
    assert np.array_equal(back.astype(np.float32), values.astype(np_dtype).astype(np.float32))


def test_numpy_strides_in_elements_and_contiguity():
    a = np.zeros((4, 6), dtype=np.float16)[:, ::2]
    arg = as_array_arg("k_cache", a)
    assert arg.strides == (6, 2) and not arg.is_c_contiguous()
    assert as_array_arg("q", np.zeros((2, 3), np.float32)).is_c_contiguous()


def test_cpu_backend_keeps_host_arrays():
    args = {"q": np.ones(3, np.float16)}
    assert args_to_backend(args, "cpu")["q"] is args["q"]


def test_non_array_is_refused_by_name():
    with pytest.raises(ArgumentError, match="seq_lens: expected a numpy array"):
        as_array_arg("seq_lens", [1, 2, 3])


def test_transposed_torch_tensor_is_read_through_dlpack_bit_exactly():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = torch.from_numpy(values).to(torch.bfloat16).t()  # strides (1, 4): no copy is made to read it
    arg = as_array_arg("x", t)
    assert (arg.dtype, arg.strides, arg.ptr) == ("bf16", (1, 4), t.data_ptr())
    assert np.array_equal(to_numpy(t).astype(np.float32), values.T)


def test_torch_dtype_numpy_lacks_is_described_not_crashed_on():
    t = torch.zeros(4, dtype=torch.float8_e8m0fnu)
    arg = as_array_arg("q", t)
    assert (arg.dtype, arg.shape, arg.device, arg.ptr) == ("float8_e8m0fnu", (4,), "cpu", t.data_ptr())


@pytest.mark.parametrize("dtype,expected", [
    (np.dtype(np.float32), "fp32"), (torch.float32, "fp32"), (np.dtype(np.float64), "float64"),
    (torch.float64, "float64"), (np.dtype(ml_dtypes.bfloat16), "bf16"), (torch.bfloat16, "bf16"),
    (np.dtype(ml_dtypes.float8_e4m3fn), "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2"),
    (np.dtype(np.int64), "int64"), (torch.int64, "int64"), (torch.uint8, "uint8"), (np.dtype(bool), "bool"),
])
def test_dtype_label_is_kgen_name_else_numpy_name(dtype, expected):
    assert dtype_label(dtype) == expected


def _arg(name, a):
    return as_array_arg(name, a)


def test_overlap_of_views_of_one_buffer():
    buf = np.zeros((4, 2, 8), np.float16)
    whole, first, second = _arg("a", buf), _arg("b", buf[:2]), _arg("c", buf[2:])
    assert overlaps(whole, first) and overlaps(first, whole) and overlaps(whole, whole)
    assert not overlaps(first, second)
    left, right = _arg("l", buf[..., :4]), _arg("r", buf[..., 4:])  # interleaved: spans meet, no common byte
    assert not overlaps(left, right)
    assert overlaps(left, _arg("x", buf[..., 3:5]))
    assert overlaps(_arg("rev", buf[::-1]), _arg("last", buf[3]))  # a negative stride reaches back
    assert not overlaps(_arg("a", np.zeros(3)), _arg("b", np.zeros(3)))
    assert not overlaps(_arg("empty", buf[:0]), whole)


def test_overlap_across_dtypes_and_libraries():
    buf = np.zeros(64, np.float16)
    as_int = buf[:8].view(np.int32)  # the first 16 bytes, read as 4 int32
    assert overlaps(_arg("w", buf), _arg("r", as_int))
    assert not overlaps(_arg("w", buf[8:]), _arg("r", as_int))
    t = torch.from_numpy(buf)
    assert overlaps(_arg("w", t[60:]), _arg("r", buf[63:]))


def test_refuse_aliasing_names_both_arguments():
    buf = np.zeros((2, 8), np.float32)
    out, q, other = _arg("out", buf), _arg("q", buf[1:]), _arg("k", np.zeros(3, np.float32))
    refuse_aliasing([out], [other, None])
    refuse_aliasing([out], [out])  # an argument is not its own alias
    with pytest.raises(ArgumentError, match=r"^out overlaps q in memory: the kernel writes out while it reads q"):
        refuse_aliasing([None, out], [other, q])


# ---- engines' arrays read as the ABI's (kgen.arrays.adapt, scale_value) ----------------------------
def test_int64_indices_are_narrowed_to_a_contiguous_int32_copy():
    wide = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]  # strided, as a slice of an engine's table
    arg = as_array_arg("block_tables", wide)
    adapt(arg, "int32")
    assert (arg.dtype, arg.strides, arg.obj is wide) == ("int32", (3, 1), True)
    assert arg.native.dtype == np.int32 and np.array_equal(arg.native, wide) and arg.ptr == arg.native.ctypes.data
    t = torch.arange(5, dtype=torch.int64)
    targ = as_array_arg("seq_lens", t)
    adapt(targ, "int32")
    assert targ.dtype == "int32" and np.array_equal(targ.native, t.numpy())


@pytest.mark.parametrize("value", [1 << 31, -(1 << 31) - 1])
def test_int64_values_outside_int32_are_refused_never_wrapped(value):
    a = np.zeros((2, 3), np.int64)
    a[1, 2] = value
    with pytest.raises(ArgumentError, match=rf"block_tables\[1, 2\] = {value} does not fit in int32"):
        adapt(as_array_arg("block_tables", a), "int32")
    edge = as_array_arg("x", np.asarray([INT32_MIN, INT32_MAX], np.int64))
    adapt(edge, "int32")
    assert edge.native.tolist() == [INT32_MIN, INT32_MAX]


def test_uint8_bytes_are_viewed_as_the_expected_fp8_type_without_a_copy():
    cache = np.arange(16, dtype=np.uint8).reshape(2, 8)
    arg = as_array_arg("k_cache", cache)
    adapt(arg, "fp8_e4m3")
    assert (arg.dtype, arg.ptr, arg.native.dtype) == ("fp8_e4m3", cache.ctypes.data, np.dtype(ml_dtypes.float8_e4m3fn))
    assert np.array_equal(arg.native.view(np.uint8), cache)
    other = as_array_arg("k_cache", cache)
    adapt(other, "int8")  # only fp8 is read from raw bytes: int8 stays refused by the dtype check
    assert other.dtype == "uint8"


@pytest.mark.parametrize("value", [0.25, np.float32(0.25), np.asarray(0.25), np.asarray([0.25], np.float16),
                                   torch.tensor(0.25, dtype=torch.float64)],
                         ids=["float", "np.float32", "0-d float64", "one-element fp16", "torch float64"])
def test_scale_value_gives_an_fp32_array_of_the_asked_shape(value):
    ref = as_array_arg("q", np.zeros(2, np.float16))
    arg = scale_value("k_scale", value, ref, ())
    assert (arg.shape, arg.dtype, arg.device) == ((), "fp32", "cpu") and float(arg.native) == 0.25


def test_scale_value_leaves_other_arrays_to_the_checks_and_refuses_bools():
    ref = as_array_arg("q", np.zeros(2, np.float16))
    two = np.asarray([0.5, 0.25], np.float64)
    assert scale_value("k_scale", two, ref, ()).dtype == "float64"  # the shape/dtype check names it next
    with pytest.raises(ArgumentError, match="k_scale: expected a number or an fp32 array, got a bool"):
        scale_value("k_scale", False, ref, ())


def test_full_like_library_puts_host_values_in_numpy():
    """On the host the kernel reads memory in place, whichever library the other arguments are from."""
    for ref in (np.zeros(1), torch.zeros(1)):
        a = full_like_library(as_array_arg("q", ref), (2,), 3.0, "fp32")
        assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.tolist() == [3.0, 3.0]
