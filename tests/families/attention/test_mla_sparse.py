"""Sparse mla attention (attention.sparse_topk; docs/abi.md section 8.1, docs/mla.md): real CPU builds
of the sparse decode and prefill kernels verified by kgen's verifier (whose cases poison every slot
no row names) over geometries, split-KV and fp8 caches; mutants of the row selection the matrix must
catch; the reference's gather against a direct numpy computation; the argument checks; the spec's
refusals at FILE:LINE; the ABI text; NVRTC compiles without spills."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import full_tier_except, inline_provided

import kgen
from kgen.abi import abi_text
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import ArgumentError, SpecError
from kgen.families.attention.reference import attention_reference
from kgen.families.attention.sparse_cases import draw_row, make_sparse_case
from kgen.formats.cache import from_layout
from kgen.render import render
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {"kgen": 1, "name": "mla_sparse", "kind": "paged_decode", "tail_masking": True, "targets": ["sm_90"],
        "attention": {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 576, "v_head_dim": 512,
                      "softmax_scale": 0.1147, "sparse_topk": 48},
        "kv_cache": {"block_size": 16, "layout": "mla", "dtype": "bf16"}, "dtype": {"q": "bf16"}}


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _mma(config):
    """The config with path 1: the mma.sync body (on sm_90 a 16-bit sparse spec takes the Hopper one,
    test_mla_sparse_wgmma.py)."""
    return {**config, "path": 1}


DECODE = [
    ({}, {}),
    ({"attention.num_q_heads": 128, "kv_cache.block_size": 64, "attention.sparse_topk": 80},
     {"row_tiles": 2, "col_warps": 4, "stages": 1}),
    ({"attention.sparse_topk": 100}, {"partition_size": 32, "stages": 3}),  # split-KV over the entries + merge
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head", "attention.num_q_heads": 32},
     {"partition_size": 32}),
    ({"dtype.q": "fp16", "kv_cache.dtype": "fp16", "kv_cache.block_size": 1, "attention.sparse_topk": 20},
     {"col_warps": 4}),
]


# The 128-head row (~40 s) is the full tier's; h16, split and fp8 prove the body, the merge and the scales.
@pytest.mark.parametrize("overrides,config", full_tier_except(DECODE, {0, 2, 3, 4}),
                         ids=["h16", "h128-b64-r2c4s1", "split", "fp8-token-split", "fp16-b1"])
def test_sparse_decode_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(**overrides), backend="cpu", verify=False, archs=[], config=_mma(config))
    report = verify(kern, seed=11)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    names = {c.name for c in report.cases}
    assert {"edges", "full_topk", "padding", "tail_padding", "duplicates", "shared_prefix", "padded_pool",
            "mixed_batch", "empty_rows", "empty_rows_lse"} <= names


PREFILL = [
    ({}, {}),
    ({}, {"row_tiles": 2}),  # 32 rows a block over 16 heads: half the tile is padding
    ({"kv_cache.dtype": "fp8_e5m2", "kv_cache.scale": "per_tensor", "attention.causal": False}, {"stages": 3}),
]


@pytest.mark.parametrize("overrides,config", PREFILL, ids=["h16", "h16-r2", "fp8-tensor-causal-false"])
def test_sparse_prefill_verifies_on_cpu(overrides, config):
    kern = kgen.build(_spec(kind="paged_prefill", **overrides), backend="cpu", verify=False, archs=[],
                      config=_mma(config))
    report = verify(kern, seed=13)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)
    assert {"chunk", "chunk_lse", "shared_prefix", "mixed_batch", "padded_pool"} <= {c.name for c in report.cases}


MUTANTS = [
    ("unused entries not masked", "&& named[j][i & 1]", "", {}),
    ("every row reads row 0's indices", "indices + (long long)seq * N", "indices", {}),
    ("slot without the block stride",
     "(long long)((unsigned)slot / B) * s_block + ((unsigned)slot % B) * s_token", "(long long)slot * s_token", {}),
    ("prefill: a neighbour token's indices", "indices + (long long)token * N",
     "indices + (long long)(token / 2 * 2) * N", {"kind": "paged_prefill"}),
    ("merge counts seq_lens' partitions", "Cfg::SPARSE_TOPK, max_partitions", "seq_lens[blockIdx.y], max_partitions",
     {"attention.sparse_topk": 100}),
    ("last entry dropped", "k_begin = 0, k_end = N;", "k_begin = 0, k_end = N - 1;", {}),
]


@pytest.mark.parametrize("old,new,overrides", [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_verifier_rejects_mutant(old, new, overrides):
    spec = _spec(**overrides)
    config = {"partition_size": 32} if spec.kind == "paged_decode" else {}
    rendered = render(spec, _mma(config))
    source = inline_provided(rendered.source)  # the body as kernel code (a provided header)
    assert source.count(old) == 1, old
    kern = kernel_from_source(spec, source.replace(old, new), backend="cpu", config=rendered.config, archs=[])
    report = verify(kern, seed=99)
    assert not report.passed, report.summary()


def test_reference_gathers_by_indices():
    """The float64 golden against attention written out directly over the named rows: any order,
    repeats counted per occurrence, -1 skipped, a row with none: out 0, lse -inf."""
    spec = _spec(**{"kv_cache.block_size": 4, "attention.sparse_topk": 6})
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((5, 4, 576))
    q = rng.standard_normal((3, 16, 576))
    indices = np.asarray([[7, -1, 3, 7, 19, 0], [-1] * 6, [18, 2, -1, -1, 5, 5]], dtype=np.int32)
    ref = attention_reference(spec, q, {"kv_cache": pool, "indices": indices, "seq_lens": np.ones(3, np.int32)})
    flat = pool.reshape(-1, 576)
    for r in (0, 2):
        rows = flat[indices[r][indices[r] >= 0]]
        logits = q[r] @ rows.T * 0.1147
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        np.testing.assert_allclose(ref.out[r], (p / p.sum(axis=1, keepdims=True)) @ rows[:, :512], rtol=1e-12,
                                   atol=1e-12)
        np.testing.assert_allclose(ref.lse[r], np.log(np.exp(logits).sum(axis=1)), rtol=1e-12)
    assert np.all(ref.out[1] == 0) and np.all(np.isneginf(ref.lse[1]))


def test_cases_poison_every_unnamed_slot_and_name_the_traps():
    spec = _spec(**{"kv_cache.block_size": 8, "attention.sparse_topk": 24})
    rng = np.random.default_rng(5)
    args = make_sparse_case(spec, [21, 19], [1, 1], rng, [("edges", "duplicates"), ("edges",)], share_prefix=True)
    ind, pool = args["indices"], args["kv_cache"].reshape(-1, 576)
    named = np.zeros(pool.shape[0], bool)
    named[ind[ind >= 0]] = True
    assert np.isnan(pool[~named].astype(np.float32)).all(axis=1).all()
    assert np.isfinite(pool[named].astype(np.float32)).all()
    row0 = ind[0][ind[0] >= 0]
    assert len(row0) > len(set(row0.tolist()))  # a repeat
    assert (ind[1] == -1).sum() == 24 - 19  # 19 visible keys, each named once: the rest is padding
    # both sequences name slots of their shared first block
    assert set((ind[0][ind[0] >= 0] // 8).tolist()) & set((ind[1][ind[1] >= 0] // 8).tolist())


def test_draw_row_names_block_edges_and_the_last_visible_slot():
    rng = np.random.default_rng(1)
    table = np.asarray([7, 2, 5], dtype=np.int32)
    row = draw_row(8, 19, table, 8, rng, ("edges",))  # 19 keys: the last block holds 3
    slots = set(row[row >= 0].tolist())
    assert {7 * 8, 7 * 8 + 7, 2 * 8, 2 * 8 + 7, 5 * 8 + 2} <= slots
    tail = draw_row(8, 19, table, 8, rng, ("tail_padding",))
    valid = tail >= 0
    assert valid[0] and not valid[-1] and not np.any(valid[np.argmin(valid):])  # valid first, then -1
    assert np.all(draw_row(8, 19, table, 8, rng, ("empty",)) == -1)


def _call_args(spec, rng):
    args = make_sparse_case(spec, [20, 9], [1, 1], rng)
    args.pop("out", None)
    return args


@pytest.fixture(scope="module")
def sparse_decode():
    return kgen.build(_spec(), backend="cpu", verify=False, archs=[])


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(indices=a["indices"][:, :40]), r"indices: expected shape \[2, 48\] \(one row per query row, "
                                                       r"attention.sparse_topk 48 entries each\), got \[2, 40\]"),
    (lambda a: a.update(indices=a["indices"][:1]), r"indices: expected shape \[2, 48\]"),
    (lambda a: a.update(indices=a["indices"].astype(np.float32)), r"indices: expected dtype int32"),
    (lambda a: a["indices"].__setitem__((1, 3), -2), r"indices\[1, 3\] = -2: not a cache slot \(allowed: -1 for an "
                                                     r"unused entry, or block_id \* 16 \+ offset in 0\.\."),
    (lambda a: a["indices"].__setitem__((0, 0), a["kv_cache"].shape[0] * 16), r"indices\[0, 0\] = \d+: not a cache slot"),
    (lambda a: a.update(block_tables=np.zeros((2, 2), np.int32)), r"block_tables: a sparse kernel .* reads no block table"),
    (lambda a: a.pop("indices"), r"indices"),
])
def test_bad_indices_are_argument_errors(sparse_decode, change, message):
    args = _call_args(sparse_decode.spec, np.random.default_rng(2))
    change(args)
    with pytest.raises(ArgumentError, match=message):
        sparse_decode(**args)


def test_a_checked_call_accepts_the_last_slot_and_int64_indices(sparse_decode):
    args = _call_args(sparse_decode.spec, np.random.default_rng(3))
    args["kv_cache"][-1, -1] = 0.5  # named below: finite
    args["indices"][0, 0] = args["kv_cache"].shape[0] * 16 - 1
    out = sparse_decode(**{**args, "indices": args["indices"].astype(np.int64)})
    assert np.isfinite(np.asarray(out, dtype=np.float32)).all()


@pytest.mark.parametrize("text,line,message", [
    ("causal: true", 10, r"attention.causal: a sparse kernel has no causal mask"),
    ("sliding_window: 64", 10, r"attention.sliding_window: a sparse kernel has no window"),
])
def test_spec_refuses_causal_and_window_with_sparse_at_file_line(tmp_path, text, line, message):
    path = tmp_path / "s.yaml"
    path.write_text(f"""kgen: 1
