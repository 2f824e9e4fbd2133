"""One argument table per family: the kernel declarations of the generated source, of `kgen abi`
and the launcher's packing all come from it. The declarations must stay those of ABI 1 (the
parameter lists below are copied from the templates written by hand before the table existed),
and a kernel written from `kgen abi` output alone must compile with NVRTC and run."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import kgen
from kgen.abi import abi_text
from kgen.families.argtable import KernelDecl, pack, scalar, stride
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.formats.dtypes import dtype
from kgen.render import render
from kgen.verify.untrusted.handwritten import kernel_from_source

ROOT = Path(__file__).resolve().parents[2]

# ABI 1, as the hand-written templates spelled it (Cfg:: types are the spec's dtypes).
OLD = {
    "paged_decode": """
    Cfg::out_t* __restrict__ out, const Cfg::q_t* __restrict__ q, const Cfg::kv_t* __restrict__ k_cache,
    const Cfg::kv_t* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const float* __restrict__ alibi_slopes,
    float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ lse, int max_blocks_per_seq,
    int max_partitions, long long q_s_seq, long long q_s_head, long long o_s_seq, long long o_s_head,
    long long k_s_block, long long k_s_head, long long k_s_token, long long k_s_run, long long v_s_block,
    long long v_s_head, long long v_s_token, long long v_s_run, long long ks_s_block, long long ks_s_head,
    long long ks_s_token, long long vs_s_block, long long vs_s_head, long long vs_s_token""",
    "paged_decode_merge": """
    Cfg::out_t* __restrict__ out, const float* __restrict__ part_o, const float* __restrict__ part_ml,
    float* __restrict__ lse, const int* __restrict__ seq_lens, int max_partitions, long long o_s_seq,
    long long o_s_head""",
    "cache_write": """
    const Cfg::in_t* __restrict__ key, const Cfg::in_t* __restrict__ value, Cfg::kv_t* __restrict__ k_cache,
    Cfg::kv_t* __restrict__ v_cache, float* __restrict__ k_scale, float* __restrict__ v_scale,
    const int* __restrict__ slot_mapping, long long num_slots, long long key_s_tok, long long key_s_head,
    long long val_s_tok, long long val_s_head, long long k_s_block, long long k_s_head, long long k_s_token,
    long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token, long long v_s_run,
    long long ks_s_block, long long ks_s_head, long long ks_s_token, long long vs_s_block, long long vs_s_head,
    long long vs_s_token""",
    "copy_blocks": "const long long* __restrict__ planes, const int* __restrict__ pairs",
    # prefill and MLA, as ABI 1's `kgen abi` printed them (docs/abi.md sections 7 and 8)
    "paged_prefill": """
    Cfg::out_t* __restrict__ out, const Cfg::q_t* __restrict__ q, const Cfg::kv_t* __restrict__ k_cache,
    const Cfg::kv_t* __restrict__ v_cache, const int* __restrict__ q_indptr, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    const float* __restrict__ alibi_slopes, float* __restrict__ part_o, float* __restrict__ part_ml,
    float* __restrict__ lse, int num_seqs, int max_blocks_per_seq, int max_partitions, long long q_s_tok,
    long long q_s_head, long long o_s_tok, long long o_s_head, long long k_s_block, long long k_s_head,
    long long k_s_token, long long k_s_run, long long v_s_block, long long v_s_head, long long v_s_token,
    long long v_s_run, long long ks_s_block, long long ks_s_head, long long ks_s_token, long long vs_s_block,
    long long vs_s_head, long long vs_s_token""",
    "paged_prefill_merge": """
    Cfg::out_t* __restrict__ out, const float* __restrict__ part_o, const float* __restrict__ part_ml,
    float* __restrict__ lse, const int* __restrict__ q_indptr, const int* __restrict__ seq_lens, int num_seqs,
    int max_partitions, int partition_tokens, long long o_s_tok, long long o_s_head""",
    "mla_decode": """
    Cfg::out_t* __restrict__ out, const Cfg::q_t* __restrict__ q, const Cfg::kv_t* __restrict__ kv_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const float* __restrict__ kv_scale,
    float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ lse, int max_blocks_per_seq,
    int max_partitions, long long q_s_seq, long long q_s_head, long long o_s_seq, long long o_s_head,
    long long kv_s_block, long long kv_s_token, long long ks_s_block, long long ks_s_token""",
    "mla_decode_merge": """
    Cfg::out_t* __restrict__ out, const float* __restrict__ part_o, const float* __restrict__ part_ml,
    float* __restrict__ lse, const int* __restrict__ seq_lens, int max_partitions, int partition_tokens,
    long long o_s_seq, long long o_s_head""",
    "mla_prefill": """
    Cfg::out_t* __restrict__ out, const Cfg::q_t* __restrict__ q, const Cfg::kv_t* __restrict__ kv_cache,
    const int* __restrict__ q_indptr, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ kv_scale, float* __restrict__ lse, int num_seqs, int max_blocks_per_seq,
    long long q_s_tok, long long q_s_head, long long o_s_tok, long long o_s_head, long long kv_s_block,
    long long kv_s_token, long long ks_s_block, long long ks_s_token""",
}

SPECS = [  # (spec file, overrides, config)
    ("llama3_8b_decode.yaml", {}, {"partition_size": 0}),
    ("llama3_8b_decode.yaml", {}, {"partition_size": 256, "threads": 256}),
    ("llama3_8b_decode.yaml", {"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "dtype.q": "bf16",
                               "dtype.out": "fp32"}, None),
    ("decode_vllm_layout.yaml", {}, {"partition_size": 512}),
    ("llama3_8b_decode.yaml", {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head", "kv_cache.layout": "fused",
                               "targets": ["sm_90"]}, None),
    ("cache_write_fp8_e4m3.yaml", {}, None),
    ("cache_write_fp8_e4m3.yaml", {"kv_cache.dtype": "int8", "kv_cache.layout": "vllm", "kv_cache.order": None,
                                   "kv_cache.scale": "per_token_head", "dtype.q": "fp32"}, {"threads": 64}),
    ("copy_blocks_fp16.yaml", {}, None),
]


def _spec(path, overrides):
    spec = kgen.load_spec(ROOT / "specs" / path)
    return spec.with_overrides(**overrides) if overrides else spec


def _declarations(source: str) -> dict[str, tuple[int, str]]:
    """{kernel name: (launch bounds, parameter list with whitespace normalised)} of a source."""
    found = re.findall(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\)', source)
    return {name: (int(bounds), " ".join(params.split())) for bounds, name, params in found}


def _bounded_declarations(source: str) -> dict[str, tuple[str, str]]:
    """{kernel name: (its bound, e.g. "__maxnreg__(232)", parameter list with whitespace normalised)}."""
    found = re.findall(r'extern "C" __global__ void (__\w+__\(\d+\)) (\w+)\(([^)]*)\)', source)
    return {name: (bound, " ".join(params.split())) for bound, name, params in found}


def _old(key: str, spec) -> str:
    ctypes = {"Cfg::out_t": spec.dtype.resolved_out, "Cfg::q_t": spec.dtype.q, "Cfg::in_t": spec.dtype.q,
              "Cfg::kv_t": spec.kv_cache.dtype}
    text = re.sub(r"Cfg::\w+", lambda m: dtype(ctypes[m.group(0)]).ctype, OLD[key])
    return " ".join(text.split())


@pytest.mark.parametrize("path,overrides,config", SPECS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(SPECS)])
def test_generated_declarations_are_abi_1(path, overrides, config):
    spec = _spec(path, overrides)
    rendered = render(spec, config)
    got = _declarations(rendered.source)
    threads = family_for(spec).kernels(spec, rendered.config)[0].block  # config threads; the decode tensor-core
    assert threads == rendered.config["threads"] or "TENSOR_CORES = true;" in rendered.source  # body may use fewer
    want = {spec.name: (threads, _old(spec.kind, spec))}
    if rendered.config.get("partition_size"):
        # kgen's split-KV configs (not the ABI 1 launch) also take the plan's partition size
        want[spec.name] = (threads, want[spec.name][1] + ", int partition_tokens")
        want[f"{spec.name}_merge"] = (128, _old("paged_decode_merge", spec).replace(
            "int max_partitions,", "int max_partitions, int partition_tokens,"))
    assert got == want


@pytest.mark.parametrize("path,overrides,config", SPECS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(SPECS)])
def test_abi_text_declares_what_kgen_generates(path, overrides, config):
    spec = _spec(path, overrides)
    family = family_for(spec)
    abi_config = resolve_config(family, spec, family.abi_config(spec))
    text = abi_text(spec)
    assert "abi: 1" in text
    assert _declarations(text) == _declarations(render(spec, abi_config).source)
    for arg in family.arguments(spec, abi_config):  # every parameter is listed with its role, type and shape
        assert re.search(rf"^ \*   {arg.name} +{arg.role} +{re.escape(arg.ctype)} ", text, re.M), arg.name
    for kernel in family.kernels(spec, abi_config):
        assert f"{kernel.name}: {kernel.geometry()}" in text


# Prefill and MLA: (spec, overrides, OLD key of the main kernel, its ABI 1 bound); sinks, where a spec has
# them, follow alibi_slopes (docs/abi.md, section 3).
PREFILL_MLA = [
    ("llama3_8b_prefill.yaml", {}, "paged_prefill", "__maxnreg__(232)"),
    ("prefill_fp8_e4m3.yaml", {}, "paged_prefill", "__maxnreg__(232)"),
    ("gpt_oss_20b_prefill.yaml", {}, "paged_prefill", "__maxnreg__(232)"),
    ("llama3_8b_prefill.yaml", {"targets": ["sm_80"]}, "paged_prefill", "__maxnreg__(232)"),  # one launch, any arch
    ("deepseek_v3_mla_decode.yaml", {}, "mla_decode", "__launch_bounds__(256)"),
    ("deepseek_v3_mla_prefill.yaml", {}, "mla_prefill", "__launch_bounds__(256)"),
]


def _old_with_sinks(key: str, spec) -> str:
    old = _old(key, spec)
    return old.replace("alibi_slopes,", "alibi_slopes, const float* __restrict__ sinks,") if spec.attention.sinks \
        else old


@pytest.mark.parametrize("path,overrides,key,bound", PREFILL_MLA, ids=[f"{p}-{i}" for i, (p, *_) in
                                                                        enumerate(PREFILL_MLA)])
def test_prefill_and_mla_declarations_are_abi_1(path, overrides, key, bound):
    """The ABI 1 launch (the ABI config) of prefill and MLA specs declares the hand-written lists, and
    kgen's split-KV config adds partition_tokens and the merge kernel of ABI 1's shape."""
    spec = _spec(path, overrides)
    family = family_for(spec)
    abi = resolve_config(family, spec, family.abi_config(spec))
    assert _bounded_declarations(render(spec, abi).source) == {spec.name: (bound, _old_with_sinks(key, spec))}
    assert _bounded_declarations(abi_text(spec)) == {spec.name: (bound, _old_with_sinks(key, spec))}
    default = resolve_config(family, spec, None)
    if default.get("partition_size"):
        got = _bounded_declarations(render(spec, default).source)
        merge = _old(f"{key}_merge", spec)
        if spec.attention.sinks:
            merge = merge.replace("part_ml,", "part_ml, const float* __restrict__ sinks,")
        assert got[f"{spec.name}_merge"] == ("__launch_bounds__(128)", merge)
        assert got[spec.name][1] == _old_with_sinks(key, spec) + ", int partition_tokens"


# MLA prefill's split form (kgen's split-KV configs; the ABI 1 launch above stays single-pass): the
# scratch rows and max_partitions where decode and dense prefill have them, partition_tokens last, and
# dense prefill's merge kernel.
MLA_PREFILL_SPLIT = """
    Cfg::out_t* __restrict__ out, const Cfg::q_t* __restrict__ q, const Cfg::kv_t* __restrict__ kv_cache,
    const int* __restrict__ q_indptr, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ kv_scale, float* __restrict__ part_o, float* __restrict__ part_ml,
    float* __restrict__ lse, int num_seqs, int max_blocks_per_seq, int max_partitions, long long q_s_tok,
    long long q_s_head, long long o_s_tok, long long o_s_head, long long kv_s_block, long long kv_s_token,
    long long ks_s_block, long long ks_s_token, int partition_tokens"""


def test_mla_prefill_split_form_declares_the_scratch_and_dense_prefills_merge():
    spec = _spec("deepseek_v3_mla_prefill.yaml", {})
    family = family_for(spec)
    config = resolve_config(family, spec, {"partition_size": 64})
    got = _bounded_declarations(render(spec, config).source)
    main = " ".join(re.sub(r"Cfg::\w+", lambda m: {"Cfg::out_t": "__nv_bfloat16", "Cfg::q_t": "__nv_bfloat16",
                                                    "Cfg::kv_t": "__nv_bfloat16"}[m.group(0)],
                           MLA_PREFILL_SPLIT).split())
    assert got == {spec.name: ("__launch_bounds__(256)", main),
                   f"{spec.name}_merge": ("__launch_bounds__(128)", _old("paged_prefill_merge", spec))}
    geometry = [k.geometry() for k in family.kernels(spec, config)]
    assert geometry == ["grid (q_row_blocks, num_seqs, max_partitions), block (256), dynamic shared memory 192512 bytes",
                        "grid (128, num_q_tokens, 1), block (128), dynamic shared memory 0 bytes"]


PINS = ROOT / "tests" / "families" / "abi1_launches.txt"


def _pinned() -> dict[str, str]:
    """{spec stem: its section of abi1_launches.txt}."""
    sections = PINS.read_text().split("\n## ")[1:]
    return {s.split("\n", 1)[0]: s.split("\n", 1)[1].strip() for s in sections}


def test_the_pins_cover_every_bundled_spec():
    assert sorted(_pinned()) == sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))


@pytest.mark.parametrize("stem", sorted(p.stem for p in (ROOT / "specs").glob("*.yaml")))
def test_abi_1_launch_of_every_bundled_spec_is_unchanged(stem):
    """Byte for byte: each kernel of the ABI config, its declaration and launch geometry, as pinned when
    ABI 1's body calls moved to templates/abi1/ (decode, prefill, MLA, cache_write, copy_blocks)."""
    spec = kgen.load_spec(ROOT / "specs" / f"{stem}.yaml")
    family = family_for(spec)
    config = resolve_config(family, spec, family.abi_config(spec))
    now = "\n".join(f"{k.declaration()};\n// {k.name}: {k.geometry()}" for k in family.kernels(spec, config))
    assert now == _pinned()[stem]


