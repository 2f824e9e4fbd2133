"""The adversarial matrix (docs/verification.md): each planted bug below hides from the classic
matrix (short contexts, small logits, packed q/out, tiny pools, no tripwires) and must be
caught by the case made for it, while cases that cannot see it still pass (the failure is the
right one). The mutants edit kgen's own rendered source, as a hand-written kernel would differ
from it, and run through the hand-written path (kernel_from_source)."""

from __future__ import annotations

import json
import resource

import numpy as np
import pytest
from conftest import full_tier_except, inline_provided, run_kgen

import kgen
from kgen.arrays import host_owner, to_backend, to_numpy
from kgen.families.attention.adversarial_cases import WRAP, build_pool_case
from kgen.families.attention.decode_cases import decode_case_matrix, matrix_cases
from kgen.families.attention.reference import attention_reference
from kgen.families.registry import family_for
from kgen.render import render
from kgen.verify.judge.bounds import check_output
from kgen.verify.judge.guards import broken_seals, check_guard, guarded, seal
from kgen.verify.judge.sparse import byte_ranges
from kgen.verify.runner import verify
from kgen.verify.untrusted.handwritten import kernel_from_source

BASE = {
    "kgen": 1, "name": "adv_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"],
}
SEED = 31337


def _spec(**overrides):
    return kgen.spec_from_dict(BASE).with_overrides(**overrides)


def _mutant(spec, old: str, new: str, config=None):
    """kgen's source for `spec` with one edit, as a hand-written kernel (softmax.cuh copied in, so
    its SoftmaxState can be edited too). Without a config the ABI's (decode: single pass, whose
    main kernel writes out and lse itself)."""
    r = render(spec, config or family_for(spec).abi_config(spec))
    source = inline_provided(r.source)
    assert source.count(old) == 1, f"mutation target not found exactly once: {old!r}"
    return kernel_from_source(spec, source.replace(old, new), backend="cpu", config=r.config, archs=[])


def _run(kernel, names: set[str]):
    """The report of the named cases only (an `_lse` row comes with its case)."""
    return verify(kernel, seed=SEED, cases=sorted({n.removesuffix("_lse") for n in names}))


OUT_WRITE = "out[row * o_s_row + (long long)h * o_s_head + d] = from_float<out_t>(x);"  # attention/epilogue.cuh
K_ROW = ("return k_cache + phys * k_s_block + kv_head * k_s_head + slot * k_s_token +\n"  # attention/kv_pool.cuh
         "           run_offset<Cfg::K_RUN>(d0, k_s_run) / PER;")
# the copier's K loop (V rows of their own width have a loop of their own)
KV_ROWS = "ksrc = pool.k_row(phys, kv_head, slot, d0);\n          vsrc = pool.v_row(phys, kv_head, slot, d0);"
LSE_WRITE = "lse[(long long)row * Cfg::NUM_Q_HEADS + h] = st.lse();"  # attention/epilogue.cuh
SCALES = "  // Per-tensor / per-head dequantisation scales (per-token ones and nvfp4's block scales come with each tile).\n"
WRITE_OUT = "  // Write out: the final output, or this partition's normalised partial and its (m, l).\n"
O_ACC = "for (int i = 0; i < VEC; ++i) o[h][c * VEC + i] += s[h][j] * vf[i];"
NTILES = "const int ntiles = tok_end > tok_begin ? (tok_end - tile0 + NT - 1) / NT : 0;"

