"""Shared test setup, and the helpers more than one test file uses.

- GPU-only tests (@pytest.mark.gpu) are skipped unless CuPy sees a device.
- The tiers (default, full: @pytest.mark.full) are tests/tiers.py's, a plugin of their own.
- Every test, and every subprocess a test spawns, uses a temporary kgen cache
  (KGEN_CACHE_DIR), never the user's: one directory per test run, shared by the xdist
  workers so that each kernel is compiled once per run.
- Helpers: test files import them with `from conftest import ...`. That name is
  unambiguous only while this is the one conftest.py under tests/: put fixtures here,
  not in a conftest.py of a subfolder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kgen.compile.provided import kgen_headers
from kgen.families.attention.reference import attention_outputs
from kgen.paging import KVCacheManager
from kgen.render import render
from kgen.runtime.cuda import gpu_available
from kgen.spec.models import spec_from_dict
from kgen.verify.judge.bounds import EPS_FP32, check_output
from kgen.verify.judge.report import CaseResult
from kgen.verify.untrusted.handwritten import kernel_from_source

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR_NAME = "kgen-cache"


def pytest_collection_modifyitems(config, items):
    if gpu_available():  # probed once per session
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def full_tier_except(params, keep, *, single: bool = False) -> list:
    """A parametrised matrix in two tiers: the entries at the indices in `keep` run in the default
    tier, every other one only in the full tier (tests/tiers.py). Entries may be plain values, tuples
    of the argument values, or pytest.param (`single`: one argument name, whose values may be
    tuples); the caller says why the kept ones prove the matrix's claim by default."""
    out = []
    for i, p in enumerate(params):
        if i in keep:
            out.append(p)
        elif isinstance(p, type(pytest.param(None))):
            out.append(pytest.param(*p.values, marks=[*p.marks, pytest.mark.full], id=p.id))
        else:
            out.append(pytest.param(*(p if isinstance(p, tuple) and not single else (p,)), marks=pytest.mark.full))
    return out


def run_cache_dir(tmp_path_factory) -> Path:
    """This run's cache: under the run's base temp dir; with xdist every worker's base temp
    dir is a child of the run's, so the workers meet in the parent."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / CACHE_DIR_NAME
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def kgen_cache_dir(tmp_path_factory):
    """KGEN_CACHE_DIR for the whole session; subprocesses inherit it through os.environ."""
    path = run_cache_dir(tmp_path_factory)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KGEN_CACHE_DIR", str(path))
        yield path


# ---- subprocesses --------------------------------------------------------------------


def _env(extra_path: tuple[Path | str, ...], env: dict | None) -> dict:
    paths = [str(p) for p in extra_path] + [str(ROOT)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(env or {})}


def run_kgen(*args: str, cwd: Path | None = None, path: tuple[Path | str, ...] = (), env: dict | None = None,
             umask: int = -1) -> subprocess.CompletedProcess:
    """`python -m kgen.cli ARGS` with this checkout's kgen; `path` goes on PYTHONPATH before
    it, `env` adds or overrides variables."""
    return subprocess.run([sys.executable, "-m", "kgen.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=_env(path, env), timeout=600, umask=umask)


def run_python(code: str, cwd: Path, path: tuple[Path | str, ...] = (), env: dict | None = None,
               ) -> subprocess.CompletedProcess:
    """`python -c CODE` in a fresh process; `path` goes on PYTHONPATH before this checkout."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env=_env(path, env), timeout=600)


def write_spec(directory: Path, text: str, name: str = "spec.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


# ---- specs ---------------------------------------------------------------------------

TINY_DECODE = {
    "kgen": 1, "name": "tiny_decode", "kind": "paged_decode",
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32},
    "kv_cache": {"block_size": 16, "layout": "separate", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_80"],
}


# A small prefill on sm_80 whose default tiles (8 warps x 2 m-tiles x 128 keys) spill hundreds of bytes
# (ptxas's resource report: spill stores and a stack frame); its smallest (2 warps, 16 keys) are clean.
SPILLY_PREFILL = {
    "kgen": 1, "name": "spilly_prefill", "kind": "paged_prefill",
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 128, "causal": True},
    "kv_cache": {"block_size": 16, "layout": "separate", "order": "NHD", "dtype": "fp16"},
    "dtype": {"q": "fp16"}, "tail_masking": True, "targets": ["sm_80"],
    "tuning": {"params": {"warps": [8], "kv_tile": [128], "m_tiles": [2]},
               "defaults": {"warps": 8, "kv_tile": 128, "m_tiles": 2}},
}


def tiny_decode(name: str = "tiny_decode", tuning: dict | None = None, **overrides):
    """A small fp16 decode spec (group size 2, head_dim 32): quick to build on the CPU backend.
    overrides are Spec.with_overrides keys ("attention.softmax_scale", ...)."""
    data = {**TINY_DECODE, "name": name, **({"tuning": tuning} if tuning is not None else {})}
    spec = spec_from_dict(data)
    return spec.with_overrides(**overrides) if overrides else spec


