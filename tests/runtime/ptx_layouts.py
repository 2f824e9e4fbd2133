"""The PTX ISA's fragment and shared-memory layouts, transcribed for the CPU backend's tests from
the ISA's text and figures and CuTe's documented canonical GMMA layouts, independently of the
emulation in templates/simt/ (which must agree with them). Section numbers are those of PTX ISA
8.x/9.0 (the titles are given too: the numbering shifts between versions); every function names
what it transcribes. Lanes: groupID = lane >> 2, threadID_in_group = lane % 4 (the ISA's names)."""

from __future__ import annotations

# ---- mma.sync.m16n8k16 .f16/.bf16 ----------------------------------------------------------------
# PTX ISA 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type": four .f16x2
# registers hold a0..a7, two hold b0..b3, C/D are four .f32 c0..c3. The ISA's formulas:
#   A: row = groupID for a0, a1, a4, a5 and groupID + 8 for a2, a3, a6, a7;
#      col = threadID_in_group * 2 + (i & 1) for a0..a3 and + 8 for a4..a7
#   B: row (k) = threadID_in_group * 2 + (i & 1) for b0, b1 and + 8 for b2, b3; col (n) = groupID
#   C/D: row = groupID for c0, c1 and groupID + 8 for c2, c3; col = threadID_in_group * 2 + (i & 1)
# Element i of a fragment sits in register i // 2, the lower-indexed one in the low 16 bits.


def mma_a(lane: int, i: int) -> tuple[int, int]:
    g, t = lane >> 2, lane % 4
    return (g if i in (0, 1, 4, 5) else g + 8), t * 2 + (i & 1) + (8 if i >= 4 else 0)


def mma_b(lane: int, i: int) -> tuple[int, int]:
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def mma_c(lane: int, i: int) -> tuple[int, int]:
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


# ---- ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16 ---------------------------------------
# PTX ISA 9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix": threads 0-7 give the row
# addresses of matrix 0, 8-15 of matrix 1, 16-23 of matrix 2, 24-31 of matrix 3 (.x1 uses
# threads 0-7 only, .x2 0-15); "a group of four consecutive threads loads 16 bytes. The matrix
# addresses must be naturally aligned accordingly" (so every row address is 16-byte aligned);
# register j of each thread holds the fragment of matrix j, laid out as Figure 104 shows: thread
# l holds row l / 4, elements 2 * (l % 4) and 2 * (l % 4) + 1 (low half first). With .trans
# the matrix is transposed on the way: the thread holds column l / 4, rows 2 * (l % 4) + 0/1.
LDMATRIX_ROW_ALIGN = 16


def ldmatrix_address_lane(matrix: int, row: int) -> int:
    """The thread that gives the address of `row` of `matrix`."""
    return 8 * matrix + row


def ldmatrix_elem(lane: int, half: int, trans: bool) -> tuple[int, int]:
    """(row, col) in its 8x8 matrix of the `half`-th (0: low) 16-bit element of a thread's register."""
    if trans:
        return 2 * (lane % 4) + half, lane >> 2
    return lane >> 2, 2 * (lane % 4) + half


# ---- wgmma.mma_async.m64nNk16 register fragments ---------------------------------------------------
# PTX ISA 9.7.15.5.1.1.1 "Matrix Fragments for wgmma.mma_async.m64nNk16", Figure 148 (A) and
# Figure 149 (D): warp w of the warpgroup holds rows 16w .. 16w + 15. A (four .f16x2 registers,
# a0..a7) repeats the m16n8k16 A fragment on those rows; D (N/2 .f32 registers d0..) repeats the
# m16n8 C fragment once per 8 columns: d_i at row 16w + groupID + 8 * ((i >> 1) & 1), column
# 8 * (i >> 2) + threadID_in_group * 2 + (i & 1).


def wgmma_a(thread: int, i: int) -> tuple[int, int]:
    warp, lane = divmod(thread, 32)
    row, col = mma_a(lane, i)
    return 16 * warp + row, col


def wgmma_d(thread: int, i: int) -> tuple[int, int]:
    warp, lane = divmod(thread, 32)
    g, t = lane >> 2, lane % 4
    return 16 * warp + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + t * 2 + (i & 1)


# ---- wgmma shared-memory matrix descriptors --------------------------------------------------------
# PTX ISA 9.7.15.5.1.2.2 "Matrix Descriptor Format": bits 13-0 start address, 29-16 leading
# dimension byte offset (LBO), 45-32 stride dimension byte offset (SBO), each as
# matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4; 51-49 base offset; 63-62 swizzle mode:
# 0 none, 1 128-byte, 2 64-byte, 3 32-byte.
SWIZZLE_MODE = {0: 0, 128: 1, 64: 2, 32: 3}