# (id, spec overrides, config, old, new, cases that must fail, cases that must pass, words of the failure);
# the mutants edit the CUDA-core body (paged_decode.cuh) and the epilogue part it writes through
# (attention/epilogue.cuh: OUT_WRITE, LSE_WRITE, the partials): split configs pin it with mma_min_group 0
MUTANTS = [
    ("no_max_subtraction", {}, None, "    const float m_new = fmaxf(m, m_tile);\n    const float f = rescale(",
     "    const float m_new = 0.0f;\n    const float f = rescale(",
     {"large_logits"}, {"long", "mixed_batch", "mixed_batch_lse"}, ()),
    ("stops_at_512_tokens", {}, None, NTILES, NTILES.replace("(tok_end - tile0", "(min(tok_end, 512) - tile0"),
     {"long_uniform", "long_32k"}, {"long", "mixed_batch"}, ()),
    ("stops_at_32768_tokens", {}, None, NTILES, NTILES.replace("(tok_end - tile0", "(min(tok_end, 32768) - tile0"),
     {"long_32k"}, {"long_uniform", "long"}, ()),
    ("fp16_sum_accumulator", {}, None, "        l_part += p;",  # the transpose-reduce path's share of l
     "        l_part = __half2float(__float2half(l_part + p));", {"long_32k"}, {"len_1"}, ()),
    ("fp16_output_accumulator", {}, None, O_ACC,
     O_ACC.replace("o[h][c * VEC + i] += s[h][j] * vf[i];",
                   "o[h][c * VEC + i] = __half2float(__float2half(o[h][c * VEC + i] + s[h][j] * vf[i]));"),
     {"long_32k"}, {"len_1"}, ()),
    ("ignores_q_strides", {}, None, "q + seq * q_s_seq + (long long)(q_head0 + g) * q_s_head;",
     "q + ((long long)seq * Cfg::NUM_Q_HEADS + q_head0 + g) * Cfg::HEAD_DIM;",
     {"strided_q_out"}, {"long", "mixed_batch", "large_logits"}, ()),
    ("ignores_out_strides", {}, None, OUT_WRITE,
     OUT_WRITE.replace("row * o_s_row + (long long)h * o_s_head + d", "((long long)row * Cfg::NUM_Q_HEADS + h) * DV + d"),
     {"strided_q_out"}, {"long", "mixed_batch"}, ("outside 'out'",)),
    ("int32_pool_offsets", {}, None, K_ROW,
     K_ROW.replace("k_cache + phys", "k_cache + (int)(phys").replace("slot * k_s_token +", "slot * k_s_token) +"),
     {"huge_pool"}, {"long", "mixed_batch", "padded_pool"}, ()),
    ("writes_input_q", {}, None, SCALES,
     "  if (tid == 0) const_cast<typename Cfg::q_t*>(q)[seq * q_s_seq + (long long)q_head0 * q_s_head]"
     " = from_float<typename Cfg::q_t>(0.0f);\n" + SCALES,
     {"len_1", "long"}, set(), ("input 'q'",)),
    ("writes_input_k_cache_tail", {}, None, KV_ROWS,
     KV_ROWS + "\n          if (d0 == 0 && t == hi - 1 && slot + 1 < B) const_cast<kv_t*>(ksrc)[pool.k_s_token] = ksrc[0];",
     {"len_1", "len_B+1"}, {"len_B"}, ("input 'k_cache'",)),
    ("writes_past_out", {}, None, WRITE_OUT,
     "  if (!ep.split && tid == 0 && seq == (int)gridDim.y - 1 && kv_head == (int)gridDim.x - 1)\n"
     "    p.out[seq * p.o_s_seq + (long long)Cfg::NUM_Q_HEADS * p.o_s_head] = from_float<typename Cfg::out_t>(0.0f);\n"
     + WRITE_OUT,
     {"len_1", "long"}, set(), ("past the end of 'out'",)),
    ("lse_of_one_head_unwritten", {}, None, LSE_WRITE, f"if (h != 1) {LSE_WRITE}",
     {"mixed_batch_lse"}, {"mixed_batch"}, ("lse[",)),
    ("split_scratch_written_one_partition_late", {}, {"partition_size": 32, "mma_min_group": 0},
     "part_o[partial(row, h) * DV + d]", "part_o[(partial(row, h) + 1) * DV + d]",
     {"len_P+1"}, set(), ("outside 'part_o'",)),
    ("one_head_one_percent_off", {}, None, OUT_WRITE,
     OUT_WRITE.replace("from_float<out_t>(x)", "from_float<out_t>(x * (h == Cfg::NUM_Q_HEADS - 1 ? 1.01f : 1.0f))"),
     {"long", "mixed_batch"}, set(), ("head 7",)),
]