def test_abi_text_names_lse_and_the_split_scratch_with_shapes():
    text = abi_text(kgen.load_spec(ROOT / "specs" / "decode_split_kv_long.yaml"))
    for row in ("lse                output  float*               [num_seqs, 32] fp32 (may be null)",
                "part_o             scratch float*               [num_seqs, 32, max_partitions, 128] fp32",
                "part_ml            scratch float*               [num_seqs, 32, max_partitions, 2] fp32",
                "k_cache            input   const __nv_bfloat16* [num_blocks, 16, 8, 128] bf16"):
        assert row in text, row
    # the contract is the single-pass launch even when the spec's default config splits
    assert "decode_split_kv_long: grid (8, num_seqs, 1), block (128), dynamic shared memory 2048 bytes" in text
    assert "_merge" not in text


def test_merge_kernel_reads_the_scratch_its_partner_writes():
    spec = kgen.load_spec(ROOT / "specs" / "decode_split_kv_long.yaml")
    family = family_for(spec)
    main, merge = family.kernels(spec, resolve_config(family, spec, None))
    rows = {a.name: a for a in main.params}
    assert rows["part_o"].ctype == "float*" and rows["part_o"].role == "scratch"
    merged = {a.name: a for a in merge.params}
    assert merged["part_o"].ctype == "const float*" and merged["part_o"].role == "input"
    assert set(merged) <= set(rows)  # one table: the merge kernel takes rows of it
    assert main.grid == (8, "num_seqs", "max_partitions") and merge.grid == (32, "num_seqs", 1)