name: s
kind: paged_prefill
attention:
  num_q_heads: 16
  num_kv_heads: 1
  head_dim: 576
  v_head_dim: 512
  softmax_scale: 0.1
  {text}
  sparse_topk: 64
kv_cache: {{block_size: 64, layout: mla, dtype: bf16}}
dtype: {{q: bf16}}
tail_masking: true
""")
    with pytest.raises(SpecError, match=rf"s.yaml:{line}: {message}"):
        kgen.load_spec(path)


def test_spec_refuses_sparse_on_other_layouts():
    spec = {**BASE, "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 128, "sparse_topk": 64},
            "kv_cache": {"block_size": 16, "layout": "separate", "dtype": "bf16"}}
    with pytest.raises(SpecError, match=r"attention.sparse_topk: token-level sparse attention is built for the mla "
                                        r"layout only \(got layout 'separate'; allowed: layout mla"):
        kgen.spec_from_dict(spec)


def test_a_dense_spec_keeps_its_hash_and_source():
    """sparse_topk left out: the canonical form (and so the hash and cache keys) of every existing spec is unchanged."""
    dense = {**BASE, "attention": {k: v for k, v in BASE["attention"].items() if k != "sparse_topk"}}
    spec = kgen.spec_from_dict(dense)
    assert "sparse_topk" not in spec.canonical()["attention"]
    source = render(spec, {"path": 1}).source  # the mma.sync body (on sm_90 a dense spec takes the Hopper one)
    assert "SPARSE_TOPK = 0;" in source and "paged_mla_decode_body<Cfg>" in source


def test_abi_text_takes_indices_in_place_of_the_block_table():
    text = abi_text(_spec(**{"attention.sparse_topk": 2048, "kv_cache.block_size": 64}))
    assert "indices            input   const int*           [num_seqs, 2048] int32" in text
    assert "block_tables" not in text and "max_blocks_per_seq" not in text
    assert "Call: kern(q, kv_cache, indices, seq_lens, out=None, return_lse=False)" in text
    prefill = abi_text(_spec(kind="paged_prefill"))
    assert "indices            input   const int*           [num_q_tokens, 48] int32" in prefill
    assert "grid (num_q_tokens, 1, 1)" in prefill


@pytest.mark.parametrize("overrides,config", [
    ({}, {}), ({"attention.num_q_heads": 128, "attention.sparse_topk": 2048, "kv_cache.block_size": 64},
               {"row_tiles": 2, "col_warps": 4, "partition_size": 512}),
    ({"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_token_head"}, {"partition_size": 64}),
    ({"kind": "paged_prefill", "attention.num_q_heads": 128, "attention.sparse_topk": 2048}, {"row_tiles": 2}),
], ids=["default", "v32-decode", "fp8-token-split", "v32-prefill"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_without_spills(overrides, config, arch):
    rendered = render(_spec(**overrides), _mma(config))
    for name, res in compile_cubin(rendered.source, arch).resources.items():
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (name, res)


def test_perf_model_reads_the_top_k_rows_not_the_context():
    """kgen/perf/mla_model.py on a sparse spec: a sequence's blocks read min(context, N) rows and compute
    over N entries, so past N tokens the context no longer matters, and at context N the estimate is the
    dense kernel's over N tokens."""
    from kgen.perf.mla_model import decode_estimate
    sparse = _spec(**{"attention.num_q_heads": 128, "attention.sparse_topk": 2048, "kv_cache.block_size": 64})
    dense = kgen.spec_from_dict({**BASE, "attention": {k: v for k, v in BASE["attention"].items()
                                                       if k != "sparse_topk"}}).with_overrides(
        **{"attention.num_q_heads": 128, "kv_cache.block_size": 64})
    cfg = {"row_tiles": 2, "col_warps": 4, "stages": 2, "partition_size": 0}
    at = {c: decode_estimate(sparse, cfg, 126, 64, c) for c in (2048, 4096, 32768)}
    assert at[4096].estimate.seconds == at[32768].estimate.seconds
    assert at[2048].estimate.seconds == pytest.approx(decode_estimate(dense, cfg, 126, 64, 2048).estimate.seconds)
    assert at[32768].estimate.seconds < decode_estimate(dense, cfg, 126, 64, 32768).estimate.seconds / 8
    short = decode_estimate(sparse, cfg, 126, 64, 1024)  # half the entries -1: half the rows, the same tiles
    assert short.tensor_fraction < at[4096].tensor_fraction