# By default every third mutant (0, 3, 6, ...); every one in the full tier.
@pytest.mark.parametrize("mid,overrides,config,old,new,must_fail,must_pass,words",
                         full_tier_except(MUTANTS, set(range(0, len(MUTANTS), 3))),
                         ids=[m[0] for m in MUTANTS])
def test_adversarial_case_catches_its_mutant(mid, overrides, config, old, new, must_fail, must_pass, words):
    spec = _spec(**overrides)
    report = _run(_mutant(spec, old, new, config), must_fail | must_pass)
    failed = {c.name: c for c in report.failed_cases}
    assert must_fail <= set(failed), f"{mid}: expected {sorted(must_fail)} to fail: {report.summary()}"
    assert not (must_pass & set(failed)), f"{mid}: {sorted(must_pass & set(failed))} cannot see this bug but failed"
    for word in words:
        assert word in report.summary(), report.summary()


def test_unmutated_kernel_passes_the_same_cases():
    """The cases of every mutant above pass on the unmutated source (same seed)."""
    names = set().union(*(m[5] | m[6] for m in MUTANTS if m[2] is None))
    report = _run(_mutant(_spec(), NTILES, NTILES), names)
    assert report.passed, report.summary()
    split = _run(_mutant(_spec(), NTILES, NTILES, {"partition_size": 32, "mma_min_group": 0}), {"len_1", "len_P+1", "long_32k"})
    assert split.passed, split.summary()


# ---- the matrix itself ------------------------------------------------------------------------
def test_matrix_has_the_adversarial_cases_with_drawn_shapes():
    spec = _spec()
    cases = {c.name: c for c in matrix_cases(spec, {"partition_size": 0}, np.random.default_rng(5))}
    assert {"strided_q_out", "large_logits", "long_uniform", "long_32k", "huge_pool"} <= set(cases)
    assert cases["long_uniform"].params["seq_lens"][0] >= 4096
    assert cases["long_32k"].params["seq_lens"][0] >= 32768
    # the same seed gives the same matrix; another seed other batch sizes and lengths
    again = {n: lens for n, lens, _ in decode_case_matrix(spec, {"partition_size": 0}, np.random.default_rng(5))}
    assert again == {n: cases[n].params["seq_lens"] for n in again}
    # the serving cases (kgen/families/attention/serving.py) replay from the seed too
    replay = {c.name: c.params["seq_lens"] for c in matrix_cases(spec, {"partition_size": 0}, np.random.default_rng(5))}
    assert replay == {n: c.params["seq_lens"] for n, c in cases.items()}
    other = {n: lens for n, lens, _ in decode_case_matrix(spec, {"partition_size": 0}, np.random.default_rng(6))}
    assert other["strided_q_out"] != again["strided_q_out"] and other["long_32k"] != again["long_32k"]


