"""The CPU runtime's wgmma.mma_async m64nNk16 (templates/common/hopper.cuh, CPU side:
templates/simt/kgen_simt_wgmma.h) against the PTX ISA: the accumulator fragment each thread of the
warpgroup holds, A from registers (the m16n8k16 A fragment per warp) or from shared memory, B from
shared memory through matrix descriptors, for every swizzle mode and K-major / MN-major operands,
element by element against numpy. The layouts below are written from the PTX ISA's canonical
layouts, independently of the emulation; the kernel places each accumulator register by the
documented fragment map, so a wrong map puts values in the wrong place."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kgen.compile import wgmma_ptx
from kgen.errors import KernelRuntimeError
from kgen.paths import templates_dir
from kgen.runtime.base import Launch
from kgen.runtime.cpu import CpuModule
from kgen.runtime.tma import cpu_tensor_map

WIDTHS = (8, 64, 128, 256)
KERNELS = r"""
// geo: A's offset, LBO, SBO, swizzle, then B's. mode bit 0: A from registers (areg[thread*4 + r]);
// bit 1: no wgmma_wait; bit 2: no wgmma_commit (then the wait does not cover the wgmma).
// Accumulator register i of the thread is element (16*warp + g + 8*((i>>1)&1), 8*(i>>2) + 2*t + (i&1)).
template <class T, int N>
__device__ void wg_probe(const unsigned char* img, int img_bytes, const int* geo, const unsigned* areg, const float* c,
                         float* out, int mode, int ta, int tb, int scale_d) {
  KGEN_DYNAMIC_SMEM(unsigned char, smem);
  for (int i = threadIdx.x; i < img_bytes; i += blockDim.x) smem[i] = img[i];
  __syncthreads();
  const int wg = threadIdx.x / 128, th = threadIdx.x % 128, warp = th / 32, lane = th % 32, g = lane >> 2, t = lane & 3;
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = c[(16 * warp + g + 8 * ((i >> 1) & 1)) * N + 8 * (i >> 2) + 2 * t + (i & 1)];
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
    out[(wg * 64 + 16 * warp + g + 8 * ((i >> 1) & 1)) * N + 8 * (i >> 2) + 2 * t + (i & 1)] = d[i];
}
"""
for _n in WIDTHS:
    for _t, _name in (("__half", "f16"), ("__nv_bfloat16", "bf16")):
        KERNELS += (f'extern "C" __global__ void wg_{_name}_{_n}(const unsigned char* img, int img_bytes, const int* geo, '
                    f"const unsigned* areg, const float* c, float* out, int mode, int ta, int tb, int scale_d) {{\n"
                    f"  wg_probe<{_t}, {_n}>(img, img_bytes, geo, areg, c, out, mode, ta, tb, scale_d);\n}}\n")
KERNELS += r"""
// TMA then wgmma, as an attention kernel feeds it: Q [64][64] and K [n][64] by 128B-swizzled boxes
// (S = Q K^T, both K-major, four k16 steps advancing the descriptors 32 bytes), then V [64][n]
// row-major in boxes of 64 columns (MN-major B: P V with P = S rounded to fp16 from registers).
extern "C" __global__ void tma_wgmma(const __grid_constant__ kgen::TensorMap q, const __grid_constant__ kgen::TensorMap k,
                                     const __grid_constant__ kgen::TensorMap v, float* s_out, float* o_out) {
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
    kgen::tma_load_2d(sq, q, 0, 0, &bar);
    kgen::tma_load_2d(sk, k, 0, 0, &bar);
    kgen::tma_load_2d(sv, v, 0, 0, &bar);          // V columns 0..63: rows of 128 B, 64 rows
  }
  kgen::mbar_wait(&bar, 0);
  const int th = threadIdx.x, warp = th / 32, lane = th % 32, g = lane >> 2, t = lane & 3;
  float s[32];
  kgen::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk)
    kgen::wgmma_ss<__half, 64, 0, 0>(s, kgen::wgmma_desc(sq + 32 * kk, 16, 1024, 128),
                                     kgen::wgmma_desc(sk + 32 * kk, 16, 1024, 128), kk);
  kgen::wgmma_commit();
  kgen::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) s_out[(16 * warp + g + 8 * ((i >> 1) & 1)) * 64 + 8 * (i >> 2) + 2 * t + (i & 1)] = s[i];
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
  for (int i = 0; i < 32; ++i) o_out[(16 * warp + g + 8 * ((i >> 1) & 1)) * 64 + 8 * (i >> 2) + 2 * t + (i & 1)] = o[i];
}
"""
NAMES = [f"wg_{t}_{n}" for n in WIDTHS for t in ("f16", "bf16")] + ["tma_wgmma"]


@pytest.fixture(scope="module")
def module():
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "hopper.cuh"))
    return CpuModule.from_source(head + text + KERNELS, NAMES)


# ---- the PTX ISA's canonical shared-memory layouts (16-bit elements, T = 8 per 16 bytes) ----------
def swizzle(addr: int, sw: int) -> int:
    b = {0: 0, 32: 1, 64: 2, 128: 3}[sw]
    return addr ^ (((addr >> 7) & ((1 << b) - 1)) << 4)


def offset(mn: int, k: int, k_major: bool, sw: int, lbo: int, sbo: int) -> int:
    """Byte offset (before the swizzle) of element (mn, k) in the canonical layout."""
    if k_major:
        if sw == 0:  # ((8,m),(T,2k)) : ((T,SBO),(1,LBO))
            return (mn % 8) * 16 + (mn // 8) * sbo + (k % 8) * 2 + (k // 8) * lbo
        return (mn % 8) * sw + (mn // 8) * sbo + k * 2  # ((8,m),(T,2k)) : ((8T|4T|2T,SBO),(1,T))
    if sw == 0:  # ((T,1,m),(8,k)) : ((1,T,LBO),(T,SBO))
        return (mn % 8) * 2 + (mn // 8) * lbo + (k % 8) * 16 + (k // 8) * sbo
    run = sw // 2  # ((T,S/16,m),(8,k)) : ((1,T,LBO),(S/2,SBO))
    return (mn % run) * 2 + (mn // run) * lbo + (k % 8) * sw + (k // 8) * sbo


def place(img: np.ndarray, base: int, mat: np.ndarray, k_major: bool, sw: int, lbo: int, sbo: int) -> None:
    """Write `mat` (MN x 16, 16-bit) at `base` of the image in the given layout."""
    bits = mat.view(np.uint16)
    for mn in range(mat.shape[0]):
        for k in range(16):
            a = swizzle(base + offset(mn, k, k_major, sw, lbo, sbo), sw)
            img[a:a + 2] = np.frombuffer(bits[mn, k].tobytes(), np.uint8)


def geometry(mn: int, k_major: bool, sw: int) -> tuple[int, int, int]:
    """(LBO, SBO, bytes) of a dense MN x 16 operand."""
    if k_major:
        return (128, 256, mn * 32) if sw == 0 else (16, 8 * sw, (mn + 7) // 8 * 8 * sw)
    if sw == 0:
        return 256, 128, ((mn + 7) // 8) * 256
    blocks = (mn + sw // 2 - 1) // (sw // 2)
    return 2 * 8 * sw, 8 * sw, blocks * 2 * 8 * sw


def a_fragment(a: np.ndarray) -> np.ndarray:
    """The four A registers of each of the 128 threads (m16n8k16 A layout per warp's 16 rows)."""
    bits = a.view(np.uint16).astype(np.uint32)
    regs = np.zeros(128 * 4, np.uint32)
    for th in range(128):
        w, lane = divmod(th, 32)
        g, t = lane >> 2, lane % 4
        for r in range(4):
            row, col = 16 * w + g + 8 * (r & 1), 2 * t + 8 * (r >> 1)
            regs[th * 4 + r] = bits[row, col] | (bits[row, col + 1] << 16)
    return regs


def run_case(module, dt, n, *, a_regs=False, ta=0, tb=0, sw_a=128, sw_b=128, scale_d=1, warpgroups=1, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, (64, 16)).astype(dt)
    b = rng.integers(-8, 9, (16, n)).astype(dt)
    c = rng.integers(-64, 65, (64, n)).astype(np.float32)
    la, sa, nbytes_a = geometry(64, not ta, sw_a)
    lb, sb, nbytes_b = geometry(n, not tb, sw_b)
    base_b = (nbytes_a + 1023) // 1024 * 1024
    img = np.zeros(base_b + nbytes_b, np.uint8)
    place(img, 0, a, not ta, sw_a, la, sa)
    place(img, base_b, np.ascontiguousarray(b.T), not tb, sw_b, lb, sb)
    geo = np.array([0, la, sa, sw_a, base_b, lb, sb, sw_b], np.int32)
    out = np.full(warpgroups * 64 * n, np.nan, np.float32)
    name = f"wg_{'f16' if dt == np.float16 else 'bf16'}_{n}"
    module.launch(Launch(name, (1, 1, 1), (128 * warpgroups, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), c, out, int(a_regs), ta, tb, scale_d]))
    want = a.astype(np.float64) @ b.astype(np.float64) + (c if scale_d else 0)
    return out.reshape(warpgroups, 64, n), want


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("n", WIDTHS)
def test_accumulator_fragment_k_major_128b(module, dt, n):
    got, want = run_case(module, dt, n, warpgroups=2)
    for wg in range(2):
        np.testing.assert_array_equal(got[wg], want)


