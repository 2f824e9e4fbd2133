"""The launch contract against the cubin (kgen/compile/launch_contract.py): for every bundled spec
and every kernel in it, what the CUDA launcher packs equals the cubin's parameter table
(cuobjdump -elf) and the launch fits the arch; a hand-written kernel whose parameters differ is
refused by kgen verify --source with the kernel, the ordinal and expected vs actual."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kgen.bodies import spec_for_arch
from kgen.build import compile_cubins
from kgen.compile.launch_contract import (
    CubinKernel,
    Param,
    contract_problems,
    cubin_kernels,
    cuobjdump,
    launcher_params,
    param_problems,
    parse_elf_listing,
)
from kgen.compile.nvrtc import compile_cubin
from kgen.errors import KgenUserError
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.render import Rendered, render
from kgen.spec.models import load_spec
from kgen.verify.untrusted import handwritten
from kgen.verify.untrusted.handwritten import kernel_from_source
from kgen.verify.untrusted.source_policy import prepare_source

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
ABI1 = ROOT / "tests" / "verify" / "fixtures" / "llama3_8b_decode_abi1.cu"
needs_cuobjdump = pytest.mark.skipif(cuobjdump() is None, reason="the nvidia-cuda-cuobjdump wheel (test extra) "
                                                                 "is not installed: pip install -e '.[test]'")


def _configs(spec) -> list[dict]:
    """The default config (split-KV kinds: main + merge kernel) and the ABI's (single pass), when different."""
    family = family_for(spec)
    default, abi = resolve_config(family, spec, None), resolve_config(family, spec, family.abi_config(spec))
    return [default] + ([abi] if abi != default else [])


@needs_cuobjdump
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_bundled_spec_keeps_its_launch_contract(path):
    spec = load_spec(path)
    family = family_for(spec)
    for config in _configs(spec):
        cubins = compile_cubins(spec, render(spec, config))  # each target's own body
        assert set(cubins) == set(spec.targets)
        assert contract_problems(spec, config, cubins, bodies=True) == []
        for arch, art in cubins.items():  # it compared something: every kernel, every parameter
            table = cubin_kernels(art.cubin)
            for decl in family.kernels(spec_for_arch(spec, arch), config):
                assert [(p.ordinal, p.offset, p.size) for p in table[decl.name].params] == \
                       [(p.ordinal, p.offset, p.size) for p in launcher_params(spec, decl)]


LISTING = """
.nv.info.k
\t<0x1>
\tAttribute:\tEIATTR_KPARAM_INFO
\tFormat:\tEIFMT_SVAL
\tValue:\tIndex : 0x0\tOrdinal : 0x1\tOffset  : 0x8\tSize    : 0x4
\t<0x2>
\tAttribute:\tEIATTR_KPARAM_INFO
\tFormat:\tEIFMT_SVAL
\tValue:\tIndex : 0x0\tOrdinal : 0x0\tOffset  : 0x0\tSize    : 0x8
\t<0x3>
\tAttribute:\tEIATTR_CBANK_PARAM_SIZE
\tFormat:\tEIFMT_HVAL
\tValue:\t0xc

.nv.info.other
"""


def test_the_elf_listing_is_read_by_ordinal():
    table = parse_elf_listing(LISTING)
    assert table["k"] == CubinKernel((Param(0, 0, 8), Param(1, 8, 4)), 12)
    assert table["other"].params == ()


def test_a_mismatch_names_the_kernel_the_ordinal_and_both_sides():
    ours = (Param(0, 0, 8, 8, "out"), Param(1, 8, 8, 8, "seq_lens"), Param(2, 16, 4, 4, "n"))
    theirs = CubinKernel((Param(0, 0, 8), Param(1, 8, 4)), 12)
    assert param_problems("k", "sm_90", ours, theirs) == [
        "kernel 'k' (sm_90 cubin): the launcher packs 3 arguments, the cubin's kernel takes 2 parameters",
        "kernel 'k' (sm_90 cubin): parameter ordinal 1 'seq_lens': expected 8 bytes at offset 8 (what the launcher "
        "packs), the cubin has 4 bytes at offset 8",
        "kernel 'k' (sm_90 cubin): parameter ordinal 2 'n': the launcher packs 4 bytes at offset 16, the cubin has "
        "no such parameter",
    ]