@pytest.mark.parametrize("overrides", [
    {},
    {"kv_cache.dtype": "fp8_e4m3", "kv_cache.scale": "per_head"},
    {"kv_cache.dtype": "int8", "kv_cache.scale": "per_token_head", "kv_cache.order": "HND"},
    {"kv_cache.layout": "fused", "kv_cache.dtype": "int8", "kv_cache.scale": "per_tensor"},
], ids=["fp16", "fp8-per-head", "int8-per-token-head", "fused-int8"])
def test_large_logits_reach_hundreds_through_the_scales(overrides):
    spec = _spec(**overrides)
    case = build_pool_case(spec, [40, 70], np.random.default_rng(2), "large")
    ref = attention_reference(spec, case.args["q"], case.args)
    assert np.all(np.abs(ref.lse) > 100), ref.lse  # exp of every logit overflows (or underflows) fp32
    assert np.all(np.isfinite(ref.out))
    assert np.any(ref.lse > 0) or np.any(ref.lse < 0)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_huge_pool_puts_the_blocks_past_2_32_elements_and_commits_only_them():
    spec = _spec()
    before = _resident_bytes()
    case = build_pool_case(spec, [300, 17], np.random.default_rng(3), "normal", huge=True)
    ref = attention_reference(spec, case.args["q"], case.args)  # gathers the used blocks only
    grown = _resident_bytes() - before
    pool = case.args["k_cache"]
    block = int(np.prod(pool.shape[1:]))
    assert pool.size > WRAP and int(case.args["block_tables"][:, :1].min()) * block >= WRAP  # 64-bit offsets
    assert pool.nbytes > 8 << 30 and grown < 64 << 20, f"{grown >> 20} MiB committed for a {pool.nbytes >> 30} GiB pool"
    assert np.all(np.isfinite(ref.out))
    lo, hi = case.sparse["k_cache"][0]  # the region a 32-bit offset wraps to holds poison
    assert np.isnan(pool.reshape(-1)[lo:hi:97].astype(np.float32)).all()


# ---- tripwires ----------------------------------------------------------------------------------
def test_guards_name_the_buffer_and_where_it_was_written():
    rng = np.random.default_rng(0)
    for where, words in (("before", "before the start of 'out'"), ("after", "past the end of 'out'"),
                         ("gap", "gap between rows of 'out'")):
        g = guarded("out", (2, 3, 8), np.float16, rng, pad=(0, 1, 8))
        assert check_guard(g, g.view) is None
        assert np.isnan(g.view.astype(np.float32)).all()  # pre-poisoned
        g.view[...] = 1.0  # writing the whole view touches no guard
        assert check_guard(g, g.view) is None
        raw = host_owner(g.view).reshape(-1).view(np.uint8)
        byte = {"before": g.start - 1, "after": g.end, "gap": g.start + 9 * 2}[where]  # element 9 of row 0
        raw[byte] ^= 0xFF
        assert words in (check_guard(g, g.view) or ""), where


def test_seals_name_a_changed_input_also_in_a_sparse_array():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4)).astype(np.float16)
    pool = np.zeros(1 << 12, np.float32)
    pool[100:200] = 1.0
    seals = [seal("q", q), seal("pool", pool, byte_ranges(pool, [(100, 200)]))]
    assert broken_seals(seals, {"q": q, "pool": pool}) == []
    pool[3000] = 5.0  # outside the written range of a sparse array: not read
    q[2, 3] += 1
    pool[150] = 2.0
    assert broken_seals(seals, {"q": q, "pool": pool}) == ["q", "pool"]


def test_one_wrong_head_cannot_hide_under_the_bound_of_the_others():
    """Rows of very different magnitude: an error far above the small row's own bound is far below
    what a single bound over all rows would allow."""
    rng = np.random.default_rng(4)
    ref = rng.standard_normal((1, 2, 32))
    ref[0, 1] *= 1e-3
    lowp = ref + 1e-3 * np.abs(ref) * rng.standard_normal(ref.shape)
    got = ref.copy()
    got[0, 1, 7] += 0.2 * np.max(np.abs(ref[0, 1]))  # 20% of that head's magnitude
    global_bound = 2 * np.max(np.abs(lowp - ref)) + np.max(np.abs(ref)) * 2e-3
    assert np.max(np.abs(got - ref)) < global_bound  # what one scalar bound per case let through
    r = check_output("two_heads", [50], got, ref, lowp, "fp16")
    assert not r.passed and (r.first_failure["head"], r.first_failure["dim"]) == (1, 7)