@pytest.mark.parametrize("sw", [0, 32, 64, 128])
@pytest.mark.parametrize("tb", [0, 1])
def test_every_swizzle_mode_and_b_major(module, sw, tb):
    got, want = run_case(module, np.float16, 64, tb=tb, sw_a=sw, sw_b=sw, seed=sw + tb)
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("sw", [0, 128])
def test_a_mn_major_from_shared_memory(module, sw):
    got, want = run_case(module, ml_dtypes.bfloat16, 128, ta=1, sw_a=sw, sw_b=sw, seed=3)
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("tb", [0, 1])
@pytest.mark.parametrize("scale_d", [0, 1])
def test_a_from_registers(module, tb, scale_d):
    got, want = run_case(module, np.float16, 128, a_regs=True, tb=tb, scale_d=scale_d, seed=11)
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("mode", [2, 4])
def test_the_accumulator_is_nan_until_the_wait_that_covers_it(module, mode):
    """Without the wait (mode 2), or waiting without having committed the wgmma (mode 4), the
    registers hold NaN: a kernel that reads them early fails its result check."""
    rng = np.random.default_rng(5)
    a = rng.integers(-8, 9, (64, 16)).astype(np.float16)
    img = np.zeros(16384, np.uint8)
    place(img, 0, a, True, 128, 16, 1024)
    place(img, 8192, a[:, :16].copy(), True, 128, 16, 1024)
    geo = np.array([0, 16, 1024, 128, 8192, 16, 1024, 128], np.int32)
    out = np.zeros(64 * 64, np.float32)
    module.launch(Launch("wg_f16_64", (1, 1, 1), (128, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), np.ones((64, 64), np.float32), out, mode, 0, 0, 1]))
    assert np.isnan(out).all()


