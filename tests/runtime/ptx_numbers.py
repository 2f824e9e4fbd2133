"""The PTX ISA's number formats and conversions, transcribed for the CPU backend's tests from the
ISA's text, independently of the emulation (templates/simt/kgen_simt_device.h) and of NVIDIA's
host-side header code it compiles (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h). Section numbers are
those of PTX ISA 8.x/9.0, titles given too.

- 5.2.1 "Fundamental Types" / 5.2.3 "Alternate Floating-Point Data Formats": f16 (IEEE 754
  binary16: 5 exponent bits, 10 mantissa bits), bf16 (8, 7), e4m3 (4, 3; "does not support
  infinity and NaN values are limited to 0x7f and 0xff"), e5m2 (5, 2; IEEE-style: an all-ones
  exponent is infinity or NaN). Exponent bias 2^(E-1) - 1 (IEEE 754's rule; 7 and 15 for the FP8
  formats, as the OCP 8-bit floating point specification states).
- 9.7.9.21 "cvt": `.rn` "rounding to nearest, with ties to even"; `.satfinite`: "if the input
  value is NaN, then the result is NaN in the specified destination format. If the absolute
  value of input is greater than MAX_NORM ... the result is sign-preserved MAX_NORM"; without it
  a round-to-nearest overflow is an infinity (IEEE 754). Integer rounding `.rni` (nearest, even
  on a tie), `.rzi` (toward zero), `.rmi` (toward -inf), `.rpi` (toward +inf); "For
  float-to-integer conversions, the result is clamped to the destination range by default";
  a NaN input gives zero (an .f32 source and a 32-bit destination). Floating-point `.sat`:
  "limits the result to the range [0.0, 1.0]. NaN results are flushed to positive zero".
- The CUDA Math API's `__byte_perm(x, y, s)`: the eight input bytes are x's bytes 0-3 then y's;
  result byte n is input byte s<4n+2:4n> (bit 3 of each selector nibble is not used).

Python floats (binary64) hold every value of these formats and every midpoint between two
neighbours exactly, so the rounding below is exact."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Format:
    name: str
    ebits: int
    mbits: int
    ieee_specials: bool  # an all-ones exponent is inf/NaN (f16, bf16, e5m2); e4m3: only S.1111.111 is NaN

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    def decode(self, code: int) -> float:
        sign = -1.0 if code >> (self.ebits + self.mbits) & 1 else 1.0
        exp = code >> self.mbits & ((1 << self.ebits) - 1)
        man = code & ((1 << self.mbits) - 1)
        top = (1 << self.ebits) - 1
        if self.ieee_specials and exp == top:
            return sign * math.inf if man == 0 else math.nan
        if not self.ieee_specials and exp == top and man == (1 << self.mbits) - 1:
            return math.nan
        if exp == 0:
            return sign * man * 2.0 ** (1 - self.bias - self.mbits)
        return sign * (1 + man / (1 << self.mbits)) * 2.0 ** (exp - self.bias)

    @cached_property
    def _finite(self) -> tuple[list[float], list[int]]:
        """The non-negative finite values in increasing order (codes increase with them)."""
        vals, codes = [], []
        for c in range(1 << (self.ebits + self.mbits)):
            v = self.decode(c)
            if math.isfinite(v):
                vals.append(v)
                codes.append(c)
        return vals, codes

    @property
    def max_norm(self) -> float:
        return self._finite[0][-1]

    def encode_rn(self, x: float, satfinite: bool = False) -> int | None:
        """cvt.rn{.satfinite} of `x`: the code, or None for a NaN (whose bits the ISA leaves open
        but for e4m3: 0x7f/0xff)."""
        if math.isnan(x):
            return None
        sign = (1 << (self.bits - 1)) if math.copysign(1.0, x) < 0 else 0
        a = abs(x)
        vals, codes = self._finite
        top_code = codes[-1]
        if a > self.max_norm:
            if satfinite or not self.ieee_specials:
                return sign | top_code
            ulp = self.max_norm - vals[-2]
            # the next value up would be max + ulp (odd max: a tie goes to the even one, infinity)
            return sign | (top_code if a < self.max_norm + ulp / 2 else top_code + 1)
        i = bisect.bisect_left(vals, a)
        if vals[i] == a:
            return sign | codes[i]
        lo, hi = i - 1, i
        dl, dh = a - vals[lo], vals[hi] - a
        pick = lo if dl < dh else hi if dh < dl else (lo if codes[lo] % 2 == 0 else hi)
        return sign | codes[pick]

    def neighbours(self) -> list[tuple[float, float]]:
        """Every pair of adjacent non-negative finite values."""
        vals = self._finite[0]
        return list(zip(vals, vals[1:], strict=False))


F16 = Format("f16", 5, 10, True)
BF16 = Format("bf16", 8, 7, True)
E4M3 = Format("e4m3", 4, 3, False)
E5M2 = Format("e5m2", 5, 2, True)

INT32 = (-(1 << 31), (1 << 31) - 1)
UINT32 = (0, (1 << 32) - 1)


def cvt_int(x: float, mode: str, lo_hi: tuple[int, int]) -> int:
    """cvt.{rni,rzi,rmi,rpi}.{s32,u32}.f32: rounded, clamped to the destination's range, NaN -> 0."""
    if math.isnan(x):
        return 0
    if math.isinf(x):
        return lo_hi[1] if x > 0 else lo_hi[0]
    r = {"rn": round, "rz": math.trunc, "rd": math.floor, "ru": math.ceil}[mode](x)  # round(): ties to even
    return min(max(r, lo_hi[0]), lo_hi[1])


def cvt_sat_f32(x: float) -> float:
    """cvt.sat.f32.f32 (__saturatef): clamped to [0, 1], NaN -> +0."""
    return 0.0 if math.isnan(x) else min(max(x, 0.0), 1.0)


def byte_perm(x: int, y: int, s: int) -> int:
    data = (x & 0xFFFFFFFF) | (y & 0xFFFFFFFF) << 32
    return sum(((data >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def cvt_rn_f32_int(i: int) -> float:
    """cvt.rn.f32.{s32,u32}: the integer rounded to 24 significant bits, ties to even."""
    a = abs(i)
    shift = max(0, a.bit_length() - 24)
    q, r = divmod(a, 1 << shift)
    if shift and (r > 1 << (shift - 1) or (r == 1 << (shift - 1) and q % 2)):
        q += 1
    return math.copysign(float(q << shift), i) if i else 0.0
