// kgen SIMT runtime, part 2: what device code sees (indices, sync, warp ops, atomics, math).
#pragma once

// ---- indices ---------------------------------------------------------------------
#define threadIdx (::kgen_simt::tls_w->cur->tid)
#define blockIdx (::kgen_simt::tls_w->block_idx)
#define blockDim (::kgen_simt::tls_w->block_dim)
#define gridDim (::kgen_simt::tls_w->grid_dim)
#ifndef warpSize
#define warpSize 32
#endif

// ---- block barrier ----------------------------------------------------------------
inline void __syncthreads() { ::kgen_simt::syncthreads_count(0); }
inline int __syncthreads_count(int pred) { return ::kgen_simt::syncthreads_count(pred); }
inline int __syncthreads_and(int pred) {
  return ::kgen_simt::syncthreads_count(pred) == (int)::kgen_simt::tls_w->nthreads;
}
inline int __syncthreads_or(int pred) { return ::kgen_simt::syncthreads_count(pred) != 0; }

// ---- warp operations -------------------------------------------------------------
namespace kgen_simt {
template <class T>
inline T warp_value_op(int op, unsigned mask, T var, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "warp shuffles support trivially copyable types of at most 8 bytes");
  unsigned long long bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = warp_op(op, mask, bits, arg, width);
  T out = var;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace kgen_simt

inline void __syncwarp(unsigned mask = 0xffffffffu) { ::kgen_simt::warp_op(::kgen_simt::OP_SYNCWARP, mask, 0, 0, 32); }
template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32) {
  return ::kgen_simt::warp_value_op(::kgen_simt::OP_SHFL_IDX, mask, var, srcLane, width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::kgen_simt::warp_value_op(::kgen_simt::OP_SHFL_UP, mask, var, (int)delta, width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::kgen_simt::warp_value_op(::kgen_simt::OP_SHFL_DOWN, mask, var, (int)delta, width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32) {
  return ::kgen_simt::warp_value_op(::kgen_simt::OP_SHFL_XOR, mask, var, laneMask, width);
}
inline int __any_sync(unsigned mask, int pred) {
  return (int)::kgen_simt::warp_op(::kgen_simt::OP_VOTE_ANY, mask, pred != 0, 0, 32);
}
inline int __all_sync(unsigned mask, int pred) {
  return (int)::kgen_simt::warp_op(::kgen_simt::OP_VOTE_ALL, mask, pred != 0, 0, 32);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)::kgen_simt::warp_op(::kgen_simt::OP_VOTE_BALLOT, mask, pred != 0, 0, 32);
}
// Fibers carry no notion of convergence: the active mask is the warp's lanes that have
// not exited (on a GPU, inside a divergent branch, it would be only that branch's lanes).
inline unsigned __activemask() {
  ::kgen_simt::Worker* w = ::kgen_simt::tls_w;
  const ::kgen_simt::WarpState& ws = w->warps[w->cur->warp];
  return ws.exist & ~ws.exited;
}

// ---- memory fences & loads ------------------------------------------------------------
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <class T>
inline T __ldg(const T* p) { return *p; }

// ---- atomics (relaxed, like the GPU's; blocks run concurrently on several OS threads) ----
#define KGEN_ATOMIC_FETCH(NAME, OP, T) \
  inline T NAME(T* a, T v) { return __atomic_fetch_##OP(a, v, __ATOMIC_RELAXED); }
KGEN_ATOMIC_FETCH(atomicAdd, add, int)
KGEN_ATOMIC_FETCH(atomicAdd, add, unsigned)
KGEN_ATOMIC_FETCH(atomicAdd, add, unsigned long long)
KGEN_ATOMIC_FETCH(atomicSub, sub, int)
KGEN_ATOMIC_FETCH(atomicSub, sub, unsigned)
KGEN_ATOMIC_FETCH(atomicAnd, and, int)
KGEN_ATOMIC_FETCH(atomicAnd, and, unsigned)
KGEN_ATOMIC_FETCH(atomicAnd, and, unsigned long long)
KGEN_ATOMIC_FETCH(atomicOr, or, int)
KGEN_ATOMIC_FETCH(atomicOr, or, unsigned)
KGEN_ATOMIC_FETCH(atomicOr, or, unsigned long long)
KGEN_ATOMIC_FETCH(atomicXor, xor, int)
KGEN_ATOMIC_FETCH(atomicXor, xor, unsigned)
KGEN_ATOMIC_FETCH(atomicXor, xor, unsigned long long)
#undef KGEN_ATOMIC_FETCH

namespace kgen_simt {
// Read-modify-write through a compare-and-swap loop on the value's bits.
template <class T, class Bits, class F>
inline T atomic_rmw(T* a, F f) {
  static_assert(sizeof(T) == sizeof(Bits), "size");
  Bits* p = reinterpret_cast<Bits*>(a);
  Bits old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    T ov;
    std::memcpy(&ov, &old, sizeof(T));
    T nv = f(ov);
    Bits nb;
    std::memcpy(&nb, &nv, sizeof(T));
    if (__atomic_compare_exchange_n(p, &old, nb, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return ov;
  }
}
}  // namespace kgen_simt

inline float atomicAdd(float* a, float v) {
  return ::kgen_simt::atomic_rmw<float, unsigned>(a, [v](float x) { return x + v; });
}
inline double atomicAdd(double* a, double v) {
  return ::kgen_simt::atomic_rmw<double, unsigned long long>(a, [v](double x) { return x + v; });
}
inline int atomicMax(int* a, int v) { return ::kgen_simt::atomic_rmw<int, int>(a, [v](int x) { return x > v ? x : v; }); }
inline unsigned atomicMax(unsigned* a, unsigned v) {
  return ::kgen_simt::atomic_rmw<unsigned, unsigned>(a, [v](unsigned x) { return x > v ? x : v; });
}
inline unsigned long long atomicMax(unsigned long long* a, unsigned long long v) {
  return ::kgen_simt::atomic_rmw<unsigned long long, unsigned long long>(a, [v](unsigned long long x) { return x > v ? x : v; });
}
inline int atomicMin(int* a, int v) { return ::kgen_simt::atomic_rmw<int, int>(a, [v](int x) { return x < v ? x : v; }); }
inline unsigned atomicMin(unsigned* a, unsigned v) {
  return ::kgen_simt::atomic_rmw<unsigned, unsigned>(a, [v](unsigned x) { return x < v ? x : v; });
}
inline unsigned long long atomicMin(unsigned long long* a, unsigned long long v) {
  return ::kgen_simt::atomic_rmw<unsigned long long, unsigned long long>(a, [v](unsigned long long x) { return x < v ? x : v; });
}
inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }
inline unsigned atomicExch(unsigned* a, unsigned v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
  return __atomic_exchange_n(a, v, __ATOMIC_RELAXED);
}
inline float atomicExch(float* a, float v) {
  return ::kgen_simt::atomic_rmw<float, unsigned>(a, [v](float) { return v; });
}
#define KGEN_ATOMIC_CAS(T)                                                               \
  inline T atomicCAS(T* a, T compare, T val) {                                           \
    __atomic_compare_exchange_n(a, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); \
    return compare;                                                                      \
  }
KGEN_ATOMIC_CAS(int)
KGEN_ATOMIC_CAS(unsigned)
KGEN_ATOMIC_CAS(unsigned long long)
#undef KGEN_ATOMIC_CAS

// ---- bit reinterpretation and integer intrinsics ---------------------------------------
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline int __mul24(int a, int b) { return (int)((long long)(a << 8 >> 8) * (b << 8 >> 8)); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
// CUDA's definition: result byte n = byte s<4n+2:4n> of the 8 bytes {y, x} (x = bytes 0-3);
// bit 3 of each selector nibble and the upper 16 bits of s are not used.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (unsigned n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
}

// ---- min / max (CUDA's global overloads) ---------------------------------------------
#define KGEN_MINMAX(T)                                  \
  inline T min(T a, T b) { return a < b ? a : b; }     \
  inline T max(T a, T b) { return a > b ? a : b; }
KGEN_MINMAX(int)
KGEN_MINMAX(unsigned)
KGEN_MINMAX(long)
KGEN_MINMAX(unsigned long)
KGEN_MINMAX(long long)
KGEN_MINMAX(unsigned long long)
#undef KGEN_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// ---- float math ------------------------------------------------------------------------
// The CUDA fast-math intrinsics (__expf, __logf, __fdividef) are approximations on the
// GPU; here they are computed with the correctly rounded-ish libm functions, so results
// can differ from the GPU in the last bits. Exact ones (__fmaf_rn, __frcp_rn, ...) match.
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
// cvt.{rni,rzi,rmi,rpi}.{s32,u32}.f32: the PTX ISA clamps a float-to-integer conversion to the
// destination's range and converts NaN to 0 (a C++ cast of such a value would be undefined).
// `r` is already an integral value; 2^31 and 2^32 are exact floats.
inline int kgen_simt_f2i(float r) {
  return r != r ? 0 : r <= -2147483648.0f ? (int)0x80000000u : r >= 2147483648.0f ? 0x7fffffff : (int)r;
}
inline unsigned kgen_simt_f2u(float r) {
  return r != r || r <= 0.0f ? 0u : r >= 4294967296.0f ? 0xffffffffu : (unsigned)r;
}
inline int __float2int_rn(float x) { return kgen_simt_f2i(nearbyintf(x)); }  // ties to even (default mode)
inline int __float2int_rz(float x) { return kgen_simt_f2i(truncf(x)); }
inline int __float2int_rd(float x) { return kgen_simt_f2i(floorf(x)); }
inline int __float2int_ru(float x) { return kgen_simt_f2i(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return kgen_simt_f2u(nearbyintf(x)); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }

// ---- cp.async (templates/common/async_copy.cuh calls these on the CPU; kgen_simt_async.h) ----
// With race detection, the poison written at issue and the data landed at the wait are
// writes of the issuing thread (a buffer reused before every thread is done reading it,
// or read before the owner's wait and a barrier, is reported).
#if defined(KGEN_SIMT_RACECHECK)
extern "C" __attribute__((visibility("hidden"))) void __tsan_write_range(void*, unsigned long);
#define KGEN_SIMT_ASYNC_WRITE(p, n) __tsan_write_range((void*)(p), (unsigned long)(n))
#else
#define KGEN_SIMT_ASYNC_WRITE(p, n) ((void)0)
#endif

namespace kgen_simt {
// cp.async.{ca,cg}.shared.global [dst], [src], size, src_size
__attribute__((always_inline)) inline void cp_async(void* dst, const void* src, unsigned size, unsigned src_size,
                                                    bool cg) {
  if (cg ? size != 16 : !(size == 4 || size == 8 || size == 16))
    fail("cp.async.%s: cp-size %u bytes; it must be %s", cg ? "cg" : "ca", size, cg ? "16" : "4, 8 or 16");
  if (src_size > size) fail("cp.async: src-size %u exceeds cp-size %u", src_size, size);
  if ((uintptr_t)dst % size || (uintptr_t)src % size)
    fail("cp.async: misaligned address (shared %p, global %p): both must be aligned to the cp-size, %u bytes", dst,
         src, size);
  Worker* w = tls_w;
  if (!w->async[w->cur->linear].issue(dst, src, size, src_size))
    fail("cp.async: more than %u copies pending in one thread (the CPU backend's limit); wait for some first",
         ASYNC_MAX_PENDING);
  KGEN_SIMT_ASYNC_WRITE(dst, size);
}
__attribute__((always_inline)) inline void cp_async_commit() { tls_w->async[tls_w->cur->linear].commit(); }
// cp.async.wait_group n
__attribute__((always_inline)) inline void cp_async_wait_group(unsigned n) {
  tls_w->async[tls_w->cur->linear].wait_group(n, [](unsigned char* p, unsigned size) {
    KGEN_SIMT_ASYNC_WRITE(p, size);
    (void)p;
    (void)size;
  });
}
// cp.async.wait_all
__attribute__((always_inline)) inline void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait_group(0);
}
}  // namespace kgen_simt