def test_a_wrong_layout_is_caught(module):
    """The reference can fail: a B written K-major but read as MN-major gives another product."""
    rng = np.random.default_rng(1)
    a = rng.integers(-8, 9, (64, 16)).astype(np.float16)
    b = rng.integers(-8, 9, (16, 64)).astype(np.float16)
    lb, sb, nb = geometry(64, True, 128)
    img = np.zeros(8192 + nb, np.uint8)
    place(img, 0, a, True, 128, 16, 1024)
    place(img, 8192, np.ascontiguousarray(b.T), True, 128, lb, sb)
    geo = np.array([0, 16, 1024, 128, 8192, lb, sb, 128], np.int32)
    out = np.zeros(64 * 64, np.float32)
    module.launch(Launch("wg_f16_64", (1, 1, 1), (128, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), np.zeros((64, 64), np.float32), out, 0, 0, 1, 0]))
    assert not np.array_equal(out.reshape(64, 64), a.astype(np.float64) @ b.astype(np.float64))


def test_accumulates_in_fp32(module):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((64, 16)).astype(np.float16)
    b = rng.standard_normal((16, 64)).astype(np.float16)
    img = np.zeros(16384, np.uint8)
    place(img, 0, a, True, 128, 16, 1024)
    place(img, 8192, np.ascontiguousarray(b.T), True, 128, 16, 1024)
    geo = np.array([0, 16, 1024, 128, 8192, 16, 1024, 128], np.int32)
    c = (rng.standard_normal((64, 64)) * 1000).astype(np.float32)
    out = np.zeros(64 * 64, np.float32)
    module.launch(Launch("wg_f16_64", (1, 1, 1), (128, 1, 1), img.size,
                         [img, img.size, geo, a_fragment(a), c, out, 0, 0, 0, 1]))
    err = np.abs(out.reshape(64, 64) - (a.astype(np.float64) @ b.astype(np.float64) + c))
    assert err.max() < 0.25  # an fp16 accumulator would round values near 1000 to 0.5


def test_tma_boxes_feed_wgmma_like_attention(module):
    """Q K^T from two 128B-swizzled TMA boxes (K-major, k16 steps by descriptor start + 32 B), then
    P V with P from the accumulator registers and V row-major (MN-major B, k16 steps by 2048 B)."""
    rng = np.random.default_rng(8)
    q = rng.integers(-3, 4, (64, 64)).astype(np.float16)
    k = rng.integers(-3, 4, (64, 64)).astype(np.float16)
    v = rng.integers(-3, 4, (64, 64)).astype(np.float16)
    maps = [cpu_tensor_map(x, (64, 64), 128) for x in (q, k, v)]
    s_out, o_out = np.zeros(64 * 64, np.float32), np.zeros(64 * 64, np.float32)
    module.launch(Launch("tma_wgmma", (1, 1, 1), (128, 1, 1), 3 * 8192, [*maps, s_out, o_out]))
    s = q.astype(np.float64) @ k.astype(np.float64).T
    np.testing.assert_array_equal(s_out.reshape(64, 64), s)
    np.testing.assert_array_equal(o_out.reshape(64, 64), s.astype(np.float16).astype(np.float64) @ v)


