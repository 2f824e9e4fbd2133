"""kgen/model_specs.py and `kgen specs-for-model`: specs from Hugging Face model configs."""

import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import run_kgen

import kgen
from kgen.errors import KgenUserError, UnsupportedError
from kgen.families.registry import support_problems

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_a_llama_config_gives_one_set_of_three_specs():
    specs = kgen.specs_for_model(LLAMA, block_size=16)
    assert sorted(specs) == ["cache_write", "decode", "prefill"]
    d = specs["decode"]
    assert (d.kind, d.attention.num_q_heads, d.attention.num_kv_heads, d.attention.head_dim) == ("paged_decode", 32, 8, 128)
    assert d.dtype.q == "bf16" and d.kv_cache.dtype == "bf16" and d.kv_cache.block_size == 16
    assert specs["prefill"].attention.causal and specs["cache_write"].kind == "cache_write"
    assert d.attention.sliding_window is None and d.softmax_scale_value == pytest.approx(1 / math.sqrt(128))


def test_fp8_caches_get_per_tensor_scales_and_fp8_targets():
    specs = kgen.specs_for_model(LLAMA, kv_dtype="fp8")
    for spec in specs.values():
        assert spec.kv_cache.dtype == "fp8_e4m3" and spec.kv_cache.scale == "per_tensor"
        assert "sm_80" not in spec.targets


def test_gemma2_alternates_windowed_and_full_layers_with_its_scale_and_cap():
    cfg = {"model_type": "gemma2", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "hidden_size": 2304, "query_pre_attn_scalar": 224, "attn_logit_softcapping": 50.0,
           "sliding_window": 4096, "torch_dtype": "bfloat16"}
    specs = kgen.specs_for_model(cfg)
    assert sorted(specs) == ["cache_write", "cache_write_window4096", "decode", "decode_window4096", "prefill",
                             "prefill_window4096"]
    assert specs["decode"].attention.sliding_window is None
    assert specs["decode_window4096"].attention.sliding_window == 4096
    for key in ("decode", "prefill_window4096"):
        a = specs[key].attention
        assert a.logits_soft_cap == 50.0 and a.softmax_scale == pytest.approx(224 ** -0.5)
    assert len({s.name for s in specs.values()}) == 6


def test_layer_types_and_qwen2_window_layers_are_read():
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256,
            "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "torch_dtype": "float16"}
    specs = kgen.specs_for_model(qwen)
    assert specs["decode"].attention.sliding_window is None and specs["decode_window64"].attention.sliding_window == 64
    typed = dict(LLAMA, model_type="gemma3_text", layer_types=["full_attention"] * 4, sliding_window=512)
    assert "decode_window512" not in kgen.specs_for_model(typed)


GPT_OSS_20B = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "hidden_size": 2880, "sliding_window": 128, "torch_dtype": "bfloat16",
               "layer_types": ["sliding_attention", "full_attention"] * 2}


def test_gpt_oss_gets_sinks_on_its_windowed_and_full_layers_but_not_on_the_cache_write():
    specs = kgen.specs_for_model(GPT_OSS_20B)
    assert sorted(specs) == ["cache_write", "cache_write_window128", "decode", "decode_window128", "prefill",
                             "prefill_window128"]
    for key in ("decode", "prefill", "decode_window128", "prefill_window128"):
        a = specs[key].attention
        assert a.sinks and (a.num_q_heads, a.num_kv_heads, a.head_dim) == (64, 8, 64)
        assert a.sliding_window == (128 if key.endswith("128") else None)
        assert specs[key].softmax_scale_value == pytest.approx(0.125)
    assert not specs["cache_write"].attention.sinks
    assert specs["decode"].name != kgen.specs_for_model({**GPT_OSS_20B, "model_type": "llama"})["decode"].name
    assert all(support_problems(spec) == [] for spec in specs.values())  # built, not refused


@pytest.mark.parametrize("cfg, match", [    ({**LLAMA, "model_type": "mamba"}, "model_type mamba"),
    ({**LLAMA, "torch_dtype": "float64"}, "dtype float64"),
])
def test_what_kgen_cannot_serve_is_refused_with_the_reason(cfg, match):
    with pytest.raises(UnsupportedError, match=match):
        kgen.specs_for_model(cfg)


def test_head_dims_kgen_refuses_name_the_field():
    with pytest.raises(kgen.SpecError, match="head_dim"):
        kgen.specs_for_model(dict(LLAMA, head_dim=20))


def test_a_missing_config_is_a_user_error(tmp_path):
    with pytest.raises(KgenUserError, match="no such model config"):
        kgen.specs_for_model(tmp_path / "absent")


