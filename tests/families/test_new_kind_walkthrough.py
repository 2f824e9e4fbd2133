"""docs/architecture.md section 5, checked: a hypothetical kind over a new cache format is one row
in the dtype table (kgen/formats/dtypes.py) and one family module (here, this file's
BlockSumFamily and its template), registered; render, build, the CPU backend, `kgen abi`'s rows
and the call path reach it through the registry with nothing else changed.

The kind, `block_sum`, adds up the bytes of each block of a K pool of 8-bit e8m0 scales (a format
kgen does not have) into an int32 per block."""

from __future__ import annotations

import jinja2
import ml_dtypes
import numpy as np
import pytest

import kgen
from kgen import render as render_module
from kgen.families import registry
from kgen.families.argtable import KernelDecl, array, scalar
from kgen.families.base import Config, SingleKernelFamily
from kgen.families.binding import CallBinder, refuse_plan
from kgen.families.pool import PagedPool
from kgen.formats import dtypes
from kgen.formats.cache import CacheFormat, cache_shapes
from kgen.paths import templates_dir

E8M0 = dtypes.DType("e8m0", "unsigned char", np.dtype(ml_dtypes.float8_e8m0fnu), "float8_e8m0fnu", 8)

TEMPLATE = """// block_sum (a test-only kind), spec {{ spec.name }}
{{ include_raw("common/platform.cuh") }}
namespace {
struct Cfg {
  typedef {{ kv_ctype }} kv_t;
  static constexpr int BLOCK_BYTES = {{ block_bytes }};
};
}  // namespace

{{ main.declaration() }} {
  const int b = blockIdx.x;
  if (b >= num_blocks || threadIdx.x != 0) return;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(k_cache) + (long long)b * Cfg::BLOCK_BYTES;
  int s = 0;
  for (int i = 0; i < Cfg::BLOCK_BYTES; ++i) s += p[i];
  sums[b] = s;
}
"""


class BlockSumFamily(SingleKernelFamily):
    kind = "block_sum"
    template = "block_sum.cu.j2"

    def unsupported(self, spec) -> list[str]:
        return [] if CacheFormat.of(spec).layout == "separate" else ["block_sum reads a separate K pool"]

    def arguments(self, spec, config: Config):
        shape = cache_shapes(spec)["k_cache"]
        return [array("sums", "int32", "output", ("num_blocks",), "byte sum of each block"),
                array("k_cache", spec.kv_cache.dtype, "input", shape, "the K pool", const=True),
                scalar("num_blocks", "int32", "blocks in the pool")]

    def kernels(self, spec, config: Config):
        return [KernelDecl(spec.name, tuple(self.arguments(spec, config)), ("num_blocks", 1, 1), config["threads"])]

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]):
        f = CacheFormat.of(spec)
        block_bytes = f.dtype.bytes_for(f.block_size * f.num_kv_heads * f.head_dim)
        return {"kv_ctype": f.dtype.ctype, "block_bytes": block_bytes, "main": kernels[0]}

    def abi_notes(self, spec) -> list[str]:
        return [f"cache {CacheFormat.of(spec).describe()}"]

    def bind(self, spec, config, call, checked=True, plan=None, target_blocks=None):
        refuse_plan(spec, plan)
        b = CallBinder(spec, call)
        k = b.take("k_cache", True)
        b.device = k.device
        N = k.shape[0]
        b.check(k, cache_shapes(spec, N)["k_cache"], spec.kv_cache.dtype)
        b.refuse_unknown()
        sums = np.zeros(N, dtype=np.int32)
        values = {"sums": sums, "k_cache": b.pointer(k), "num_blocks": N}
        return [self.kernels(spec, config)[0].launch({"num_blocks": N}, values)], sums


@pytest.fixture
def new_kind(monkeypatch, tmp_path):
    """Register the row and the family as a new kind would (the table, the registry) and give
    render a template folder with its template next to kgen's."""
    for table, key in ((dtypes.BY_NAME, E8M0.name), (dtypes.BY_NUMPY, E8M0.numpy), (dtypes.BY_TORCH, E8M0.torch_name)):
        monkeypatch.setitem(table, key, E8M0)
    family = BlockSumFamily()
    monkeypatch.setitem(registry.FAMILIES, family.kind, {PagedPool.name: family})
    (tmp_path / "block_sum.cu.j2").write_text(TEMPLATE)
    root = templates_dir()
    env = jinja2.Environment(loader=jinja2.ChoiceLoader([jinja2.FileSystemLoader(str(tmp_path)),
                                                         jinja2.FileSystemLoader(str(root))]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.globals["include_raw"] = lambda name: (root / name).read_text()
    monkeypatch.setattr(render_module, "_environment", lambda: env)
    base = kgen.spec_from_dict({
        "kgen": 1, "name": "walkthrough_block_sum", "kind": "copy_blocks",
        "attention": {"num_q_heads": 2, "num_kv_heads": 2, "head_dim": 32},
        "kv_cache": {"block_size": 4, "layout": "separate", "order": "NHD", "dtype": "int8", "scale": "per_head"},
        "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"]})
    # The spec format's kind and dtype lists are the models' (kgen/spec/models.py): a real kind adds
    # its names there; this test-only one takes a validated spec and changes the two fields.
    kv = base.kv_cache.model_copy(update={"dtype": "e8m0", "scale": "none"})
    return base.model_copy(update={"kind": "block_sum", "kv_cache": kv})


def test_a_new_kind_over_a_new_cache_format_is_a_table_row_and_one_family(new_kind):
    spec = new_kind
    fmt = CacheFormat.of(spec)
    assert fmt.dtype is E8M0 and not fmt.quantized and fmt.names == ("k_cache", "v_cache")
    assert registry.family_for(spec).kind == "block_sum"
    rendered = render_module.render(spec)
    assert rendered.kernel_names == ["walkthrough_block_sum"] and "BLOCK_BYTES = 256" in rendered.source
    kernel = kgen.build(spec, backend="cpu", archs=[], verify=False)
    pool = np.random.default_rng(0).integers(0, 255, size=(5, 4, 2, 32), dtype=np.uint8)
    sums = kernel(k_cache=pool.view(E8M0.numpy))
    np.testing.assert_array_equal(sums, pool.reshape(5, -1).sum(axis=1))
    with pytest.raises(kgen.ArgumentError, match="k_cache: expected dtype e8m0"):
        kernel(k_cache=pool.astype(np.int8))


def test_a_packed_sub_byte_row_counts_bytes_not_items():
    fp4 = dtypes.DType("e2m1", "unsigned char", np.dtype(ml_dtypes.float4_e2m1fn), "float4_e2m1fn", 4)
    assert fp4.packed and fp4.bytes_for(32) == 16 and fp4.bytes_for(3) == 2
    with pytest.raises(ValueError, match="packed"):
        _ = fp4.itemsize
    assert dtypes.dtype("int8").qmax == 127.0 and dtypes.QUANTIZED == {"fp8_e4m3", "fp8_e5m2", "int8", "nvfp4"}