# kgen's provided headers that a mutant may edit as kernel code (no compiler branch in them): the online
# softmax, the kernel bodies other than prefill's (inline_prefill_body), and the parts the bodies include
# (after the bodies: each is included by a body copied in before it): the K/V pool, the CUDA-core tile
# math, the epilogue (a row's end and the split-KV merge) and the MLA bodies' latent-row part.
EDITABLE_HEADERS = ("kgen/softmax.cuh", "kgen/bodies/paged_decode.cuh", "kgen/bodies/paged_decode_mma.cuh",
                    "kgen/bodies/paged_mla.cuh", "kgen/bodies/cache_write.cuh", "kgen/bodies/cache_write_mla.cuh",
                    "kgen/bodies/copy_blocks.cuh", "kgen/bodies/paged_mla_wgmma.cuh", "kgen/ds_mla_row.cuh",
                    "kgen/attention/kv_pool.cuh", "kgen/attention/simt_tile.cuh", "kgen/attention/epilogue.cuh",
                    "kgen/attention/latent_rows.cuh")


def inline_provided(source: str, headers: str | tuple[str, ...] = EDITABLE_HEADERS) -> str:
    """`source` with each of kgen's provided `headers` copied in where it is included (one it does
    not include is skipped), as a hand-written kernel that changes that code would do: a mutant of
    shared device code or of a kernel body edits the copy."""
    for header in (headers,) if isinstance(headers, str) else headers:
        include = f'#include "{header}"\n'
        assert source.count(include) <= 1, f"{header} is included more than once"
        source = source.replace(include, kgen_headers()[header])
    return source


def inline_prefill_body(source: str) -> str:
    """`source` with kgen's provided paged_prefill.cuh copied in as kernel code (its MMA switch 1,
    for sm_80+ and the CPU backend alike: a kernel source may not branch on the compiler), as a
    hand-written prefill that edits the body would do."""
    body = kgen_headers()["kgen/bodies/paged_prefill.cuh"]
    start = body.index("#if !defined(KGEN_SIMT)")
    body = body[:start] + body[body.index("#endif", start) + len("#endif"):]
    body = body.replace("KGEN_PREFILL_HAS_MMA", "1").replace("#pragma once", "")
    include = '#include "kgen/bodies/paged_prefill.cuh"\n'
    assert source.count(include) == 1
    return source.replace(include, body)


def inlined_prefill_kernel(spec, config, mutations=(), parts=()):
    """The rendered kernel with templates/common/paged_prefill.cuh copied in (as kernel code: the MMA
    switch is 1 for sm_80+ and the CPU backend alike), then the provided attention `parts` it includes,
    and `mutations` (old, new) applied to the copy, built for the CPU backend."""
    rendered = render(spec, config)
    source = inline_provided(inline_prefill_body(rendered.source), parts)
    for old, new in mutations:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return kernel_from_source(spec, source, backend="cpu", config=rendered.config, archs=[])


# ---- outputs against the reference ----------------------------------------------------


def reference_check(spec, args: dict, out, name: str = "output") -> CaseResult:
    """One decode call's output against the float64 reference, with the verifier's derived
    bound (kgen.verify.judge.bounds.check_output, against the same attention in the q dtype)."""
    ref, _ = attention_outputs(spec, args["q"], args)
    round_to = None if spec.dtype.q == "fp32" else args["q"].dtype
    lowp, _ = attention_outputs(spec, args["q"], args, dtype=np.float32, round_to=round_to)
    seq_lens = [int(n) for n in np.asarray(args["seq_lens"])]
    return check_output(name, seq_lens, np.asarray(out), ref, lowp.astype(np.float64), spec.dtype.resolved_out)


def assert_lse_matches(spec, args: dict, lse) -> None:
    """The LSE is computed and returned in fp32 from the exact inputs, so it must agree with
    the float64 reference to the fp32 accumulation floor of the verifier's bound."""
    _, ref_lse = attention_outputs(spec, args["q"], args)
    err = float(np.max(np.abs(np.asarray(lse, np.float64) - ref_lse)))
    bound = 64 * EPS_FP32 * float(np.max(np.abs(ref_lse)))
    assert np.all(np.isfinite(lse)) and err <= bound, f"LSE error {err:.3g} > bound {bound:.3g}"


# ---- paging --------------------------------------------------------------------------


def fingerprint(m: KVCacheManager) -> tuple:
    """Everything observable about a manager (and its internal free lists), to assert
    that a refused call left it exactly as it was."""
    st = m._store
    seqs = tuple(
        (sid, s.on_cpu, st.tokens[s.slot, : st.lens[s.slot]].tobytes(), st.blocks(s.slot, m.block_size).tobytes(),
         tuple(s.hashes), s.arrival, s.computed)
        for sid, s in sorted(m._seqs.items())
    )  # fmt: skip
    cache = () if m._cache is None else (tuple(m._cache.lru), tuple(sorted(m._cache.hash_of.items())))
    return (
        tuple(m._n.items()),
        seqs,
        tuple(m._gpu.free_blocks()),
        tuple(m._cpu.free_blocks()),
        m._gpu.refcount.tobytes(),
        m._cpu.refcount.tobytes(),
        cache,
        tuple(m._pending.items()),
    )


@pytest.fixture
def strict_cuda(monkeypatch):
    """kgen's CUDA backend against the strict model of the driver and CuPy (tests/strict_cuda/): the
    model's Driver, whose records the test reads. Anything the model reports and the test did not
    take (`driver.violations.clear()` after checking them) fails the test at teardown."""
    from strict_cuda import install, uninstall

    driver = install(monkeypatch)
    yield driver
    uninstall()
    assert not driver.violations, "the strict CUDA model reported:\n" + "\n".join(driver.violations)
