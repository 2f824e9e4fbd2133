"""torch.ops.kgen.<spec name> (docs/interop.md): schemas made from the families' call arguments,
the op's results equal the kernel's, torch.library.opcheck passes for every overload, a module
calling the ops compiles with torch.compile(fullgraph=True), generated modules register on load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_python

import kgen
from kgen.families.attention.decode_cases import make_decode_case
from kgen.families.base import resolve_config
from kgen.families.binding import call_arguments
from kgen.families.registry import family_for
from kgen.formats.cache import cache_shapes
from kgen.formats.dtypes import BY_NUMPY
from kgen.generated import write_generated
from kgen.torch_ops import overloads, register

HEADS = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32}
FP16 = {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"}
FP8 = {"block_size": 16, "layout": "vllm", "dtype": "fp8_e4m3", "scale": "per_tensor"}


def _spec(name: str, kind: str, kv: dict, **extra):
    return kgen.spec_from_dict({"kgen": 1, "name": name, "kind": kind, "attention": dict(HEADS), "kv_cache": kv,
                                "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_90"], **extra})


def _build(spec):
    return kgen.build(spec, backend="cpu", archs=[], verify=False)


def _schemas(spec) -> dict[str, str]:
    family = family_for(spec)
    return {ov.name: ov.schema(spec.name) for ov in overloads(call_arguments(family, spec, resolve_config(family, spec,
                                                                                                          None)))}


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor of a numpy array, bf16 and fp8 included (through their bits)."""
    a = np.ascontiguousarray(a)
    known = BY_NUMPY.get(a.dtype)
    if known is None or known.name not in ("bf16", "fp8_e4m3", "fp8_e5m2"):
        return torch.from_numpy(a)
    bits = {1: np.uint8, 2: np.int16}[a.dtype.itemsize]
    return torch.from_numpy(a.view(bits)).view(getattr(torch, known.torch_name))


def _torch_args(args: dict) -> dict:
    return {n: _tensor(v) for n, v in args.items() if n != "out"}


# ---- schemas ------------------------------------------------------------------------------------
def test_decode_schema_overloads_and_order():
    s = _schemas(_spec("sch_decode", "paged_decode", FP16, attention={**HEADS, "alibi": True}))
    assert s[""] == ("sch_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
                     "Tensor alibi_slopes, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor")
    assert s["lse"].endswith("*, bool return_lse) -> (Tensor, Tensor)")
    assert s["out"].endswith("*, Tensor(a!) out) -> ()")
    assert set(s) == {"", "lse", "out"}


def test_a_spec_with_sinks_takes_them_after_alibi_and_its_op_returns_the_kernels_output():
    spec = _spec("op_sinks", "paged_decode", FP16, attention={**HEADS, "alibi": True, "sinks": True})
    assert "Tensor alibi_slopes, Tensor sinks, Tensor? k_scale=None" in _schemas(spec)[""]
    kernel = _build(spec)
    args = _torch_args(make_decode_case(spec, [3, 40], np.random.default_rng(5)))
    assert torch.equal(torch.ops.kgen.op_sinks(**args), kernel(**args))
    assert not torch.equal(kernel(**args), kernel(**dict(args, sinks=args["sinks"] - 3.0)))  # they are read


def test_fused_layout_takes_one_pool_and_per_tensor_scales_get_float_overloads():
    s = _schemas(_spec("sch_fused", "paged_decode", {**FP8, "layout": "fused", "order": "HND"}))
    assert s[""].startswith("sch_fused(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
                            "Tensor k_scale, Tensor v_scale, Tensor? alibi_slopes=None)")
    assert "float k_scale, float v_scale" in s["scalar"] and set(s) == {"", "lse", "out", "scalar", "scalar_lse",
                                                                        "scalar_out"}


def test_cache_write_and_copy_blocks_declare_what_they_write():
    w = _schemas(_spec("sch_write", "cache_write", {**FP8, "scale": "per_token_head"}))
    assert set(w) == {""} and w[""] == ("sch_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                                        "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slot_mapping) -> ()")
    c = _schemas(_spec("sch_copy", "copy_blocks", FP16))
    assert c == {"": "sch_copy(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor pairs) -> ()",
                 "layers": "sch_copy.layers(Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, Tensor pairs) -> ()"}


def test_every_bundled_spec_has_an_op_schema_torch_accepts():
    """Each schema parses (torch's parser is the judge), for every kind of the bundled specs."""
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[1].joinpath("specs").glob("*.yaml")):
        spec = kgen.load_spec(path)
        for schema in _schemas(spec).values():
            torch._C.parse_schema(f"kgen::{schema}")


# ---- running the ops ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decode():
    return _build(_spec("op_decode_fp8", "paged_decode", FP8))


@pytest.fixture(scope="module")
def decode_args(decode):
    return _torch_args(make_decode_case(decode.spec, [1, 16, 17, 40], np.random.default_rng(2)))


POSITIONAL = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "k_scale", "v_scale")


