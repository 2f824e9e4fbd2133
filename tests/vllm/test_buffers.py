"""kgen/vllm/buffers.py: a builder's step buffers are made once, at the scheduler's most tokens, and
handed out as views of the same storage step after step; larger only when a step needs more."""

import pytest

torch = pytest.importorskip("torch")

from kgen.vllm.buffers import StepBuffers  # noqa: E402

CPU = torch.device("cpu")


def test_a_buffer_is_made_once_at_the_most_tokens_and_reused():
    buffers = StepBuffers(rows=64)
    first = buffers.take("out", (3, 4, 8), torch.bfloat16, CPU)
    again = buffers.take("out", (64, 4, 8), torch.bfloat16, CPU)  # the scheduler's most tokens: no new buffer
    smaller_rows = buffers.take("out", (5, 2, 8), torch.bfloat16, CPU)  # another layer's shape, fewer elements
    assert first.shape == (3, 4, 8) and first.is_contiguous() and first.dtype == torch.bfloat16
    storage = first.untyped_storage().data_ptr()
    assert again.untyped_storage().data_ptr() == smaller_rows.untyped_storage().data_ptr() == storage
    assert first.untyped_storage().nbytes() == 64 * 4 * 8 * 2


def test_a_step_with_more_tokens_grows_the_buffer_and_other_names_and_dtypes_have_their_own():
    buffers = StepBuffers(rows=4)
    small = buffers.take("q", (4, 2, 8), torch.float16, CPU)
    grown = buffers.take("q", (9, 2, 8), torch.float16, CPU)
    assert grown.shape == (9, 2, 8) and grown.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    assert buffers.take("q", (9, 2, 8), torch.float16, CPU).untyped_storage().data_ptr() == \
        grown.untyped_storage().data_ptr()
    other = buffers.take("out", (4, 2, 8), torch.float16, CPU)
    wider = buffers.take("q", (4, 2, 8), torch.float32, CPU)
    pointers = {t.untyped_storage().data_ptr() for t in (grown, other, wider)}
    assert len(pointers) == 3