@pytest.mark.full  # ~2 min at 128 heads x top-2048; sparse prefill verifies by default in test_sparse_prefill_verifies_on_cpu
def test_bundled_v32_sparse_prefill_example_verifies_and_does_not_spill():
    from pathlib import Path
    spec = kgen.load_spec(Path(__file__).resolve().parents[3] / "specs" / "deepseek_v32_sparse_mla_prefill.yaml")
    assert (spec.attention.sparse_topk, spec.attention.num_q_heads, spec.kv_cache.block_size) == (2048, 128, 64)
    kern = kgen.build(spec, backend="cpu", archs=["sm_90"], seed=4242)
    assert kern.report.passed, kern.report.summary()
    for name, res in kern.resources["sm_90"].items():
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["registers"] > 0, (name, res)


# DeepSeek-V3.2's own combination: sparse attention over its fp8_ds_mla cache (656-byte rows whose
# unnamed slots the cases fill with NaN bytes in all three parts).
@pytest.mark.parametrize("kind,partition", [("paged_decode", 32), ("paged_prefill", 0)], ids=["decode-split", "prefill"])
def test_sparse_over_the_fp8_ds_mla_cache_verifies_on_cpu(kind, partition):
    spec = _spec(kind=kind, **{"kv_cache.dtype": "fp8_ds_mla", "attention.sparse_topk": 64})
    config = {"partition_size": partition} if kind == "paged_decode" else {}
    kern = kgen.build(spec, backend="cpu", verify=False, archs=[], config=_mma(config))
    report = verify(kern, seed=5)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note or "" for c in report.failed_cases)


def test_unnamed_fp8_ds_mla_slots_read_as_nan_and_named_ones_do_not():
    """The cases' poison reaches every part of a 656-byte row (a uint8 NaN cast would leave zeros)."""
    spec = _spec(**{"kv_cache.dtype": "fp8_ds_mla", "attention.sparse_topk": 64})
    args = make_sparse_case(spec, [40, 17], [1, 1], np.random.default_rng(3))
    k, _ = from_layout(spec, args)  # [N, B, 1, 576] real values
    flat = k.reshape(-1, k.shape[-1])
    named = np.zeros(flat.shape[0], dtype=bool)
    named[args["indices"][args["indices"] >= 0]] = True
    assert named.any() and (~named).any()
    assert np.isnan(flat[~named]).all()
    assert np.isfinite(flat[named]).all()
