"""Every number conversion the CPU backend runs, against the PTX ISA's definitions transcribed in
tests/runtime/ptx_numbers.py (not derived from the emulation): the runtime's own float-to-integer
conversions, __saturatef, integer-to-float and __byte_perm (templates/simt/kgen_simt_device.h),
and the fp16 / bf16 / fp8 conversions it takes from NVIDIA's headers compiled for the host, as
kgen's kernels call them (kgen::from_float, kgen::pack2, kgen::to_float, the packed
kgen::Widen<T>::word, and cvt.rn.satfinite to e4m3 / e5m2 as the cache writer quantizes). One
compiled module; each kernel converts a whole table."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ptx_numbers import (
    BF16,
    E4M3,
    E5M2,
    F16,
    INT32,
    UINT32,
    byte_perm,
    cvt_int,
    cvt_rn_f32_int,
    cvt_sat_f32,
)

from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

KERNELS = r"""
#define KGEN_GRID_LOOP(i, n) for (int i = threadIdx.x; i < (n); i += blockDim.x)
// Float -> narrow formats, 6 rows of n: f16 bits, bf16 bits, e4m3 and e5m2 codes (satfinite), and
// the .f16x2 / .bf16x2 words of the pair (x, -x) (pack2: the first value in the low half).
extern "C" __global__ void narrow(const float* x, int n, unsigned* out) {
  KGEN_GRID_LOOP(i, n) {
    const __half h = kgen::from_float<__half>(x[i]);
    const __nv_bfloat16 b = kgen::from_float<__nv_bfloat16>(x[i]);
    unsigned short hb, bb;
    memcpy(&hb, &h, 2);
    memcpy(&bb, &b, 2);
    out[i] = hb;
    out[n + i] = bb;
    out[2 * n + i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
    out[3 * n + i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E5M2);
    out[4 * n + i] = kgen::pack2<__half>(x[i], -x[i]);
    out[5 * n + i] = kgen::pack2<__nv_bfloat16>(x[i], -x[i]);
  }
}
// Float -> integer, 6 rows: __float2int_rn/rz/rd/ru, __float2uint_rn, the bits of __saturatef.
extern "C" __global__ void to_int(const float* x, int n, int* out) {
  KGEN_GRID_LOOP(i, n) {
    out[i] = __float2int_rn(x[i]);
    out[n + i] = __float2int_rz(x[i]);
    out[2 * n + i] = __float2int_rd(x[i]);
    out[3 * n + i] = __float2int_ru(x[i]);
    out[4 * n + i] = (int)__float2uint_rn(x[i]);
    out[5 * n + i] = __float_as_int(__saturatef(x[i]));
  }
}
// Integer -> float, 2 rows: __int2float_rn of v, __uint2float_rn of (unsigned)v.
extern "C" __global__ void from_int(const int* v, int n, float* out) {
  KGEN_GRID_LOOP(i, n) {
    out[i] = __int2float_rn(v[i]);
    out[n + i] = __uint2float_rn((unsigned)v[i]);
  }
}
// 16-bit codes -> float, 4 rows of n (n even): to_float of __half and of __nv_bfloat16, then the
// packed Widen of each word of two codes.
extern "C" __global__ void widen16(const unsigned short* c, int n, float* out) {
  KGEN_GRID_LOOP(i, n) {
    __half h;
    __nv_bfloat16 b;
    memcpy(&h, c + i, 2);
    memcpy(&b, c + i, 2);
    out[i] = kgen::to_float(h);
    out[n + i] = kgen::to_float(b);
  }
  KGEN_GRID_LOOP(w, n / 2) {
    const unsigned word = (unsigned)c[2 * w] | ((unsigned)c[2 * w + 1] << 16);
    kgen::Widen<__half>::word(word, out + 2 * n + 2 * w);
    kgen::Widen<__nv_bfloat16>::word(word, out + 3 * n + 2 * w);
  }
}
// The 256 fp8 codes -> float, 4 rows of 256: to_float of e4m3 and e5m2, then the packed Widen.
extern "C" __global__ void widen8(const unsigned char* c, float* out) {
  KGEN_GRID_LOOP(i, 256) {
    __nv_fp8_e4m3 a;
    __nv_fp8_e5m2 b;
    a.__x = c[i];
    b.__x = c[i];
    out[i] = kgen::to_float(a);
    out[256 + i] = kgen::to_float(b);
  }
  KGEN_GRID_LOOP(w, 64) {
    unsigned word;
    memcpy(&word, c + 4 * w, 4);
    kgen::Widen<__nv_fp8_e4m3>::word(word, out + 512 + 4 * w);
    kgen::Widen<__nv_fp8_e5m2>::word(word, out + 768 + 4 * w);
  }
}
extern "C" __global__ void byte_perm(const unsigned* xys, int n, unsigned* out) {
  KGEN_GRID_LOOP(i, n) out[i] = __byte_perm(xys[3 * i], xys[3 * i + 1], xys[3 * i + 2]);
}
"""
NAMES = ["narrow", "to_int", "from_int", "widen16", "widen8", "byte_perm"]


@pytest.fixture(scope="module")
def module():
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "convert.cuh"))
    return CpuModule.from_source(head + text + KERNELS, NAMES)


def _run(module, name, *args):
    module.launch(Launch(name, (1, 1, 1), (64, 1, 1), 0, list(args)))


def _f32(values) -> np.ndarray:
    return np.array(values, dtype=np.float64).astype(np.float32)


def rounding_probes(fmt, sample: int | None, seed: int = 0) -> np.ndarray:
    """Float32 inputs that decide a round-to-nearest-even: each value of `fmt`, each midpoint
    between neighbours and one float32 step either side of it (all neighbours, or `sample` of them
    plus the smallest and largest), both signs; then overflow, infinities, zeros and NaN."""
    pairs = fmt.neighbours()
    if sample is not None:
        rng = np.random.default_rng(seed)
        keep = set(rng.choice(len(pairs), sample, replace=False).tolist()) | set(range(8)) | set(
            range(len(pairs) - 8, len(pairs)))
        pairs = [pairs[i] for i in sorted(keep)]
    out = []
    for lo, hi in pairs:
        mid = np.float32((lo + hi) / 2)
        assert float(mid) == (lo + hi) / 2  # the midpoint is a float32: the probe is a true tie
        out += [lo, hi, mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))]
    top = fmt.max_norm
    out += [top * 1.0625, top * 1.5, top * 4, 3.0e38, math.inf, 0.0, 1e-45, math.nan]
    with np.errstate(over="ignore"):  # bf16's top * 4 is beyond float32: infinity, also a probe
        x = _f32(out)
    return np.concatenate([x, -x]).astype(np.float32)


def _check_narrow(got_codes, x, fmt, satfinite):
    for xi, code in zip(x.tolist(), got_codes.tolist(), strict=True):
        want = fmt.encode_rn(xi, satfinite)
        if want is None:
            assert math.isnan(fmt.decode(code)), (fmt.name, xi, hex(code))
            if fmt is E4M3:
                assert code in (0x7F, 0xFF), hex(code)  # PTX ISA 5.2.3: e4m3's only NaNs
        else:
            assert code == want, (fmt.name, xi, hex(code), hex(want))


@pytest.mark.parametrize("fmt,row,satfinite,sample", [(F16, 0, False, 3000), (BF16, 1, False, 3000),
                                                      (E4M3, 2, True, None), (E5M2, 3, True, None)],
                         ids=["f16", "bf16", "e4m3", "e5m2"])
def test_float_to_narrow_rounds_to_nearest_even(module, fmt, row, satfinite, sample):
    """cvt.rn.f16.f32 / cvt.rn.bf16.f32 (overflow to infinity) and cvt.rn.satfinite.e4m3x2 /
    .e5m2x2 (overflow to MAX_NORM, NaN stays NaN): ties, one step off a tie, subnormals, the top."""
    x = rounding_probes(fmt, sample, seed=row)
    out = np.zeros(6 * x.size, np.uint32)
    _run(module, "narrow", x, x.size, out)
    _check_narrow(out.reshape(6, -1)[row] & ((1 << fmt.bits) - 1), x, fmt, satfinite)


@pytest.mark.parametrize("fmt,row", [(F16, 4), (BF16, 5)], ids=["f16x2", "bf16x2"])
def test_pack2_puts_the_first_value_in_the_low_half(module, fmt, row):
    """The .f16x2 / .bf16x2 register of the mma fragments: element 2j in bits 0-15, 2j+1 in 16-31."""
    x = rounding_probes(fmt, 300, seed=7)
    out = np.zeros(6 * x.size, np.uint32)
    _run(module, "narrow", x, x.size, out)
    words = out.reshape(6, -1)[row]
    _check_narrow(words & 0xFFFF, x, fmt, False)
    _check_narrow(words >> 16, -x, fmt, False)


def test_the_tables_round_ties_to_even():
    """A check of the tables themselves on values worked out by hand: e4m3 1.0 is 0x38 and its
    step is 1/8, so 1.0625 (a tie) goes to the even 1.0 and 1.1875 to 1.25 (0x3A); bf16 1 + 2^-8
    is a tie between 1.0 and 1 + 2^-7 and goes to 1.0 (0x3F80); e5m2 overflows to 57344 (0x7B)."""
    assert E4M3.encode_rn(1.0625, True) == 0x38 and E4M3.encode_rn(1.1875, True) == 0x3A
    assert E4M3.encode_rn(-1.0625, True) == 0xB8 and E4M3.encode_rn(1e9, True) == 0x7E
    assert BF16.encode_rn(1 + 2.0 ** -8) == 0x3F80 and BF16.encode_rn(1 + 3 * 2.0 ** -8) == 0x3F82
    assert E5M2.encode_rn(1e9, True) == 0x7B and F16.encode_rn(65520.0) == 0x7C00 and F16.encode_rn(65519.0) == 0x7BFF


def test_every_16_bit_code_widens_to_its_value(module):
    codes = np.arange(1 << 16, dtype=np.uint16)
    out = np.zeros(4 << 16, np.float32)
    _run(module, "widen16", codes, codes.size, out)
    rows = out.reshape(4, -1)
    for fmt, scalar, packed in ((F16, rows[0], rows[2]), (BF16, rows[1], rows[3])):
        want = np.array([fmt.decode(c) for c in range(1 << 16)], np.float64).astype(np.float32)
        for got in (scalar, packed):
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(got), nan), fmt.name
            assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), fmt.name  # -0 too


def test_every_fp8_code_widens_to_its_value(module):
    codes = np.arange(256, dtype=np.uint8)
    out = np.zeros(1024, np.float32)
    _run(module, "widen8", codes, out)
    rows = out.reshape(4, 256)
    for fmt, scalar, packed in ((E4M3, rows[0], rows[2]), (E5M2, rows[1], rows[3])):
        want = np.array([fmt.decode(c) for c in range(256)], np.float64).astype(np.float32)
        for got in (scalar, packed):
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(got), nan), fmt.name
            assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)), fmt.name
    assert E4M3.max_norm == 448.0 and E5M2.max_norm == 57344.0  # the formats' known extremes


def _int_probes() -> np.ndarray:
    ties = [k + 0.5 for k in range(-6, 6)]
    edges = [2.0 ** 31, 2.0 ** 31 - 128, -(2.0 ** 31), -(2.0 ** 31) - 256, 2.0 ** 32, 2.0 ** 32 - 256, 3e9, -3e9,
             1e20, -1e20, math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-40, -0.7, 0.7, 1.0, -1.0, 1.5, 0.9999999]
    rng = np.random.default_rng(3)
    return _f32(ties + edges + (rng.standard_normal(200) * 1e4).tolist())


def test_float_to_integer_rounds_clamps_and_zeroes_nan(module):
    """cvt.{rni,rzi,rmi,rpi}.s32.f32 and cvt.rni.u32.f32: out-of-range inputs clamp, NaN gives 0."""
    x = _int_probes()
    out = np.zeros(6 * x.size, np.int32)
    _run(module, "to_int", x, x.size, out)
    rows = out.reshape(6, -1)
    for row, mode in enumerate(("rn", "rz", "rd", "ru")):
        want = [cvt_int(float(v), mode, INT32) for v in x]
        assert rows[row].tolist() == want, mode
    assert rows[4].view(np.uint32).tolist() == [cvt_int(float(v), "rn", UINT32) for v in x]
    sat = rows[5].view(np.float32)
    want = _f32([cvt_sat_f32(float(v)) for v in x])
    assert np.array_equal(sat.view(np.uint32), want.view(np.uint32))  # NaN -> +0, -0 stays -0


def test_integer_to_float_rounds_to_nearest_even(module):
    ints = [0, 1, -1, (1 << 24) + 1, (1 << 24) + 3, -(1 << 24) - 1, (1 << 25) + 2, (1 << 25) + 6, 2147483647,
            -2147483648, 123456789, -987654321]
    v = np.array(ints, np.int32)
    out = np.zeros(2 * v.size, np.float32)
    _run(module, "from_int", v, v.size, out)
    rows = out.reshape(2, -1)
    assert rows[0].tolist() == [cvt_rn_f32_int(i) for i in ints]
    assert rows[1].tolist() == [cvt_rn_f32_int(i & 0xFFFFFFFF) for i in ints]


def test_byte_perm_follows_cuda_s_definition(module):
    rng = np.random.default_rng(11)
    xys = rng.integers(0, 1 << 32, (500, 3), dtype=np.uint64).astype(np.uint32)
    xys[:, 2] |= 0x8888  # bit 3 of each selector nibble: not used
    out = np.zeros(500, np.uint32)
    _run(module, "byte_perm", xys.reshape(-1), 500, out)
    assert out.tolist() == [byte_perm(int(a), int(b), int(s)) for a, b, s in xys]
