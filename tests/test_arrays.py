"""Array adapters: numpy/torch views with kgen dtype names, and bit-exact moves between libraries."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kgen.arrays import args_to_backend, as_array_arg, to_numpy
from kgen.errors import ArgumentError

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
