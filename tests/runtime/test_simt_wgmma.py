"""The CPU runtime's wgmma.mma_async m64nNk16 (templates/common/hopper.cuh, CPU side:
templates/simt/kgen_simt_wgmma.h) against the PTX ISA: the accumulator fragment each thread of the
warpgroup holds, A from registers (the m16n8k16 A fragment per warp) or from shared memory, B from
shared memory through matrix descriptors, for every descriptor mode (K-major and MN-major; no
swizzle, 32B, 64B, 128B) of A and of B, element by element against numpy. The fragment maps, the
descriptor bits and the canonical shared-memory layouts come from tests/runtime/ptx_layouts.py
(transcribed from the PTX ISA and CuTe's documentation, independently of the emulation); the
operands are placed in shared memory by those layouts, so a misread layout reads other elements."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from gpu_module import GpuModule
from ptx_layouts import (
    canonical_layout,
    cute_swizzle,
    descriptor,
    smem_address,
    wgmma_a,
    wgmma_d,
)

from kgen.compile import wgmma_ptx
from kgen.errors import KernelRuntimeError
from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule

WIDTHS = (8, 64, 128, 256)
KERNELS = r"""
// geo: A's offset, LBO, SBO, swizzle, then B's. mode bit 0: A from registers (areg[thread*4 + r]);
// bit 1: no wgmma_wait; bit 2: no wgmma_commit (then the wait does not cover the wgmma).
// c and out: each thread's accumulator registers as they are (c[th * N/2 + i]); the host places
// them by the PTX ISA's D fragment map.
template <class T, int N>
__device__ void wg_probe(const unsigned char* img, int img_bytes, const int* geo, const unsigned* areg, const float* c,
                         float* out, int mode, int ta, int tb, int scale_d) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  for (int i = threadIdx.x; i < img_bytes; i += blockDim.x) smem[i] = img[i];
  __syncthreads();
  const int wg = threadIdx.x / 128, th = threadIdx.x % 128;
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = c[th * (N / 2) + i];
  const unsigned long long da = kgen::wgmma_desc(smem + geo[0], geo[1], geo[2], geo[3]);
  const unsigned long long db = kgen::wgmma_desc(smem + geo[4], geo[5], geo[6], geo[7]);
  unsigned a[4];
  for (int r = 0; r < 4; ++r) a[r] = areg[th * 4 + r];
  kgen::wgmma_fence();
  if (mode & 1) {
    if (tb) kgen::wgmma_rs<T, N, 1>(d, a, db, scale_d);
    else kgen::wgmma_rs<T, N, 0>(d, a, db, scale_d);
  } else if (ta) {
    if (tb) kgen::wgmma_ss<T, N, 1, 1>(d, da, db, scale_d);
    else kgen::wgmma_ss<T, N, 1, 0>(d, da, db, scale_d);
  } else {
    if (tb) kgen::wgmma_ss<T, N, 0, 1>(d, da, db, scale_d);
    else kgen::wgmma_ss<T, N, 0, 0>(d, da, db, scale_d);
  }
  if (!(mode & 4)) kgen::wgmma_commit();
  if (!(mode & 2)) kgen::wgmma_wait<0>();
  for (int i = 0; i < N / 2; ++i)
    out[(wg * 128 + th) * (N / 2) + i] = d[i];
}
"""
for _n in WIDTHS:
    for _t, _name in (("__half", "f16"), ("__nv_bfloat16", "bf16")):
        KERNELS += (f'extern "C" __global__ void wg_{_name}_{_n}(const unsigned char* img, int img_bytes, const int* geo, '
                    f"const unsigned* areg, const float* c, float* out, int mode, int ta, int tb, int scale_d) {{\n"
                    f"  wg_probe<{_t}, {_n}>(img, img_bytes, geo, areg, c, out, mode, ta, tb, scale_d);\n}}\n")
KERNELS += r"""
// Operands by bulk copy, then wgmma, as an attention kernel feeds it: Q [64][64] and K [n][64]
// 128B-swizzled K-major (S = Q K^T, four k16 steps advancing the descriptors 32 bytes), then V
// [64][64] MN-major 128B-swizzled (P V with P = S rounded to fp16 from registers, k16 steps of
// 2048 bytes). `img` holds the three 8 KB operands as the host laid them out.
extern "C" __global__ void bulk_wgmma(const unsigned char* img, float* s_out, float* o_out) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  __shared__ unsigned long long bar;
  unsigned char *sq = smem, *sk = smem + 8192, *sv = smem + 16384;  // 8 KB each
  if (threadIdx.x == 0) {
    kgen::mbar_init(&bar, 1);
    kgen::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    kgen::mbar_arrive_expect_tx(&bar, 3 * 8192);
    kgen::bulk_copy_g2s(smem, img, 3 * 8192, &bar);
  }
  kgen::mbar_wait(&bar, 0);
  float s[32];
  kgen::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk)
    kgen::wgmma_ss<__half, 64, 0, 0>(s, kgen::wgmma_desc(sq + 32 * kk, 16, 1024, 128),
                                     kgen::wgmma_desc(sk + 32 * kk, 16, 1024, 128), kk);
  kgen::wgmma_commit();
  kgen::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) s_out[threadIdx.x * 32 + i] = s[i];
  // P (the S fragment as fp16) is the A operand: the accumulator pairs of columns 16j..16j+15 are
  // exactly the m16n8k16 A registers of k-step j.
  float o[32];
  kgen::wgmma_fence();
  for (int j = 0; j < 4; ++j) {
    const unsigned a[4] = {kgen::pack2<__half>(s[8 * j], s[8 * j + 1]), kgen::pack2<__half>(s[8 * j + 2], s[8 * j + 3]),
                           kgen::pack2<__half>(s[8 * j + 4], s[8 * j + 5]), kgen::pack2<__half>(s[8 * j + 6], s[8 * j + 7])};
    kgen::wgmma_rs<__half, 64, 1>(o, a, kgen::wgmma_desc(sv + 2048 * j, 8192, 1024, 128), j);
  }
  kgen::wgmma_commit();
  kgen::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) o_out[threadIdx.x * 32 + i] = o[i];
}
// The descriptors kgen::wgmma_desc builds: n quadruples (shared offset, LBO, SBO, swizzle).
extern "C" __global__ void desc_bits(const int* q, int n, unsigned long long* out) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  if (threadIdx.x == 0)
    for (int i = 0; i < n; ++i) out[i] = kgen::wgmma_desc(smem + q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]);
}
"""
NAMES = [f"wg_{t}_{n}" for n in WIDTHS for t in ("f16", "bf16")] + ["bulk_wgmma", "desc_bits"]


@pytest.fixture(scope="module")
def module():
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "hopper.cuh"))
    return CpuModule.from_source(head + text + KERNELS, NAMES)


# ---- operands in shared memory by the PTX ISA's canonical layouts (ptx_layouts) --------------------
MODES = [(k_major, sw) for k_major in (True, False) for sw in (0, 32, 64, 128)]


def mode_id(mode) -> str:
    return f"{'K' if mode[0] else 'MN'}-major-{mode[1] or 'none'}"


def place(img: np.ndarray, base: int, mat: np.ndarray, k_major: bool, sw: int, lbo: int, sbo: int) -> None:
    """Write `mat` (MN x K, 16-bit) at `base` of the image in the canonical layout."""
    bits = mat.view(np.uint16)
    for mn in range(mat.shape[0]):
        for k in range(mat.shape[1]):
            a = smem_address(base, mn, k, k_major=k_major, swizzle=sw, lbo=lbo, sbo=sbo, mn_size=mat.shape[0],
                             k_size=mat.shape[1])
            img[a:a + 2] = np.frombuffer(bits[mn, k].tobytes(), np.uint8)


def geometry(mn: int, k_major: bool, sw: int) -> tuple[int, int, int]:
    """(LBO, SBO, bytes) of a dense MN x 16 operand. PTX ISA 9.7.15.5.1.2.1.1/.2: K-major: SBO
    steps 8 rows; LBO the two 16-byte K halves without a swizzle (unused with one). MN-major
    without a swizzle: SBO steps 8 MN elements, LBO the two 8-deep K groups; MN-major swizzled:
    LBO steps the S/2-element MN runs, SBO the K groups."""
    if k_major:
        return (128, 256, mn * 32) if sw == 0 else (16, 8 * sw, (mn + 7) // 8 * 8 * sw)
    if sw == 0:
        groups = (mn + 7) // 8
        return groups * 128, 128, groups * 256
    blocks = (mn + sw // 2 - 1) // (sw // 2)
    return 2 * 8 * sw, 8 * sw, blocks * 2 * 8 * sw


def a_fragment(a: np.ndarray) -> np.ndarray:
    """The four A registers of each of the 128 threads (PTX ISA Figure 148: a0..a7, two a register)."""
    bits = a.view(np.uint16).astype(np.uint32)
    regs = np.zeros(128 * 4, np.uint32)
    for th in range(128):
        for r in range(4):
            lo, hi = wgmma_a(th, 2 * r), wgmma_a(th, 2 * r + 1)
            regs[th * 4 + r] = bits[lo] | (bits[hi] << 16)
    return regs


def run_case(module, dt, n, *, a_regs=False, ta=0, tb=0, sw_a=128, sw_b=128, scale_d=1, warpgroups=1, seed=0,
             strides_a=None, strides_b=None):
    """One wgmma on random small integers (exact in fp32); strides_a/_b: (LBO, SBO, bytes) other
    than geometry()'s dense ones."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, (64, 16)).astype(dt)
    b = rng.integers(-8, 9, (16, n)).astype(dt)
    c = rng.integers(-64, 65, (64, n)).astype(np.float32)
    la, sa, nbytes_a = strides_a or geometry(64, not ta, sw_a)
    lb, sb, nbytes_b = strides_b or geometry(n, not tb, sw_b)
    base_b = (nbytes_a + 1023) // 1024 * 1024
    img = np.zeros(base_b + nbytes_b, np.uint8)
    place(img, 0, a, not ta, sw_a, la, sa)
    place(img, base_b, np.ascontiguousarray(b.T), not tb, sw_b, lb, sb)
    geo = np.array([0, la, sa, sw_a, base_b, lb, sb, sw_b], np.int32)
    out = np.full(warpgroups * 64 * n, np.nan, np.float32)
    name = f"wg_{'f16' if dt == np.float16 else 'bf16'}_{n}"
    module.launch(Launch(name, (1, 1, 1), (128 * warpgroups, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), d_fragment(c), out, int(a_regs), ta, tb, scale_d]))
    want = a.astype(np.float64) @ b.astype(np.float64) + (c if scale_d else 0)
    return unfragment(out, n, warpgroups), want