# ---- diagnostics --------------------------------------------------------------------------------
def test_cli_names_case_sequence_head_length_element_expected_and_got(tmp_path):
    spec_path = tmp_path / "adv.yaml"
    spec_path.write_text(json.dumps({**BASE, "name": "adv_cli"}))
    spec = kgen.load_spec(spec_path)
    src = inline_provided(render(spec, {"partition_size": 0, "mma_min_group": 0}).source)  # the body as kernel code
    assert src.count(OUT_WRITE) == 1
    src = src.replace(OUT_WRITE, OUT_WRITE.replace("from_float<out_t>(x)", "from_float<out_t>(x * (h == 5 ? 1.5f : 1.0f))"))
    (tmp_path / "k.cu").write_text(src)
    r = run_kgen("verify", str(spec_path), "--source", str(tmp_path / "k.cu"), "--backend", "cpu", "--seed", "5",
                 "--json")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["seed"] == 5
    first = next(c for c in report["cases"] if not c["passed"])
    f = first["first_failure"]
    assert f["case"] == first["name"] and f["head"] == 5 and f["output"] == "out"
    assert f["length"] == first["sizes"][f["sequence"]] and f["dim"] is not None
    assert abs(f["got"] - 1.5 * f["expected"]) <= 0.02 * abs(f["expected"]) + 1e-2
    assert "head 5" in first["failure"] and "expected" in first["failure"] and "length" in first["failure"]
    text = run_kgen("verify", str(spec_path), "--source", str(tmp_path / "k.cu"), "--backend", "cpu")
    assert text.returncode == 1 and "seed" in text.stdout and "head 5" in text.stdout


@pytest.mark.parametrize("decl_edit,call_edit,param,ctype", [
    (("int max_blocks_per_seq", "long long max_blocks_per_seq"), None, "max_blocks_per_seq", "`int`"),
    (("long long q_s_seq", "int q_s_seq"), None, "q_s_seq", "`long long`"),
    (("const float* __restrict__ k_scale", "int k_scale"), ("k_scale, v_scale", "(const float*)0, v_scale"),
     "k_scale", "`const float*`"),
    ((", long long vs_s_token)", ")"), ("vs_s_token\n  };", "0LL\n  };"), "vs_s_token", "`long long`"),  # Params' last
], ids=["scalar-widened", "stride-narrowed", "pointer-as-int", "last-missing"])
def test_wrong_signature_names_parameter_type_and_abi_version(tmp_path, decl_edit, call_edit, param, ctype):
    spec_path = tmp_path / "sig.yaml"
    spec_path.write_text(json.dumps({**BASE, "name": "adv_sig"}))
    src = render(kgen.load_spec(spec_path), {"partition_size": 0, "mma_min_group": 0}).source  # the ABI 1 launch
    start = src.index('extern "C"')
    end = src.index(") {", start) + 1  # the declaration of the kernel, then its body
    head, decl, body = src[:start], src[start:end], src[end:]
    assert decl.count(decl_edit[0]) == 1
    decl = decl.replace(*decl_edit)
    if call_edit:
        assert body.count(call_edit[0]) == 1
        body = body.replace(*call_edit)
    (tmp_path / "k.cu").write_text(head + decl + body)
    r = run_kgen("verify", str(spec_path), "--source", str(tmp_path / "k.cu"), "--backend", "cpu")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"'{param}'" in r.stderr and ctype in r.stderr and "ABI 1" in r.stderr and "k.cu" in r.stderr


# ---- the cache kinds: sealed inputs, guarded pools, shapes from the seed -----------------------
CACHE = {"kgen": 1, "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64},
         "kv_cache": {"block_size": 8, "layout": "separate", "order": "NHD", "dtype": "fp8_e4m3", "scale": "per_head"},
         "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"]}