def test_cli_writes_specs_that_validate_and_refuses_bad_input(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    r = run_kgen("specs-for-model", str(tmp_path), "-o", str(tmp_path / "specs"), "--block-size", "32")
    assert r.returncode == 0, r.stderr
    files = sorted((tmp_path / "specs").glob("*.yaml"))
    assert len(files) == 3
    assert yaml.safe_load(files[0].read_text())["kv_cache"]["block_size"] == 32
    assert run_kgen("validate", *map(str, files)).returncode == 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    r = run_kgen("specs-for-model", str(tmp_path / "bad"), "-o", str(tmp_path / "out2"))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out2").exists()


DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "torch_dtype": "bfloat16",
               "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096}}


def test_deepseek_v3_gets_absorbed_mla_specs_with_its_yarn_scale():
    specs = kgen.specs_for_model(DEEPSEEK_V3, block_size=64)
    assert sorted(specs) == ["cache_write", "decode", "prefill"]
    mscale = 0.1 * math.log(40) + 1
    for key in ("decode", "prefill"):
        s = specs[key]
        assert s.kv_cache.layout == "mla" and s.kv_cache.block_size == 64
        assert (s.attention.num_q_heads, s.attention.num_kv_heads, s.attention.head_dim, s.v_head_dim_value) == (
            128, 1, 576, 512)
        assert s.softmax_scale_value == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert specs["cache_write"].kv_cache.layout == "mla" and specs["cache_write"].v_head_dim_value == 512
    # the bundled example spec states the same numbers by hand
    bundled = kgen.load_spec(Path(__file__).resolve().parents[1] / "specs" / "deepseek_v3_mla_decode.yaml")
    assert bundled.softmax_scale_value == pytest.approx(specs["decode"].softmax_scale_value, rel=1e-7)
    assert all(support_problems(spec) == [] for spec in specs.values())
    fp8 = kgen.specs_for_model(DEEPSEEK_V3, kv_dtype="fp8", block_size=64)
    assert fp8["decode"].kv_cache.dtype == "fp8_e4m3" and fp8["decode"].kv_cache.scale == "per_tensor"
    assert support_problems(fp8["decode"]) == []


DEEPSEEK_V32 = {**DEEPSEEK_V3, "model_type": "deepseek_v32", "index_topk": 2048, "index_n_heads": 64,
                "index_head_dim": 128}


def test_deepseek_v32_gets_sparse_mla_specs_from_its_index_topk():
    specs = kgen.specs_for_model(DEEPSEEK_V32, block_size=64)
    assert sorted(specs) == ["cache_write", "decode", "prefill"]
    for key in ("decode", "prefill"):
        s = specs[key]
        assert s.attention.sparse_topk == 2048 and s.kv_cache.layout == "mla" and s.v_head_dim_value == 512
        assert support_problems(s) == []
    assert "causal" not in specs["prefill"].model_dump(exclude_unset=True)["attention"]  # sparse: no causal mask
    assert specs["cache_write"].attention.sparse_topk is None  # the write kernel knows nothing of the attention
    # the bundled V3.2 specs state the same kernels by hand (names and tuning aside)
    root = Path(__file__).resolve().parents[1] / "specs"
    for key in ("decode", "prefill"):
        bundled = kgen.load_spec(root / f"deepseek_v32_sparse_mla_{key}.yaml")
        derived = specs[key]
        assert (bundled.attention.sparse_topk, bundled.attention.num_q_heads, bundled.kind) == (
            derived.attention.sparse_topk, derived.attention.num_q_heads, derived.kind)
        assert bundled.softmax_scale_value == pytest.approx(derived.softmax_scale_value, rel=1e-7)
    # a V3 config stays dense
    assert kgen.specs_for_model(DEEPSEEK_V3, block_size=64)["decode"].attention.sparse_topk is None


@pytest.mark.parametrize("change,message", [
    ({"index_topk": None}, "missing index_topk"), ({"index_topk": 0}, "index_topk must be a positive integer"),
    ({"index_topk": "2048"}, "index_topk must be a positive integer"),
])
def test_a_v32_config_without_a_valid_index_topk_is_a_user_error(change, message):
    cfg = {k: v for k, v in {**DEEPSEEK_V32, **change}.items() if v is not None}
    with pytest.raises(KgenUserError, match=message):
        kgen.specs_for_model(cfg)


def test_an_mla_config_without_its_ranks_is_a_user_error():
    with pytest.raises(KgenUserError, match="kv_lora_rank"):
        kgen.specs_for_model({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"})