def descriptor(start: int, lbo: int, sbo: int, swizzle: int, base_offset: int = 0) -> int:
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    return enc(start) | enc(lbo) << 16 | enc(sbo) << 32 | (base_offset & 7) << 49 | SWIZZLE_MODE[swizzle] << 62


# PTX ISA 9.7.15.5.1.2.1.3 "Canonical Layouts" (the same table is CuTe's documentation of
# make_gmma_desc, cute/atom/mma_traits_sm90_gmma.hpp): CuTe layouts shape:stride, in elements,
# with T = 128 / element bits (8 for 16-bit), m repeats along MN, k along K; LBO and SBO as
# element strides (byte offset / element size):
#   MN-major, none:  ((T,1,m),(8,k)) : ((1,T,SBO),(1T,LBO))
#   MN-major, 32B:   ((T,2,m),(8,k)) : ((1,T,LBO),(2T,SBO))
#   MN-major, 64B:   ((T,4,m),(8,k)) : ((1,T,LBO),(4T,SBO))
#   MN-major, 128B:  ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))
#   K-major,  none:  ((8,m),(T,2k)) : ((1T,SBO),(1,LBO))
#   K-major,  32B:   ((8,m),(T,2k)) : ((2T,SBO),(1,T))
#   K-major,  64B:   ((8,m),(T,2k)) : ((4T,SBO),(1,T))
#   K-major,  128B:  ((8,m),(T,2k)) : ((8T,SBO),(1,T))
# each composed with Swizzle<B,4,3> (B = 0, 1, 2, 3 for none, 32B, 64B, 128B) on the shared
# address: "Swizzle<B,4,3> o smem_ptr o layout". The first mode is MN, the second K.


def canonical_layout(k_major: bool, swizzle: int, lbo: int, sbo: int, elem_bytes: int, mn: int, k: int):
    """(shape, stride) of an MN x K operand's canonical layout, strides in elements."""
    t = 16 // elem_bytes
    lbo_e, sbo_e = lbo // elem_bytes, sbo // elem_bytes
    c = swizzle // 16  # 16-byte chunks per swizzled row: 2, 4, 8 (1 without a swizzle)
    rep = lambda n, d: -(-n // d)  # noqa: E731  (repeats, the last one possibly partly used)
    if not k_major:
        if swizzle == 0:
            return ((t, 1, rep(mn, t)), (8, rep(k, 8))), ((1, t, sbo_e), (t, lbo_e))
        return ((t, c, rep(mn, t * c)), (8, rep(k, 8))), ((1, t, lbo_e), (c * t, sbo_e))
    if swizzle == 0:
        return ((8, rep(mn, 8)), (t, rep(k, t))), ((t, sbo_e), (1, lbo_e))
    return ((8, rep(mn, 8)), (t, rep(k, t))), ((c * t, sbo_e), (1, t))


def cute_eval(shape, stride, coord: int) -> int:
    """A CuTe layout's offset of the 1-D coordinate `coord` of one (possibly nested) mode: the
    coordinate splits colexicographically over the shape (the leftmost sub-mode fastest), the
    convention of CuTe's layout documentation."""
    if isinstance(shape, int):
        return coord * stride
    off = 0
    for s, d in zip(shape, stride, strict=True):
        size = _size(s)
        off += cute_eval(s, d, coord % size)
        coord //= size
    return off


def _size(shape) -> int:
    if isinstance(shape, int):
        return shape
    n = 1
    for s in shape:
        n *= _size(s)
    return n


def cute_swizzle(addr: int, bits: int, base: int = 4, shift: int = 3) -> int:
    """CuTe's Swizzle<B,M,S> (cute/swizzle.hpp): the B bits at [M + S, M + S + B) of the address
    are XORed into the B bits at [M, M + B)."""
    mask = ((1 << bits) - 1) << (base + shift)
    return addr ^ ((addr & mask) >> shift)


SWIZZLE_BITS = {0: 0, 32: 1, 64: 2, 128: 3}


def smem_address(start: int, mn: int, k: int, *, k_major: bool, swizzle: int, lbo: int, sbo: int,
                 mn_size: int, k_size: int, elem_bytes: int = 2) -> int:
    """The shared-memory byte address of element (mn, k) of an operand whose descriptor has
    this start address, LBO, SBO and swizzle (start: a multiple of the swizzle's pattern)."""
    (s_mn, s_k), (d_mn, d_k) = canonical_layout(k_major, swizzle, lbo, sbo, elem_bytes, mn_size, k_size)
    off = cute_eval(s_mn, d_mn, mn) + cute_eval(s_k, d_k, k)
    return cute_swizzle(start + off * elem_bytes, SWIZZLE_BITS[swizzle])