@pytest.mark.parametrize("kind,old,new,case,words", [
    ("cache_write", "const long long blk = slot / Cfg::BLOCK_SIZE;",
     "const long long blk = token == (long long)gridDim.x - 1 ? num_slots / Cfg::BLOCK_SIZE : slot / Cfg::BLOCK_SIZE;",
     "sequence", "past the end of 'k_cache'"),  # the last token one block past the pool
    ("cache_write", "const int slot = slot_mapping[token];",
     "const int slot = slot_mapping[token];\n  __syncthreads();\n  if (threadIdx.x == 0 && slot >= 0) "
     "const_cast<int*>(slot_mapping)[token] = -1;", "sequence", "input 'slot_mapping'"),
    ("copy_blocks", "    copy_words<unsigned char>(src, dst, nbytes);\n  }\n}",
     "    copy_words<unsigned char>(src, dst, nbytes);\n  }\n  __syncthreads();\n  if (threadIdx.x == 0) "
     "const_cast<int*>(pairs)[2 * (long long)blockIdx.x + 1] = src_block;\n}", "one_layer", "input 'pairs'"),
], ids=["cache_write-past-pool", "cache_write-writes-slot-mapping", "copy_blocks-writes-pairs"])
def test_cache_kind_tripwires(kind, old, new, case, words):
    spec = kgen.spec_from_dict({**CACHE, "name": f"adv_{kind}", "kind": kind})
    report = verify(_mutant(spec, old, new), seed=SEED, cases=[case])
    assert not report.passed and words in report.summary(), report.summary()
    assert verify(_mutant(spec, old, old), seed=SEED, cases=[case]).passed


def test_cache_kind_shapes_follow_the_seed():
    for kind in ("cache_write", "copy_blocks"):
        spec = kgen.spec_from_dict({**CACHE, "name": f"adv_{kind}_shapes", "kind": kind})
        kern = kgen.build(spec, backend="cpu", verify=False, archs=[])
        runs = [verify(kern, seed=seed) for seed in (1, 1, 2)]
        assert all(r.passed for r in runs), [r.summary() for r in runs]
        sizes = [[c.sizes for c in r.cases] for r in runs]
        assert sizes[0] == sizes[1] and sizes[0] != sizes[2], (kind, sizes)


# ---- the CUDA backend: the same cases reach the kernel strided, guarded and sealed -------------
@pytest.mark.gpu
def test_to_backend_keeps_a_view_and_the_buffer_around_it():
    rng = np.random.default_rng(9)
    g = guarded("out", (3, 4, 16), np.float16, rng, pad=(1, 2, 8))
    dev = to_backend(g.view, "cuda")
    assert dev.shape == g.view.shape and dev.strides == g.view.strides
    assert np.array_equal(to_numpy(dev).view(np.uint16), g.view.view(np.uint16))
    assert check_guard(g, dev) is None  # the device copy holds the guards, unchanged
    dev[...] = 0  # writing the whole view through its strides leaves the guards alone
    assert check_guard(g, dev) is None
    cp = pytest.importorskip("cupy")
    whole = cp.ndarray((g.initial.size,), cp.uint8, cp.cuda.MemoryPointer(dev.data.mem, 0))  # the device buffer
    whole[g.start - 1] = whole[g.start - 1] ^ 0xFF  # the guard byte just before the view
    assert "before the start of 'out'" in (check_guard(g, dev) or "")


@pytest.mark.gpu
def test_cuda_backend_runs_the_adversarial_cases_and_catches_ignored_out_strides():
    spec = _spec()
    names = {"strided_q_out", "large_logits", "huge_pool", "long_uniform"}
    good = verify(kgen.build(spec, backend="cuda", verify=False), seed=SEED, cases=sorted(names))
    assert good.passed, good.summary()
    r = render(spec, {"mma_min_group": 0})  # OUT_WRITE: the epilogue part the CUDA-core body writes through
    bad_src = inline_provided(r.source).replace(OUT_WRITE, OUT_WRITE.replace("row * o_s_row + (long long)h * o_s_head + d",
                                                            "((long long)row * Cfg::NUM_Q_HEADS + h) * DV + d"))
    bad = verify(kernel_from_source(spec, bad_src, backend="cuda", config=r.config), seed=SEED, cases=["strided_q_out"])
    assert not bad.passed and "outside 'out'" in bad.summary(), bad.summary()