def test_build_registers_the_op_and_it_returns_the_kernels_output(decode, decode_args):
    op = torch.ops.kgen.op_decode_fp8
    want = decode(**decode_args)
    assert torch.equal(op(**decode_args), want)
    assert torch.equal(op(*(decode_args[n] for n in POSITIONAL)), want)
    out, lse = op(**decode_args, return_lse=True)
    w_out, w_lse = decode(**decode_args, return_lse=True)
    assert torch.equal(out, w_out) and torch.equal(lse, w_lse)
    buf = torch.empty_like(want)
    assert op(**decode_args, out=buf) is None and torch.equal(buf, want)
    floats = dict(decode_args, k_scale=float(decode_args["k_scale"]), v_scale=float(decode_args["v_scale"]))
    assert torch.equal(op(**floats), want)
    engine = dict(floats, k_cache=decode_args["k_cache"].view(torch.uint8),
                  v_cache=decode_args["v_cache"].view(torch.uint8), block_tables=decode_args["block_tables"].long(),
                  seq_lens=decode_args["seq_lens"].long())
    assert torch.equal(op(**engine), want)
    with pytest.raises(kgen.ArgumentError, match="return_lse=False: omit it"):
        op(**decode_args, return_lse=False)


@pytest.mark.parametrize("overload,extra", [
    ("default", {}), ("lse", {"return_lse": True}), ("out", {"out": None}), ("scalar", {"floats": True}),
])
def test_opcheck_passes(decode, decode_args, overload, extra):
    """The fp8 caches as uint8 (vLLM's storage): torch's CPU ops that opcheck runs on the inputs know no fp8."""
    args = [decode_args[n] for n in POSITIONAL]
    args[1:3] = [a.view(torch.uint8) for a in args[1:3]]
    kwargs = dict(extra)
    if kwargs.pop("floats", False):
        args[5:] = [float(args[5]), float(args[6])]
    if "out" in kwargs:
        kwargs["out"] = torch.empty(decode_args["q"].shape, dtype=torch.float16)
    result = torch.library.opcheck(getattr(torch.ops.kgen.op_decode_fp8, overload), tuple(args), kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.fixture(scope="module")
def write():
    return _build(_spec("op_write_fp8", "cache_write", FP8))


def _write_args(spec, rng, N=5, T=7):
    key, value = (torch.from_numpy(rng.standard_normal((T, 2, 32)).astype(np.float16)) for _ in range(2))
    slots = torch.from_numpy(rng.choice(N * 16, size=T, replace=False).astype(np.int64))
    caches = {n: torch.zeros(s, dtype=torch.uint8) for n, s in cache_shapes(spec, N).items()}
    return {"key": key, "value": value, **caches, "k_scale": 0.05, "v_scale": 0.07, "slot_mapping": slots}


def test_cache_write_op_writes_the_caches_like_the_kernel(write):
    args = _write_args(write.spec, np.random.default_rng(4))
    mine = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
    write(**mine)
    assert torch.ops.kgen.op_write_fp8(**args) is None
    assert args["k_cache"].any() and torch.equal(args["k_cache"], mine["k_cache"])
    assert torch.equal(args["v_cache"], mine["v_cache"])
    for overload, scales in (("default", (torch.tensor(0.05), torch.tensor(0.07))), ("scalar", (0.05, 0.07))):
        a = [args[n] for n in ("key", "value", "k_cache", "v_cache")] + list(scales) + [args["slot_mapping"]]
        result = torch.library.opcheck(getattr(torch.ops.kgen.op_write_fp8, overload), tuple(a))
        assert set(result.values()) == {"SUCCESS"}, result


def test_copy_blocks_op_one_pool_or_a_list_of_layers():
    kern = _build(_spec("op_copy", "copy_blocks", FP16))
    pools = [{n: torch.randn(s).to(torch.float16) for n, s in cache_shapes(kern.spec, 6).items()} for _ in range(2)]
    pairs = torch.tensor([[0, 3], [1, 4]], dtype=torch.int64)
    before = [{n: p.clone() for n, p in layer.items()} for layer in pools]
    assert torch.ops.kgen.op_copy(pools[0]["k_cache"], pools[0]["v_cache"], pairs) is None
    torch.ops.kgen.op_copy(k_cache=[lay["k_cache"] for lay in pools[1:]], v_cache=[lay["v_cache"] for lay in pools[1:]],
                           pairs=pairs)
    for layer, old in zip(pools, before, strict=True):
        for n in layer:
            assert torch.equal(layer[n][[3, 4]], old[n][[0, 1]]) and torch.equal(layer[n][:3], old[n][:3])
    for overload, a in (("default", (pools[0]["k_cache"], pools[0]["v_cache"], pairs)),
                        ("layers", ([p["k_cache"] for p in pools], [p["v_cache"] for p in pools], pairs))):
        result = torch.library.opcheck(getattr(torch.ops.kgen.op_copy, overload), a)
        assert set(result.values()) == {"SUCCESS"}, result


def test_a_later_kernel_of_the_same_name_replaces_the_op():
    first = _build(_spec("op_renamed", "paged_decode", FP16))
    args = _torch_args(make_decode_case(first.spec, [5], np.random.default_rng(1)))
    assert torch.equal(torch.ops.kgen.op_renamed(**args), first(**args))
    wider = _spec("op_renamed", "paged_decode", FP16, attention={**HEADS, "alibi": True})  # another signature
    second = _build(wider)
    args = _torch_args(make_decode_case(wider, [5], np.random.default_rng(1)))
    assert "alibi_slopes" in str(torch.ops.kgen.op_renamed.default._schema)
    assert torch.equal(torch.ops.kgen.op_renamed(**args), second(**args))
    assert register(second) is torch.ops.kgen.op_renamed  # same schema again: nothing redefined


def test_torch_compile_fullgraph_through_write_and_decode(decode, write):
    """A module that writes the new token's K/V (a mutating op) then decodes compiles without a graph break."""
    spec = decode.spec
    case = make_decode_case(spec, [17, 5], np.random.default_rng(6))
    args = _torch_args(case)
    slots = (args["block_tables"][torch.arange(2), (args["seq_lens"] - 1) // 16] * 16 + (args["seq_lens"] - 1) % 16)

    class Step(torch.nn.Module):
        def forward(self, q, new_k, new_v, k_cache, v_cache, block_tables, seq_lens, slot_mapping):
            torch.ops.kgen.op_write_fp8(new_k, new_v, k_cache, v_cache, 0.05, 0.07, slot_mapping)
            return torch.ops.kgen.op_decode_fp8(q * 2, k_cache, v_cache, block_tables, seq_lens, 0.05, 0.07) + 1

    rng = np.random.default_rng(7)
    new_k, new_v = (torch.from_numpy(rng.standard_normal((2, 2, 32)).astype(np.float16)) for _ in range(2))
    inputs = [args["q"], new_k, new_v, args["k_cache"].view(torch.uint8).clone(),
              args["v_cache"].view(torch.uint8).clone(), args["block_tables"], args["seq_lens"], slots.long()]
    eager_inputs = [x.clone() for x in inputs]
    want = Step()(*eager_inputs)
    got = torch.compile(Step(), fullgraph=True, dynamic=False)(*inputs)
    assert torch.equal(got, want) and torch.equal(inputs[3], eager_inputs[3])
    assert not torch.equal(inputs[3], args["k_cache"].view(torch.uint8))  # the compiled write reached the cache


def test_generated_module_registers_on_load(tmp_path):
    kern = kgen.build(_spec("op_generated", "paged_decode", FP16), backend="cpu", archs=[], verify=True)
    write_generated(kern, tmp_path / "gen")
    code = ("import torch, numpy as np\n"
            "from gen.op_generated import kernel\n"
            "from kgen.families.attention.decode_cases import make_decode_case\n"
            "args = make_decode_case(kernel.spec, [3, 20], np.random.default_rng(0)); args.pop('out')\n"
            "t = {n: torch.from_numpy(v) for n, v in args.items()}\n"
            "assert torch.equal(torch.ops.kgen.op_generated(**t), kernel(**t))\n"
            "print('registered')\n")
    res = run_python(code, cwd=tmp_path, path=(tmp_path,))
    assert res.returncode == 0 and "registered" in res.stdout, res.stderr


def test_import_kgen_does_not_import_torch(tmp_path):
    res = run_python("import sys, kgen, kgen.torch_ops, kgen.interop; print('torch' in sys.modules)", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


@pytest.mark.gpu
def test_cuda_op_matches_the_kernel_and_captures_in_a_cuda_graph():
    kern = kgen.build(_spec("op_cuda", "paged_decode", FP16), backend="cuda", verify=False)
    args = {n: t.cuda() for n, t in _torch_args(make_decode_case(kern.spec, [1, 40], np.random.default_rng(3))).items()}
    want = kern(**args)
    assert torch.equal(torch.ops.kgen.op_cuda(**args), want)
    out = torch.empty_like(want)
    torch.ops.kgen.op_cuda(**args, out=out)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.kgen.op_cuda(**args, out=out)  # no host sync: the value checks are off on device arrays
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("overload", ["default", "lse", "out"])
def test_v_head_dim_op_returns_and_fakes_the_v_width(overload):
    """attention.v_head_dim: out (and its fake) is [rows, Hq, v_head_dim], not q's width."""
    spec = _spec("op_decode_vdim", "paged_decode", FP16, attention={**HEADS, "head_dim": 64, "v_head_dim": 96})
    kern = _build(spec)
    args = _torch_args(make_decode_case(spec, [1, 16, 17], np.random.default_rng(4)))
    want = kern(**args)
    assert tuple(want.shape) == (3, 4, 96)
    assert torch.equal(torch.ops.kgen.op_decode_vdim(**args), want)
    kwargs = {"return_lse": True} if overload == "lse" else {"out": torch.empty(3, 4, 96, dtype=torch.float16)} \
        if overload == "out" else {}
    result = torch.library.opcheck(getattr(torch.ops.kgen.op_decode_vdim, overload),
                                   tuple(args[n] for n in POSITIONAL[:5]), kwargs)
    assert set(result.values()) == {"SUCCESS"}, result