def test_pack_follows_the_declaration_and_refuses_a_missing_value():
    decl = KernelDecl("k", (scalar("n", "int32", ""), stride("s", ""), scalar("m", "int64", "")), ("n", 2, 1), 64)
    launch = decl.launch({"n": 5}, {"m": 7, "s": 3, "n": 1, "unused": 9})
    assert launch.args == [1, 3, 7] and [type(a) for a in launch.args] == [np.int32, np.int64, np.int64]
    assert launch.grid == (5, 2, 1) and launch.block == (64, 1, 1)
    with pytest.raises(KeyError, match="no launch value for parameter"):
        pack(decl.params, {"n": 1})


# A kernel body written against the parameter names of `kgen abi` only: out = q (through the
# strides), lse = seq_len. Run on the CPU backend, it shows the launcher packs pointers, strides
# and lengths into the positions the printed declaration gives them.
BODY = """ {
  const int group = %(G)d, d_model = %(D)d;
  const int seq = blockIdx.y;
  for (int i = threadIdx.x; i < group * d_model; i += blockDim.x) {
    const int h = blockIdx.x * group + i / d_model, d = i %% d_model;
    out[seq * o_s_seq + h * o_s_head + d] = q[seq * q_s_seq + h * q_s_head + d];
    if (lse != nullptr && d == 0) lse[seq * %(Hq)d + h] = (float)seq_lens[seq];
  }
}
"""


