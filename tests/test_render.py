"""Rendering: thin per-spec config over shared device headers, StrictUndefined, configs."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest

from kgen.bodies import spec_for_arch
from kgen.compile.provided import ABI1_HEADERS
from kgen.errors import KgenUserError, UnsupportedError
from kgen.families.registry import family_for
from kgen.render import _environment, render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama():
    return load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")


def test_config_constants_come_from_the_spec(llama):
    src = render(llama).source
    for line in ("NUM_Q_HEADS = 32;", "NUM_KV_HEADS = 8;", "GROUP = 4;", "HEAD_DIM = 128;", "BLOCK_SIZE = 16;",
                 "TAIL_MASK = true;", "typedef __half kv_t;"):
        assert line in src, line
    # fp16 cache, group 4 < mma_min_group 8 (auto): the CUDA-core body; from 4 heads on request, the
    # tensor-core body on two of the 128 threads' warps (two 32-token stages fit)
    tensor = render(llama, {"mma_min_group": 4}).source
    assert "TENSOR_CORES = true;" in tensor
    assert 'extern "C" __global__ void __launch_bounds__(64) llama3_8b_decode(' in tensor
    cuda_cores = src
    assert "TENSOR_CORES = false;" in cuda_cores
    assert 'extern "C" __global__ void __launch_bounds__(128) llama3_8b_decode(' in cuda_cores


def test_source_includes_cuda_and_kgen_provided_headers_only(llama):
    """The source is not self-contained: it includes CUDA's own number-format headers and kgen's
    provided headers (which both compilers resolve to kgen's copies: docs/abi.md), nothing else;
    the body too is a provided header (kgen/bodies/), the one way bodies reach a source."""
    common = ["cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h", "kgen/async_copy.cuh", "kgen/bodies/paged_decode.cuh",
              "kgen/convert.cuh", "kgen/platform.cuh", "kgen/softmax.cuh"]
    src = render(llama).source  # fp16 group 4: the CUDA-core body (mma_min_group auto)
    assert sorted(re.findall(r"#include\s*[<\"]([^>\"]+)", src)) == common
    assert "kgen::paged_decode_body<Cfg>(p);" in src and "void paged_decode_body(" not in src
    tensor = render(llama, {"mma_min_group": 4}).source  # the tensor-core body needs mma.cuh too
    assert sorted(re.findall(r"#include\s*[<\"]([^>\"]+)", tensor)) == sorted(
        [*common, "kgen/mma.cuh", "kgen/bodies/paged_decode_mma.cuh"])
    assert "kgen::paged_decode_mma_body<Cfg>(p);" in tensor


@pytest.mark.parametrize("path", sorted((ROOT / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_body_reaches_its_source_as_a_provided_header(path):
    """One way: no source inlines a body; each includes kgen's internal bodies (kgen/bodies/), never
    ABI 1's wrappers (kgen/abi1/, ABI 1's kgen/paged_prefill*.cuh), which hand-written sources call."""
    spec = load_spec(path)
    src = render(spec).source
    included = re.findall(r'#include "(kgen/[^"]+)"', src)
    assert [h for h in included if h.startswith("kgen/bodies/")], included
    assert not [h for h in included if h in ABI1_HEADERS], included
    assert "__device__ __forceinline__ void" not in src.split("namespace {")[0]  # nothing inlined before Cfg


BODIES = {"paged_decode": "paged_decode_body", "paged_prefill": "paged_prefill_body",
          "cache_write": "cache_write_body", "copy_blocks": "copy_blocks_body"}


@pytest.mark.parametrize("path", sorted((ROOT / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_no_family_source_holds_another_familys_body(path):
    """Each source calls its own family's body only, and the online softmax comes from the one
    provided header (templates/common/softmax.cuh), never from a copy in the source."""
    spec = load_spec(path)
    src = render(spec).source
    body = "paged_decode_mma_body" if "TENSOR_CORES = true;" in src else BODIES[spec.kind]  # decode's two bodies
    if "kgen::paged_prefill_wgmma_body<" in src:  # prefill's Hopper body (an sm_90-only spec)
        body = "paged_prefill_wgmma_body"
    if spec.kv_cache.layout == "mla":  # the mla layout's own bodies (templates/common/paged_mla.cuh)
        body = {"paged_decode": "paged_mla_decode_body", "paged_prefill": "paged_mla_prefill_body"}[spec.kind]
        if spec.attention.sparse_topk:  # the sparse bodies: each row's keys are the slots its indices name
            body = body.replace("paged_mla_", "paged_mla_sparse_")
        hopper = body.replace("_body", "_wgmma_body")  # its Hopper body (templates/common/paged_mla_wgmma.cuh)
        if f"kgen::{hopper}<" in src:
            body = hopper
    assert f"kgen::{body}<" in src or f"kgen::{body}(" in src
    assert [body for kind, body in BODIES.items() if kind != spec.kind and body in src] == []
    assert "struct SoftmaxState" not in src
    uses_softmax = spec.kind in ("paged_decode", "paged_prefill")
    assert src.count('#include "kgen/softmax.cuh"') == uses_softmax


def test_rendering_is_deterministic_and_path_free(llama, tmp_path):
    copy = tmp_path / "elsewhere.yaml"
    copy.write_text((ROOT / "specs" / "llama3_8b_decode.yaml").read_text())
    assert render(llama).source == render(load_spec(copy)).source  # cache keys never see paths


def test_config_changes_source_and_adds_merge_kernel(llama):
    split = render(llama, {"partition_size": 256, "threads": 256, "mma_min_group": 0})
    assert "SPLIT = true;" in split.source and "__launch_bounds__(256)" in split.source
    assert split.kernel_names == ["llama3_8b_decode", "llama3_8b_decode_merge"]
    single = render(llama, {"partition_size": 0})
    assert "SPLIT = false;" in single.source and single.kernel_names == ["llama3_8b_decode"]


def test_spec_tuning_defaults_are_used(llama):
    assert render(llama).config == {
        "threads": llama.tuning.defaults.get("threads", 128),
        "partition_size": llama.tuning.defaults.get("partition_size", 0),
        "stages": 0, "heads_per_thread": 0, "mma_min_group": -1,  # the family's defaults: the spec does not set them
    }


@pytest.mark.parametrize("config,words", [
    ({"threads": 48}, "threads must be a multiple of 32"),
    ({"partition_size": 100}, "multiple of 16 tokens"),
    ({"warps": 4}, "not known to the paged_decode template"),
])
def test_bad_config_is_refused(llama, config, words):
    with pytest.raises(KgenUserError, match=words):
        render(llama, config)


def test_unsupported_spec_is_refused(llama):
    with pytest.raises(UnsupportedError, match="packs K in runs of x = 16"):
        render(llama.with_overrides(**{"kv_cache.layout": "vllm", "kv_cache.order": None, "kv_cache.dtype": "int8",
                                       "kv_cache.scale": "per_head", "attention.head_dim": 40}))


def test_strict_undefined():
    env = _environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ missing }}").render()


@pytest.mark.parametrize("path", sorted((ROOT / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_render_builds_the_argument_table_once(path, monkeypatch):
    """render() builds the kernels (and so the argument table) once and hands them to the family's
    template context; the kernel names come from the same list."""
    spec = load_spec(path)
    family = family_for(spec)
    real, built = type(family).arguments, []

    def counted(self, spec_, config):
        built.append(spec_.name)
        return real(self, spec_, config)

    monkeypatch.setattr(type(family), "arguments", counted)
    rendered = render(spec)
    assert built == [spec.name]
    assert rendered.kernel_names == [k.name for k in family.kernels(spec_for_arch(spec, rendered.arch), rendered.config)]
