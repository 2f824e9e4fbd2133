"""Run a kernel's case matrix against the contiguous float64 reference (docs/verification.md)."""

from __future__ import annotations

import math
import time

import numpy as np

from kgen.arrays import args_to_backend, to_numpy
from kgen.dtypes import dtype
from kgen.errors import KernelRuntimeError
from kgen.families.decode_cases import make_decode_case
from kgen.reference import attention_decode
from kgen.seeds import fresh_seed
from kgen.verify.bounds import EPS_FP32, K_FACTOR, check_output
from kgen.verify.isolation import failed_run
from kgen.verify.report import CaseResult, VerificationReport


def decode_case_matrix(spec, config: dict, rng: np.random.Generator) -> list[tuple[str, list[int], bool]]:
    """(name, seq_lens, share_prefix) for every case of the matrix; the case named
    'padded_pool' passes the caches as strided views (see cases.make_decode_case)."""
    B = spec.kv_cache.block_size
    long_len = max(5 * B + 3, 300)
    lens = {"len_1": 1, "len_B-1": B - 1, "len_B": B, "len_B+1": B + 1, "len_2B+1": 2 * B + 1, "long": long_len}
    P = config.get("partition_size", 0)
    if P:
        lens |= {"len_P-1": P - 1, "len_P": P, "len_P+1": P + 1, "len_2P+1": 2 * P + 1}
    W = spec.attention.sliding_window
    if W:
        lens |= {"len_W-1": W - 1, "len_W": W, "len_W+1": W + 1, "len_W+2B+1": W + 2 * B + 1}
    if not spec.tail_masking:  # the contract: every length a multiple of B
        lens = {f"{k}(rounded)": max(B, -(-v // B) * B) for k, v in lens.items()}
    cases = [(name, [n], False) for name, n in lens.items() if n >= 1]
    mixed = sorted({n for _, (n,), _ in cases} | {int(x) for x in rng.integers(1, long_len + 1, size=3)})
    if not spec.tail_masking:
        mixed = sorted({max(B, -(-n // B) * B) for n in mixed})
    rng.shuffle(mixed)
    cases.append(("mixed_batch", [int(x) for x in mixed], False))
    a, b = 3 * B + max(1, B // 2), 2 * B + 1
    if not spec.tail_masking:
        a, b = 3 * B, 2 * B
    cases.append(("shared_prefix", [a, b], True))
    pad = [2 * B + 1, max(1, B // 2)] if spec.tail_masking else [2 * B, B]
    cases.append(("padded_pool", pad, False))  # strided pools: padding between blocks, heads, K and V
    return cases


def verify(kernel, seed: int | None = None, cases: list[str] | None = None) -> VerificationReport:
    """Run the case matrix on `kernel` with fresh random inputs (the seed is recorded)."""
    spec = kernel.spec
    if spec.kind in ("cache_write", "copy_blocks"):
        from kgen.verify.bitexact import verify_cache_kernel
        return verify_cache_kernel(kernel, seed=seed)
    if spec.kind != "paged_decode":
        from kgen.errors import UnsupportedError

        raise UnsupportedError(f"{spec.name}: no verifier for kind '{spec.kind}' yet")
    seed = int(seed if seed is not None else fresh_seed())
    rng = np.random.default_rng(seed)
    report = VerificationReport(spec.name, kernel.backend, seed, dict(kernel.config))
    start = time.perf_counter()
    low = dtype(spec.dtype.q).numpy
    round_to = None if spec.dtype.q == "fp32" else low
    for name, lens, share in decode_case_matrix(spec, kernel.config, rng):
        if cases is not None and name not in cases:
            continue
        args = make_decode_case(spec, lens, rng, share_prefix=share, padded=name == "padded_pool")
        ref, ref_lse = attention_decode(spec, args["q"], args)
        lowp, lowp_lse = attention_decode(spec, args["q"], args, dtype=np.float32, round_to=round_to)
        want_lse = name == "mixed_batch"
        dev_args = args_to_backend(args, kernel.backend)
        try:
            result = kernel(**dev_args, return_lse=True) if want_lse else kernel(**dev_args)
        except KernelRuntimeError as e:  # a crash, abort or hang of an isolated kernel: this case's verdict
            report.cases.append(failed_run(name, lens, e))
            break
        out = result[0] if want_lse else result
        case = check_output(name, lens, to_numpy(out), ref, lowp.astype(np.float64), spec.dtype.resolved_out)
        report.cases.append(case)
        if want_lse:
            lse = to_numpy(result[1]).astype(np.float64)
            lerr = np.abs(lse - ref_lse)
            lbound = K_FACTOR * float(np.max(np.abs(lowp_lse - ref_lse))) + float(
                np.max(np.abs(ref_lse))) * 64 * EPS_FP32
            ok = bool(np.all(np.isfinite(lse)) and np.all(lerr <= lbound))
            report.cases.append(CaseResult("mixed_batch_lse", lens, float(np.nanmax(lerr)) if np.isfinite(lse).all()
                                           else math.nan, lbound, 0.0, ok))
    report.seconds = time.perf_counter() - start
    return report
