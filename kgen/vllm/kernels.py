"""The kgen kernels the vLLM backend serves with: built once per layer type and process (compiled
artifacts are cached on disk across processes by kgen's artifact cache), verified before use,
and counted per layer as they launch.

A spec that fails verification is never served: `kernels_for` raises instead. With
KGEN_VLLM_SPEC_DIR set, a spec file of the derived name in that folder replaces the derived one
(its tuning defaults included), after a check that it is still the same contract. With
KGEN_VLLM_SOURCE_DIR set, a hand-written source `<spec name>.cu` of the derived name (any prefix,
then _<layer key>_<kind>) serves that kind instead of kgen's kernel, after kgen.load_source has
verified it (its kernels are named after the file: kgen's spec is served under that name). With
KGEN_VLLM_AUDIT_RATE > 0, decode and prefill calls are audited at that rate (kern.audit).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kgen.audit import AuditedKernel, auditable
from kgen.build import build, select_backend
from kgen.compile.cuda_line import install_hint
from kgen.errors import KgenUserError
from kgen.families.attention.prefill import fitted_to_short_rows
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.model_specs import KINDS, LayerAttention, layer_specs
from kgen.runtime.cuda import device_arch, gpu_available, gpu_diagnosis
from kgen.settings import (
    KGEN_BACKEND,
    KGEN_VLLM_AUDIT_RATE,
    KGEN_VLLM_SOURCE_DIR,
    KGEN_VLLM_SPEC_DIR,
)
from kgen.spec.models import load_spec
from kgen.verify.untrusted.handwritten import load_source

log = logging.getLogger("vllm.kgen")  # under vLLM's logger: its handler and level apply
# Device memory a verification case may take at start-up, between vLLM's memory profiling and its
# KV-cache allocation: the huge-pool cases (8-17 GiB) run on the host instead (docs/vllm.md).
SERVING_VERIFY_BUDGET = 256 * 2**20
_LOCK = threading.Lock()
_BUILT: dict[str, object] = {}  # spec name -> verified Kernel
_LAUNCHES: Counter[tuple[str, str]] = Counter()  # (layer name, kind) -> launches


@dataclass(frozen=True)
class LayerKernels:
    """The kernels of one layer type: its three kinds, and with speculative decoding on a GPU the
    prefill kernel fitted to draft-verification requests (`drafts`, kgen.families.attention.prefill.
    fitted_to_short_rows)."""

    layer: LayerAttention
    cache_write: object
    decode: object
    prefill: object
    drafts: object | None = None

    @property
    def name(self) -> str:
        return self.decode.spec.name.removesuffix("_decode")


def _override(spec):
    """The spec of KGEN_VLLM_SPEC_DIR/<prefix>_<layer key>_<kind>.yaml in place of `spec`, when there
    is one (any prefix: `kgen specs-for-model` names files after the model type)."""
    folder = KGEN_VLLM_SPEC_DIR.value()
    if folder is None:
        return spec
    suffix = spec.name.removeprefix("vllm")  # _<layer key>_<kind>
    found = sorted(folder.glob(f"*{suffix}.yaml"))
    if not found:
        return spec
    path = found[0]
    replaced = load_spec(path)
    contract = ("kind", "attention", "kv_cache", "dtype", "tail_masking")
    if replaced.model_dump(include=set(contract)) != spec.model_dump(include=set(contract)):
        raise KgenUserError(f"{path}: not the contract vLLM's layer needs (kind, attention, kv_cache, dtype and "
                            "tail_masking must stay as `kgen specs-for-model` wrote them; edit tuning only)")
    log.info("kgen: %s from %s", spec.name, path)
    return replaced


def _source(spec) -> Path | None:
    """KGEN_VLLM_SOURCE_DIR/<prefix>_<layer key>_<kind>.cu for `spec`, when there is one."""
    folder = KGEN_VLLM_SOURCE_DIR.value()
    if folder is None:
        return None
    suffix = spec.name.removeprefix("vllm")
    found = sorted(folder.glob(f"*{suffix}.cu"))
    return found[0] if found else None


def _build(spec, backend: str, config: dict | None = None):
    """The verified kernel of `spec` (kgen's, or a hand-written source's; `config`: kgen's, in place of
    the spec's tuning defaults), audited at KGEN_VLLM_AUDIT_RATE for the attention kinds."""
    rate = KGEN_VLLM_AUDIT_RATE.value()
    source = _source(spec) if config is None else None
    key = f"{spec.name} {source} {rate} {sorted((config or {}).items())}"
    with _LOCK:
        kern = _BUILT.get(key)
        if kern is None:
            if source is not None:
                served = spec.with_overrides(name=source.stem)  # its kernels are named after the file
                log.info("kgen: %s from the hand-written %s (verifying)", spec.name, source)
                kern = load_source(served, source, backend=backend, archs=_archs(backend))  # VerificationError
            else:
                kern = build(spec, backend=backend, archs=_archs(backend), device_budget=SERVING_VERIFY_BUDGET,
                             config=config)
                if not kern.report.passed:
                    raise KgenUserError(f"kgen: {spec.name} failed verification, so it will not serve: "
                                        f"{kern.report.summary()}")
            if rate > 0 and auditable(spec):
                kern = kern.audit(rate)
                log.info("kgen: %s audited at rate %g (seed %d)", spec.name, rate, kern.seed)
            _BUILT[key] = kern
    return kern


def _archs(backend: str) -> list[str] | None:
    """One cubin for this GPU; on the CPU backend sm_90's, whose ptxas figures the planner reads."""
    if backend == "cuda":
        return [device_arch()]
    return ["sm_90"]


def serving_backend(platform=None) -> str:
    """kgen's backend for the platform vLLM runs on (vLLM's `current_platform` when None): CUDA on
    a CUDA platform, the CPU backend on vLLM's CPU build. A CUDA vLLM where kgen cannot use the GPU
    stops with the reason: the CPU backend would be handed device pointers."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return "cpu"
    if not platform.is_cuda():
        raise KgenUserError(f"kgen's vLLM backend serves CUDA and CPU platforms, not {platform.device_name}")
    forced = KGEN_BACKEND.value()
    if forced == "cpu":
        raise KgenUserError("KGEN_BACKEND=cpu, but vLLM runs on CUDA: kgen's CPU backend cannot read the GPU's "
                            "KV cache (unset KGEN_BACKEND, or set it to cuda or auto)")
    if not gpu_available():
        raise KgenUserError(f"vLLM runs on CUDA, but kgen cannot use the GPU ({gpu_diagnosis()}); kgen needs "
                            f"one CUDA line whose major the driver supports: {install_hint()}")
    return "cuda"


def kernels_for(layer: LayerAttention, backend: str = "auto", draft_q_len: int = 1) -> LayerKernels:
    """The verified kernels of a layer type (built on first use in this process). `draft_q_len` > 1:
    speculative decoding's verification requests have up to that many query tokens; a prefill
    kernel fitted to them is built too (from the prefill spec in use, a hand-written one's included:
    a source implements one launch, so kgen's kernel of that spec serves the drafts)."""
    chosen = select_backend(backend)
    specs = {kind: _override(spec) for kind, spec in layer_specs(layer, prefix="vllm").items()}
    built = {kind: _build(specs[kind], chosen) for kind in KINDS}
    drafts = None
    if draft_q_len > 1:  # under its own name: torch.ops.kgen.<prefill name> stays the prefill kernel
        prefill = specs["prefill"].with_overrides(name=f"{specs['prefill'].name}_drafts")
        config = fitted_to_short_rows(prefill, resolve_config(family_for(prefill), prefill, None), draft_q_len)
        drafts = _build(prefill, chosen, config=config)
    return LayerKernels(layer, built["cache_write"], built["decode"], built["prefill"], drafts)


def count_launch(layer_name: str, kind: str) -> None:
    _LAUNCHES[(layer_name, kind)] += 1


def serve_regions(kernels: LayerKernels, layer_name: str, meta, q, out, common: dict) -> None:
    """One launch per row group of a step's metadata (kgen/vllm/metadata.py's KgenAttentionMetadata):
    the decode rows, the draft-verification requests, the prompt chunks, each with the builder's plan,
    reading rows [row_start, row_end) of `q` and writing those of `out`; `common`: the layer's other
    arguments (its cache, scales, slopes, sinks)."""
    decode_plan, prefill_plan = meta.plans.get(kernels.name, (None, None))
    for kind, rows, plan in (("decode", meta.decode, decode_plan),
                             ("drafts", meta.drafts, meta.draft_plans.get(kernels.name)),
                             ("prefill", meta.prefill, prefill_plan)):
        if rows is None:
            continue
        packed = {} if kind == "decode" else {"q_indptr": rows.q_indptr}  # decode: one row per sequence
        getattr(kernels, kind)(q=q[rows.row_start:rows.row_end], out=out[rows.row_start:rows.row_end], **packed,
                               block_tables=rows.block_tables, seq_lens=rows.seq_lens, plan=plan, **common)
        count_launch(layer_name, kind)


def launch_counts() -> dict[str, dict[str, int]]:
    """{layer name: {"cache_write" | "decode" | "drafts" | "prefill": launches}} in this process: the proof that
    kgen's kernels, not vLLM's, served each layer."""
    result: dict[str, dict[str, int]] = {}
    for (layer, kind), n in sorted(_LAUNCHES.items()):
        result.setdefault(layer, {})[kind] = n
    return result


def audit_counts() -> dict[str, dict[str, float]]:
    """{spec name: {"calls", "checked", "mismatches", "worst_ratio"}} of the audited kernels built in this
    process (KGEN_VLLM_AUDIT_RATE > 0): how many calls a trusted computation rechecked, and the worst
    error relative to the verifier's bound."""
    with _LOCK:
        kernels = list(_BUILT.values())
    result = {}
    for kern in kernels:
        if isinstance(kern, AuditedKernel):
            stats = kern.flush()
            result[kern.spec.name] = {"calls": stats.calls, "checked": stats.checked, "mismatches": stats.mismatches,
                                      "worst_ratio": stats.worst_ratio}
    return result


def reset_launch_counts() -> None:
    _LAUNCHES.clear()