def d_fragment(c: np.ndarray) -> np.ndarray:
    """Each thread's N/2 accumulator registers holding C (PTX ISA Figure 149)."""
    n = c.shape[1]
    return np.array([c[wgmma_d(th, i)] for th in range(128) for i in range(n // 2)], np.float32)


def unfragment(out: np.ndarray, n: int, warpgroups: int) -> np.ndarray:
    """The kernel stores accumulator register i of thread th at th * N/2 + i (its raw fragment);
    place each by the PTX ISA's D map (Figure 149)."""
    got = np.full((warpgroups, 64, n), np.nan, np.float32)
    raw = out.reshape(warpgroups, 128, n // 2)
    for th in range(128):
        for i in range(n // 2):
            got[(slice(None), *wgmma_d(th, i))] = raw[:, th, i]
    return got


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("n", WIDTHS)
def test_accumulator_fragment_k_major_128b(module, dt, n):
    got, want = run_case(module, dt, n, warpgroups=2)
    for wg in range(2):
        np.testing.assert_array_equal(got[wg], want)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_every_descriptor_mode_of_a_and_of_b(module, mode):
    """A in this mode with B K-major 128B, then B in this mode with A K-major 128B."""
    k_major, sw = mode
    got, want = run_case(module, np.float16, 64, ta=int(not k_major), sw_a=sw, seed=sw + 1)
    np.testing.assert_array_equal(got[0], want)
    got, want = run_case(module, ml_dtypes.bfloat16, 128, tb=int(not k_major), sw_b=sw, seed=sw + 2)
    np.testing.assert_array_equal(got[0], want)


# Strides other than the dense ones: each descriptor offset placed where only its documented
# meaning finds the data (core-matrix groups interleaved the other way, or spread with gaps).
OTHER_STRIDES = [
    ((True, 0), (64 * 16, 128, 64 * 32)),            # K-major: the K halves far apart, row groups adjacent
    ((False, 0), (128, 256, 8 * 256)),               # MN-major: K groups interleaved between the MN groups
    ((False, 0), (8 * 128 + 512, 128, 2 * 8 * 128 + 512)),  # MN-major: MN groups dense, K groups after a gap
    ((False, 64), (512, 1024, 2048)),                # MN-major 64B: the two MN runs adjacent, K groups after
    ((False, 32), (512, 256, 2048)),                 # MN-major 32B: K groups interleaved between the MN runs
    ((True, 64), (16, 1024, 8 * 1024)),              # K-major 64B: 8-row groups 1 KB apart (half unused)
]


@pytest.mark.parametrize("mode,strides", OTHER_STRIDES, ids=[f"{mode_id(m)}-lbo{s[0]}-sbo{s[1]}"
                                                             for m, s in OTHER_STRIDES])
def test_each_stride_keeps_its_documented_meaning(module, mode, strides):
    """PTX ISA 9.7.15.5.1.2.1.3 / CuTe make_gmma_desc: without a swizzle an MN-major operand steps
    8 MN elements by SBO and 8-deep K groups by LBO (the swizzled modes the other way round)."""
    k_major, sw = mode
    got, want = run_case(module, np.float16, 64, ta=int(not k_major), sw_a=sw, strides_a=strides, seed=9)
    np.testing.assert_array_equal(got[0], want)
    got, want = run_case(module, np.float16, 64, tb=int(not k_major), sw_b=sw, strides_b=strides, seed=10)
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("tb", [0, 1])
@pytest.mark.parametrize("scale_d", [0, 1])
def test_a_from_registers(module, tb, scale_d):
    got, want = run_case(module, np.float16, 128, a_regs=True, tb=tb, scale_d=scale_d, seed=11)
    np.testing.assert_array_equal(got[0], want)


def _k128(module, a, b, c, mode, scale_d):
    """A and B (64 x 16, 16 x 64) K-major 128B-swizzled at 0 and 8192; the raw accumulators."""
    img = np.zeros(16384, np.uint8)
    place(img, 0, a, True, 128, 16, 1024)
    place(img, 8192, np.ascontiguousarray(b.T), True, 128, 16, 1024)
    geo = np.array([0, 16, 1024, 128, 8192, 16, 1024, 128], np.int32)
    out = np.zeros(64 * 64, np.float32)
    module.launch(Launch("wg_f16_64", (1, 1, 1), (128, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), d_fragment(c), out, mode, 0, 0, scale_d]))
    return out


@pytest.mark.parametrize("mode", [2, 4])
def test_the_accumulator_is_nan_until_the_wait_that_covers_it(module, mode):
    """Without the wait (mode 2), or waiting without having committed the wgmma (mode 4), the
    registers hold NaN: a kernel that reads them early fails its result check."""
    rng = np.random.default_rng(5)
    a = rng.integers(-8, 9, (64, 16)).astype(np.float16)
    out = _k128(module, a, a[:, :16].T.copy(), np.ones((64, 64), np.float32), mode, 1)
    assert np.isnan(out).all()


def test_a_wrong_layout_is_caught(module):
    """The reference can fail: B written MN-major but read as K-major gives another product."""
    rng = np.random.default_rng(1)
    a = rng.integers(-8, 9, (64, 16)).astype(np.float16)
    b = rng.integers(-8, 9, (16, 64)).astype(np.float16)
    lb, sb, _ = geometry(64, False, 128)
    img = np.zeros(2 * 8192, np.uint8)
    place(img, 0, a, True, 128, 16, 1024)
    place(img, 8192, np.ascontiguousarray(b.T), False, 128, lb, sb)
    geo = np.array([0, 16, 1024, 128, 8192, 16, 1024, 128], np.int32)  # B read as K-major
    out = np.zeros(64 * 64, np.float32)
    module.launch(Launch("wg_f16_64", (1, 1, 1), (128, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), np.zeros(128 * 32, np.float32), out, 0, 0, 0, 0]))
    assert not np.array_equal(unfragment(out, 64, 1)[0], a.astype(np.float64) @ b.astype(np.float64))


def test_accumulates_in_fp32(module):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((64, 16)).astype(np.float16)
    b = rng.standard_normal((16, 64)).astype(np.float16)
    c = (rng.standard_normal((64, 64)) * 1000).astype(np.float32)
    out = unfragment(_k128(module, a, b, c, 0, 1), 64, 1)[0]
    err = np.abs(out - (a.astype(np.float64) @ b.astype(np.float64) + c))
    assert err.max() < 0.25  # an fp16 accumulator would round values near 1000 to 0.5


def attention_image(q, k, v) -> np.ndarray:
    """Q and K (64 x 64) K-major 128B-swizzled, V (64 keys x 64 dims) MN-major 128B-swizzled with
    LBO 8192 (one MN run: unused) and SBO 1024, at 0, 8192 and 16384."""
    img = np.zeros(3 * 8192, np.uint8)
    place(img, 0, q, True, 128, 16, 1024)
    place(img, 8192, k, True, 128, 16, 1024)
    place(img, 16384, np.ascontiguousarray(v.T), False, 128, 8192, 1024)
    return img


def test_bulk_copied_operands_feed_wgmma_like_attention(module):
    """Q K^T with K-major 128B-swizzled operands (k16 steps by descriptor start + 32 B), then P V
    with P from the accumulator registers and V MN-major (k16 steps by 2048 B)."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.integers(-3, 4, (64, 64)).astype(np.float16) for _ in range(3))
    s_out, o_out = np.zeros(128 * 32, np.float32), np.zeros(128 * 32, np.float32)
    module.launch(Launch("bulk_wgmma", (1, 1, 1), (128, 1, 1), 3 * 8192, [attention_image(q, k, v), s_out, o_out]))
    s = q.astype(np.float64) @ k.astype(np.float64).T
    np.testing.assert_array_equal(unfragment(s_out, 64, 1)[0], s)
    np.testing.assert_array_equal(unfragment(o_out, 64, 1)[0], s.astype(np.float16).astype(np.float64) @ v)


def test_an_incomplete_warpgroup_is_refused(module):
    img = np.zeros(16384, np.uint8)
    geo = np.array([0, 16, 1024, 128, 8192, 16, 1024, 128], np.int32)
    with pytest.raises(KernelRuntimeError, match=r"wgmma.mma_async: warpgroup 0 is incomplete"):
        module.launch(Launch("wg_f16_64", (1, 1, 1), (96, 1, 1), img.size,
                             [img, img.size, geo, np.zeros(512, np.uint32), np.zeros(128 * 32, np.float32),
                              np.zeros(64 * 64, np.float32), 0, 0, 0, 1]))


def test_the_descriptor_bits_follow_the_isa(module):
    """PTX ISA 9.7.15.5.1.2.2: start, LBO and SBO >> 4 in bits 0-13, 16-29, 32-45; the swizzle
    mode (1: 128B, 2: 64B, 3: 32B) in bits 62-63."""
    quads = [(0, 16, 1024, 128), (1024 + 32, 8192, 1024, 128), (512, 256, 128, 0), (16, 2048, 4096, 64),
             (4096 + 256, 128, 262128, 32), (65520, 262128, 16, 0)]
    q = np.array(quads, np.int32).reshape(-1)
    out = np.zeros(len(quads), np.uint64)
    module.launch(Launch("desc_bits", (1, 1, 1), (32, 1, 1), 65536, [q, len(quads), out]))
    assert [int(x) for x in out] == [descriptor(*quad) for quad in quads]


def test_the_layout_transcription_reproduces_the_isa_examples():
    """A check of ptx_layouts itself: the canonical layouts with the ISA's example parameters give
    the exact layouts the ISA states for them (9.7.15.5.1.2.1.3, Figures 166-170)."""
    examples = [  # (k_major, swizzle, elem bytes, LBO, SBO, MN, K), exact layout
        ((True, 0, 4, 64 * 4, 32 * 4, 16, 16), (((8, 2), (4, 4)), ((4, 32), (1, 64)))),
        ((True, 32, 4, 16, 64 * 4, 16, 16), (((8, 2), (4, 4)), ((8, 64), (1, 4)))),
        ((False, 0, 2, 128 * 2, 64 * 2, 16, 16), (((8, 1, 2), (8, 2)), ((1, 8, 64), (8, 128)))),
        ((False, 32, 2, 128 * 2, 256 * 2, 32, 16), (((8, 2, 2), (8, 2)), ((1, 8, 128), (16, 256)))),
        ((False, 64, 2, 256 * 2, 512 * 2, 64, 16), (((8, 4, 2), (8, 2)), ((1, 8, 256), (32, 512)))),
    ]
    for (k_major, sw, eb, lbo, sbo, mn, k), exact in examples:
        assert canonical_layout(k_major, sw, lbo, sbo, eb, mn, k) == exact


def test_the_swizzle_permutes_16_byte_chunks_within_its_pattern():
    """Swizzle<B,4,3> keeps each 16-byte chunk whole and moves it only within its 2^B x 128-byte span."""
    for bits, span in ((1, 256), (2, 512), (3, 1024)):
        moved = [cute_swizzle(a, bits) for a in range(0, 2 * span, 16)]
        assert sorted(moved) == list(range(0, 2 * span, 16))
        assert all(a // span == m // span for a, m in zip(range(0, 2 * span, 16), moved, strict=True))
        assert moved != list(range(0, 2 * span, 16))
        assert all(cute_swizzle(a + 5, bits) == cute_swizzle(a, bits) + 5 for a in range(0, 2 * span, 16))


def test_fragment_maps_cover_each_matrix_once():
    for n in (8, 64, 256):
        assert sorted(wgmma_d(th, i) for th in range(128) for i in range(n // 2)) == [
            (r, c) for r in range(64) for c in range(n)]
    assert sorted(wgmma_a(th, i) for th in range(128) for i in range(8)) == [(r, c) for r in range(64)
                                                                              for c in range(16)]


def test_the_generated_ptx_block_is_current():
    text = wgmma_ptx.header_path().read_text()
    assert wgmma_ptx.block() in text


def test_bulk_copy_and_wgmma_run_clean_under_race_detection():
    """The mbarrier orders the bulk copy's writes before the warpgroup's reads; wgmma's own operand
    reads and its staging are the runtime's, not the kernel's accesses."""
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "hopper.cuh"))
    mod = CpuModule.from_source(head + text + KERNELS, ["bulk_wgmma"], race_check=True)
    rng = np.random.default_rng(2)
    q, k, v = (rng.integers(-3, 4, (64, 64)).astype(np.float16) for _ in range(3))
    img = attention_image(q, k, v)
    s_out, o_out = np.zeros(128 * 32, np.float32), np.zeros(128 * 32, np.float32)
    for schedule in ("fifo", "reverse", "shuffle"):
        mod.schedule = schedule
        mod.launch(Launch("bulk_wgmma", (1, 1, 1), (128, 1, 1), 3 * 8192, [img, s_out, o_out]))
        np.testing.assert_array_equal(unfragment(s_out, 64, 1)[0], q.astype(np.float64) @ k.astype(np.float64).T)


# ---- the same kernels on a GPU (sm_90a): the emulation's layouts against the hardware's -----------
@pytest.fixture(scope="module")
def gpu_module(tmp_path_factory):
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "hopper.cuh"))
    return GpuModule(head + text + KERNELS, NAMES, tmp_path_factory.mktemp("gpu"))


GPU_CASES = ([dict(dt=dt, n=n) for dt in (np.float16, ml_dtypes.bfloat16) for n in WIDTHS]
             + [dict(dt=np.float16, n=64, ta=ta, tb=tb, sw_a=sw, sw_b=sw) for sw in (0, 32, 64, 128)
                for ta in (0, 1) for tb in (0, 1)]
             + [dict(dt=np.float16, n=64, ta=int(not m[0]), sw_a=m[1], strides_a=st) for m, st in OTHER_STRIDES]
             + [dict(dt=np.float16, n=128, a_regs=True, tb=tb, scale_d=s) for tb in (0, 1) for s in (0, 1)])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(f"{k}={getattr(v, '__name__', v)}"
                                                                   for k, v in c.items()))
def test_the_gpu_computes_what_the_emulation_computes(gpu_module, module, case):
    case = dict(case)
    dt, n = case.pop("dt"), case.pop("n")
    got_gpu, want = run_case(gpu_module, dt, n, **case)
    got_cpu, _ = run_case(module, dt, n, **case)
    np.testing.assert_array_equal(got_gpu[0], want)
    np.testing.assert_array_equal(got_cpu[0], got_gpu[0])
