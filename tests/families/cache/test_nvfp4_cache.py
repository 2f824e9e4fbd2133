"""nvfp4 caches in cache_write and copy_blocks: every cache and block-scale byte bit-exact against
the reference quantizer (kgen/formats/nvfp4.py) on the CPU backend, skipped slots untouched, the
block-scale pools copied with the blocks, and the call's argument errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kgen
from kgen.errors import ArgumentError
from kgen.formats import nvfp4
from kgen.verify.runner import verify

SPEC = "specs/cache_write_fp8_e4m3.yaml"
H, D, B = 2, 64, 8


def spec(order: str, q: str = "bf16", kind: str = "cache_write", head_dim: int = D):
    return kgen.load_spec(SPEC).with_overrides(
        name=f"nv_{kind}_{order}_{q}_{head_dim}", kind=kind,
        kv_cache={"dtype": "nvfp4", "scale": "none", "layout": "separate", "order": order, "block_size": B},
        **{"dtype.q": q, "attention.head_dim": head_dim, "attention.num_kv_heads": H})


@pytest.fixture(scope="module")
def writers():
    return {order: kgen.build(spec(order), backend="cpu", verify=False, archs=["sm_90"]) for order in ("NHD", "HND")}


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_verification_matrix_passes(writers, order):
    report = verify(writers[order], seed=77)
    assert report.passed, report.summary() + "\n" + "\n".join(c.note for c in report.failed_cases)
    assert "edge_values" in {c.name for c in report.cases}


def _pools(rng, order, N, head_dim=D):
    lead = (N, B, H) if order == "NHD" else (N, H, B)
    return (rng.integers(0, 256, (*lead, head_dim // 2), dtype=np.uint8),
            rng.integers(0, 256, (*lead, head_dim // 16), dtype=np.uint8))


def _row(arr, order, blk, off, h):
    return arr[blk, off, h] if order == "NHD" else arr[blk, h, off]


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_every_byte_matches_the_reference_quantizer(writers, order):
    rng = np.random.default_rng(5)
    T, N = 9, 4
    key = (rng.normal(0, 1, (T, H, D)) * rng.choice([1e-4, 1, 300], (T, H, 1))).astype(ml_dtypes.bfloat16)
    value = rng.normal(0, 1, (T, H, D)).astype(ml_dtypes.bfloat16)
    key[0, 0, :16] = 0.0
    key[1, 1, 3], key[2, 0, 20], key[3, 1, 40] = np.nan, np.inf, -1e-30
    (kc, ks), (vc, vs) = _pools(rng, order, N), _pools(rng, order, N)
    before = [a.copy() for a in (kc, ks, vc, vs)]
    slots = np.array([3, 17, -1, 30, 8, 0, 25, -1, 12], dtype=np.int32)
    writers[order](key=key, value=value, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, slot_mapping=slots,
                   k_tensor_scale=0.004, v_tensor_scale=np.float32(1.5))
    written = set()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        blk, off = divmod(int(slot), B)
        written.add((blk, off))
        for x, c, s, ts in ((key, kc, ks, 0.004), (value, vc, vs, 1.5)):
            packed, scales = nvfp4.quantize(x[t], ts)
            for h in range(H):
                assert np.array_equal(_row(c, order, blk, off, h), packed[h]), (t, h)
                assert np.array_equal(_row(s, order, blk, off, h), scales[h]), (t, h)
    for got, old in zip((kc, ks, vc, vs), before, strict=True):
        for blk in range(N):
            for off in range(B):
                if (blk, off) not in written:
                    for h in range(H):
                        assert np.array_equal(_row(got, order, blk, off, h), _row(old, order, blk, off, h))


def _call(rng, **over):
    (kc, ks), (vc, vs) = _pools(rng, "NHD", 2), _pools(rng, "NHD", 2)
    args = dict(key=np.ones((1, H, D), ml_dtypes.bfloat16), value=np.ones((1, H, D), ml_dtypes.bfloat16),
                k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, slot_mapping=np.zeros(1, np.int32),
                k_tensor_scale=1.0, v_tensor_scale=1.0)
    args.update(over)
    return {k: v for k, v in args.items() if v is not None}


@pytest.mark.parametrize(("over", "message"), [
    ({"k_tensor_scale": None}, "k_tensor_scale: required for an nvfp4 cache"),
    ({"v_tensor_scale": 0.0}, "v_tensor_scale = 0.0: scales must be positive and finite"),
    ({"k_tensor_scale": float("inf")}, "k_tensor_scale = inf"),
    ({"v_scale": None}, "v_scale: required for an nvfp4 cache"),
    ({"k_scale": np.zeros((2, B, H, D // 16), np.float32)}, "k_scale: expected dtype fp8_e4m3, got fp32"),
    ({"k_scale": np.zeros((2, B, H, D // 8), np.uint8)}, "k_scale: expected shape"),
    ({"k_cache": np.zeros((2, B, H, D), np.uint8)}, "k_cache: expected shape [2, 8, 2, 32]"),
    ({"v_cache": np.zeros((2, B, H, D // 2), np.float16)}, "v_cache: expected dtype nvfp4, got fp16"),
])
def test_argument_errors_name_what_is_wrong(writers, over, message):
    with pytest.raises(ArgumentError) as err:
        writers["NHD"](**_call(np.random.default_rng(0), **over))
    assert message in str(err.value)


def test_block_scales_as_float8_are_accepted(writers):
    rng = np.random.default_rng(3)
    args = _call(rng)
    as_u8 = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    args["k_scale"] = args["k_scale"].view(ml_dtypes.float8_e4m3fn)
    writers["NHD"](**args)
    writers["NHD"](**as_u8)
    assert np.array_equal(args["k_scale"].view(np.uint8), as_u8["k_scale"])
    assert np.array_equal(args["k_cache"], as_u8["k_cache"])


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_copy_blocks_copies_caches_and_block_scales(order):
    kern = kgen.build(spec(order, kind="copy_blocks"), backend="cpu", archs=[])
    assert kern.report.passed, kern.report.summary()
    rng = np.random.default_rng(9)
    (kc, ks), (vc, vs) = _pools(rng, order, 6), _pools(rng, order, 6)
    before = [a.copy() for a in (kc, vc, ks, vs)]
    pairs = np.array([[1, 4], [2, 0]], np.int32)
    kern(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, pairs=pairs)
    for got, old in zip((kc, vc, ks, vs), before, strict=True):
        exp = old.copy()
        exp[pairs[:, 1]] = old[pairs[:, 0]]
        assert np.array_equal(got, exp)
    with pytest.raises(ArgumentError, match="k_scale: missing|missing argument 'k_scale'"):
        kern(k_cache=kc, v_cache=vc, pairs=pairs)