@needs_cuobjdump
def test_shared_memory_past_the_opt_in_limit_breaks_the_contract(monkeypatch):
    spec = load_spec(ROOT / "specs" / "copy_blocks_fp16.yaml")
    family = family_for(spec)
    config = resolve_config(family, spec, None)
    cubins = {"sm_80": compile_cubin(render(spec, config).source, "sm_80")}
    real = family.kernels
    monkeypatch.setattr(family, "kernels", lambda s, c: [replace(d, smem=170 * 1024) for d in real(s, c)])
    problems = contract_problems(spec, config, cubins)
    assert len(problems) == 1 and "copy_blocks_fp16" in problems[0]
    assert f"> {163 * 1024}, the arch's opt-in limit per block" in problems[0]


def _abi1_with(old: str, new: str, text: str | None = None) -> str:
    text = text or ABI1.read_text()
    assert text.count(old) == 1
    return text.replace(old, new)


def _source_problems(spec, text: str) -> list[str]:
    """The contract of a hand-written source's sm_90 cubin, compiled as kgen verify --source does."""
    family = family_for(spec)
    config = resolve_config(family, spec, family.abi_config(spec))
    rendered = Rendered(prepare_source(text, "mine.cu").text, family.kernel_names(spec, config), config)
    return contract_problems(spec, config, compile_cubins(spec, rendered, ["sm_90"]))


@needs_cuobjdump
def test_a_source_taking_an_int_where_the_launcher_packs_a_pointer_is_refused(monkeypatch):
    """kgen verify --source: on the CPU backend the shim's parameter types catch it first; a CUDA
    module reports none (check_signature passes it), and the cubin's contract refuses it."""
    spec = load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")
    text = _abi1_with("v_cache, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,",
                      "v_cache, const int* __restrict__ block_tables, int seq_lens_word,")
    text = _abi1_with("block_tables, seq_lens, k_scale, v_scale, alibi_slopes,\n                               part_o",
                      "block_tables, reinterpret_cast<const int*>(static_cast<long long>(seq_lens_word)), k_scale, "
                      "v_scale, alibi_slopes,\n                               part_o", text)
    monkeypatch.setattr(handwritten, "check_signature", lambda *args: None)  # as for a CUDA module
    with pytest.raises(KgenUserError) as e:
        kernel_from_source(spec, text, backend="cpu", archs=["sm_90"], origin="mine.cu")
    message = str(e.value)
    assert message.startswith("mine.cu: the compiled kernel does not take the arguments kgen launches it with "
                              "under kgen ABI 1")
    assert ("kernel 'llama3_8b_decode' (sm_90 cubin): parameter ordinal 5 'seq_lens' (`const int*` under kgen ABI 1): "
            "expected 8 bytes at offset 40 (what the launcher packs), the cubin has 4 bytes at offset 40") in message


@needs_cuobjdump
def test_a_source_with_one_parameter_fewer_is_refused():
    spec = load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")
    text = _abi1_with("long long vs_s_head, long long vs_s_token) {\n  kgen::paged_decode_body",
                      "long long vs_s_head) {\n  kgen::paged_decode_body")
    text = _abi1_with("vs_s_block, vs_s_head,\n                               vs_s_token);\n}",
                      "vs_s_block, vs_s_head,\n                               0LL);\n}", text)
    problems = _source_problems(spec, text)
    assert problems[0] == ("kernel 'llama3_8b_decode' (sm_90 cubin): the launcher packs 32 arguments, the cubin's "
                           "kernel takes 31 parameters")
    assert problems[1].startswith("kernel 'llama3_8b_decode' (sm_90 cubin): parameter ordinal 31 'vs_s_token' "
                                  "(`long long` under kgen ABI 1): the launcher packs 8 bytes at offset ")
    assert len(problems) == 2


ABI1_PREFILL = ROOT / "tests" / "verify" / "corpus" / "llama3_8b_prefill" / "original.cu"


@needs_cuobjdump
def test_an_abi1_prefill_source_keeps_its_contract_through_the_abi1_wrapper():
    """A source written against ABI 1 (`#include "kgen/paged_prefill.cuh"`, the positional
    kgen::paged_prefill_body call) reaches kgen's internal body through templates/abi1/ and still
    takes exactly what the launcher packs."""
    spec = load_spec(ROOT / "specs" / "llama3_8b_prefill.yaml")
    text = ABI1_PREFILL.read_text()
    assert '#include "kgen/paged_prefill.cuh"' in text and "kgen::paged_prefill_body<Cfg>(\n      out, q," in text
    assert _source_problems(spec, text) == []
    broken = text.replace("long long vs_s_head, long long vs_s_token) {", "long long vs_s_head) {").replace(
        "vs_s_head, vs_s_token);", "vs_s_head, 0LL);")
    assert _source_problems(spec, broken)[0].endswith("the launcher packs 34 arguments, the cubin's kernel takes "
                                                      "33 parameters")