def test_an_incomplete_warpgroup_is_refused(module):
    img = np.zeros(16384, np.uint8)
    geo = np.array([0, 16, 1024, 128, 8192, 16, 1024, 128], np.int32)
    with pytest.raises(KernelRuntimeError, match=r"wgmma.mma_async: warpgroup 0 is incomplete"):
        module.launch(Launch("wg_f16_64", (1, 1, 1), (96, 1, 1), img.size,
                             [img, img.size, geo, np.zeros(512, np.uint32), np.zeros((64, 64), np.float32),
                              np.zeros(64 * 64, np.float32), 0, 0, 0, 1]))


def test_fragment_formulas_cover_the_accumulator_once():
    for n in (8, 64, 256):
        cells = sorted((16 * w + (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1))
                       for w in range(4) for lane in range(32) for i in range(n // 2))
        assert cells == [(r, c) for r in range(64) for c in range(n)]


def test_the_generated_ptx_block_is_current():
    text = wgmma_ptx.header_path().read_text()
    assert wgmma_ptx.block() in text


def test_tma_and_wgmma_run_clean_under_race_detection():
    """The mbarrier orders the TMA's writes before the warpgroup's reads; wgmma's own operand reads
    and its staging are the runtime's, not the kernel's accesses."""
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "hopper.cuh"))
    mod = CpuModule.from_source(head + text + KERNELS, ["tma_wgmma"], race_check=True)
    rng = np.random.default_rng(2)
    q, k, v = (rng.integers(-3, 4, (64, 64)).astype(np.float16) for _ in range(3))
    s_out, o_out = np.zeros(64 * 64, np.float32), np.zeros(64 * 64, np.float32)
    for schedule in ("fifo", "reverse", "shuffle"):
        mod.schedule = schedule
        mod.launch(Launch("tma_wgmma", (1, 1, 1), (128, 1, 1), 3 * 8192,
                          [*(cpu_tensor_map(x, (64, 64), 128) for x in (q, k, v)), s_out, o_out]))
        np.testing.assert_array_equal(s_out.reshape(64, 64), q.astype(np.float64) @ k.astype(np.float64).T)


# ---- the same kernels on a GPU (sm_90a): the emulation's layouts against the hardware's -----------
class GpuModule:
    """Runs the CPU tests' launches on the GPU: numpy arrays go to the device and come back after the
    launch, Python ints become the kernels' 32-bit ints."""

    def __init__(self, source: str, names: list[str], tmp_path):
        from kgen.cache import ArtifactCache
        from kgen.compile.nvrtc import compile_cubin
        from kgen.runtime.cuda import CudaModule, device_arch

        if device_arch() != "sm_90":
            pytest.skip("needs an sm_90 GPU (H100/H200) for sm_90a code")
        art = compile_cubin(source, "sm_90a", cache=ArtifactCache(tmp_path / "cache"))
        path = tmp_path / "hopper.cubin"
        path.write_bytes(art.cubin)
        self.mod = CudaModule(path, names)

    def launch(self, launch: Launch) -> None:
        import cupy as cp

        pairs, args = [], []
        for a in launch.args:
            if isinstance(a, np.ndarray):
                d = cp.asarray(a)
                pairs.append((a, d))
                args.append(d)
            else:
                args.append(np.int32(a) if isinstance(a, int) else a)
        self.mod.launch(Launch(launch.kernel, launch.grid, launch.block, launch.smem, args))
        cp.cuda.runtime.deviceSynchronize()
        for host, dev in pairs:
            np.copyto(host, cp.asnumpy(dev))


@pytest.fixture(scope="module")
def gpu_module(tmp_path_factory):
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
    common = templates_dir() / "common"
    text = "".join((common / f).read_text() for f in ("platform.cuh", "mma.cuh", "hopper.cuh"))
    names = [n for n in NAMES if n != "tma_wgmma"]  # a CUtensorMap is not a CPU tensor map
    return GpuModule(head + text + KERNELS, names, tmp_path_factory.mktemp("gpu"))


GPU_CASES = ([dict(dt=dt, n=n) for dt in (np.float16, ml_dtypes.bfloat16) for n in WIDTHS]
             + [dict(dt=np.float16, n=64, tb=tb, sw_a=sw, sw_b=sw) for sw in (0, 32, 64, 128) for tb in (0, 1)]
             + [dict(dt=ml_dtypes.bfloat16, n=128, ta=1, sw_a=sw, sw_b=sw) for sw in (0, 128)]
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