def test_kernel_written_from_abi_text_alone_compiles_and_runs():
    spec = kgen.load_spec(ROOT / "specs" / "llama3_8b_decode.yaml").with_overrides(
        name="from_abi", **{"attention.num_q_heads": 8, "attention.num_kv_heads": 2, "attention.head_dim": 64})
    text = abi_text(spec)
    (declaration,) = re.findall(r'extern "C" __global__[^;]*;', text)
    source = text + "\n" + declaration[:-1] + BODY % {"G": 4, "D": 64, "Hq": 8}
    # archs: NVRTC compiles it for a GPU arch (no GPU needed); backend cpu runs the same text
    kern = kernel_from_source(spec, source, backend="cpu", archs=["sm_90"])
    assert kern.resources["sm_90"]["from_abi"]["registers"] > 0
    args = make_decode_case(spec, [5, 17, 40], np.random.default_rng(0))
    padded = np.zeros((3, 8, 72), args["q"].dtype)  # q rows 72 apart: its strides are not out's
    padded[..., :64] = args["q"]
    args["q"] = padded[..., :64]
    out, lse = kern(**args, return_lse=True)
    np.testing.assert_array_equal(out, args["q"])
    np.testing.assert_array_equal(lse, np.repeat([[5.0], [17.0], [40.0]], 8, axis=1))
