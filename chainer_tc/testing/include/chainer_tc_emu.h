// chainer_tc CUDA emulator: compiles CUDA C++ kernels with g++ and runs them on the CPU.
//
// This header is force-included (g++ -include) before a kernel's .cu text. It provides what
// kernels use from CUDA: the execution-space keywords, threadIdx/blockIdx/blockDim/gridDim,
// __syncthreads, warp collectives, atomics, fences, __half/__half2, vector types and the CUDA math
// API. It includes no C library header, so the kernel sees only the names CUDA defines (glibc's
// `signal`, `gamma` or `fadd` would clash with kernels of those names); the math functions are
// declared here and are the C library's.
//
// The runtime (runtime/emu_runtime.cpp, linked into the same module) describes the execution
// model, the memory checks and the race detector. The kernel's code is compiled with GCC's
// instrumentation (-fsanitize=thread for every load and store, -fsanitize=bounds, alignment and
// integer-divide-by-zero) whose callbacks the runtime defines.
#pragma once
#define CHAINER_TC_EMULATOR 1

#include <stddef.h>
#include <stdint.h>
#include <limits>
#include <type_traits>
#include <utility>

#include "chainer_tc_emu_abi.h"

// ---------------------------------------------------------------------------------------------
// Execution-space keywords. `__shared__` declarations are rewritten by the emulator's Python side
// into per-block storage (::ctemu::shared_ref); `static` is only the fallback for a form it did
// not rewrite. `__launch_bounds__` is read by the Python side and enforced at launch.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __constant__
#define __managed__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

// Atomics and other read-modify-writes the runtime checks itself: their plain accesses must not
// be seen by the race detector as ordinary reads and writes.
// Their arithmetic wraps as a GPU's does (atomicAdd on int): no signed-overflow check.
#define CTEMU_ATOMIC_FN __attribute__((noinline, no_sanitize("thread", "signed-integer-overflow")))
// The code address of the kernel's call of an atomic (the functions are noinline), for messages.
#define CTEMU_CALLER __builtin_return_address(0)

#define CTEMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N { T x, y; }; \
  static inline N make_##N(T x, T y) { N v; v.x = x; v.y = y; return v; }
#define CTEMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N { T x, y, z, w; }; \
  static inline N make_##N(T x, T y, T z, T w) { N v; v.x = x; v.y = y; v.z = z; v.w = w; return v; }
CTEMU_VEC2(float, float2, 8)
CTEMU_VEC4(float, float4, 16)
CTEMU_VEC2(double, double2, 16)
CTEMU_VEC2(int, int2, 8)
CTEMU_VEC4(int, int4, 16)
CTEMU_VEC2(unsigned int, uint2, 8)
CTEMU_VEC4(unsigned int, uint4, 16)
CTEMU_VEC2(short, short2, 4)
CTEMU_VEC4(unsigned char, uchar4, 4)
CTEMU_VEC2(long long, longlong2, 16)
CTEMU_VEC2(unsigned long long, ulonglong2, 16)
#undef CTEMU_VEC2
#undef CTEMU_VEC4

#define threadIdx (::ctemu::cur->tid)
#define blockIdx (::ctemu::cur->bid)
#define blockDim (::ctemu::block_dim)
#define gridDim (::ctemu::grid_dim)
#define warpSize 32

// ---------------------------------------------------------------------------------------------
// Device-side C library functions CUDA provides (the C library's here).
extern "C" {
int printf(const char*, ...) noexcept;
void* malloc(size_t) noexcept;
void free(void*) noexcept;
void* memcpy(void*, const void*, size_t) noexcept;
void* memset(void*, int, size_t) noexcept;
void __tsan_read_range(void*, unsigned long);      // the runtime's checks of a range
void __tsan_write_range(void*, unsigned long);
}
// memcpy and memset in kernel code go through the runtime's checks (bounds, the race detector,
// shared memory's written bytes) before the C library does the work.
static inline void* ctemu_checked_memcpy(void* d, const void* s, size_t n) {
  __tsan_read_range(const_cast<void*>(s), n);
  __tsan_write_range(d, n);
  return __builtin_memcpy(d, s, n);
}
static inline void* ctemu_checked_memset(void* d, int c, size_t n) {
  __tsan_write_range(d, n);
  return __builtin_memset(d, c, n);
}
namespace std { using ::ctemu_checked_memcpy; using ::ctemu_checked_memset; }
#define memcpy(d, s, n) ctemu_checked_memcpy((d), (s), (n))
#define memset(d, c, n) ctemu_checked_memset((d), (c), (n))

// ---------------------------------------------------------------------------------------------
// The CUDA math API: the C library's functions of the names CUDA defines, single and double.
#define CTEMU_MATH1(N) float N##f(float) noexcept; double N(double) noexcept;
#define CTEMU_MATH2(N) float N##f(float, float) noexcept; double N(double, double) noexcept;
extern "C" {
CTEMU_MATH1(acos) CTEMU_MATH1(acosh) CTEMU_MATH1(asin) CTEMU_MATH1(asinh) CTEMU_MATH1(atan)
CTEMU_MATH1(atanh) CTEMU_MATH1(cbrt) CTEMU_MATH1(ceil) CTEMU_MATH1(cos) CTEMU_MATH1(cosh)
CTEMU_MATH1(erf) CTEMU_MATH1(erfc) CTEMU_MATH1(exp) CTEMU_MATH1(exp10) CTEMU_MATH1(exp2)
CTEMU_MATH1(expm1) CTEMU_MATH1(fabs) CTEMU_MATH1(floor) CTEMU_MATH1(j0) CTEMU_MATH1(j1)
CTEMU_MATH1(lgamma) CTEMU_MATH1(log) CTEMU_MATH1(log10) CTEMU_MATH1(log1p) CTEMU_MATH1(log2)
CTEMU_MATH1(logb) CTEMU_MATH1(nearbyint) CTEMU_MATH1(rint) CTEMU_MATH1(round) CTEMU_MATH1(sin)
CTEMU_MATH1(sinh) CTEMU_MATH1(sqrt) CTEMU_MATH1(tan) CTEMU_MATH1(tanh) CTEMU_MATH1(tgamma)
CTEMU_MATH1(trunc) CTEMU_MATH1(y0) CTEMU_MATH1(y1)
CTEMU_MATH2(atan2) CTEMU_MATH2(copysign) CTEMU_MATH2(fdim) CTEMU_MATH2(fmax) CTEMU_MATH2(fmin)
CTEMU_MATH2(fmod) CTEMU_MATH2(hypot) CTEMU_MATH2(nextafter) CTEMU_MATH2(pow) CTEMU_MATH2(remainder)
float fmaf(float, float, float) noexcept; double fma(double, double, double) noexcept;
float frexpf(float, int*) noexcept; double frexp(double, int*) noexcept;
float ldexpf(float, int) noexcept; double ldexp(double, int) noexcept;
float modff(float, float*) noexcept; double modf(double, double*) noexcept;
float remquof(float, float, int*) noexcept; double remquo(double, double, int*) noexcept;
float scalbnf(float, int) noexcept; double scalbn(double, int) noexcept;
float scalblnf(float, long) noexcept; double scalbln(double, long) noexcept;
int ilogbf(float) noexcept; int ilogb(double) noexcept;
long lrintf(float) noexcept; long lrint(double) noexcept;
long lroundf(float) noexcept; long lround(double) noexcept;
long long llrintf(float) noexcept; long long llrint(double) noexcept;
long long llroundf(float) noexcept; long long llround(double) noexcept;
float jnf(int, float) noexcept; double jn(int, double) noexcept;
float ynf(int, float) noexcept; double yn(int, double) noexcept;
float nanf(const char*) noexcept; double nan(const char*) noexcept;
void sincosf(float, float*, float*) noexcept; void sincos(double, double*, double*) noexcept;
int abs(int) noexcept; long labs(long) noexcept; long long llabs(long long) noexcept;
}
#undef CTEMU_MATH1
#undef CTEMU_MATH2

// CUDA's functions that the C library lacks.
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
static inline double rcbrt(double x) { return 1.0 / cbrt(x); }
static inline float sinpif(float x) { return (float)sin(3.14159265358979323846 * (double)x); }
static inline double sinpi(double x) { return sin(3.14159265358979323846 * x); }
static inline float cospif(float x) { return (float)cos(3.14159265358979323846 * (double)x); }
static inline double cospi(double x) { return cos(3.14159265358979323846 * x); }
static inline void sincospif(float x, float* s, float* c) { *s = sinpif(x); *c = cospif(x); }
static inline void sincospi(double x, double* s, double* c) { *s = sinpi(x); *c = cospi(x); }
static inline float rhypotf(float x, float y) { return 1.0f / hypotf(x, y); }
static inline double rhypot(double x, double y) { return 1.0 / hypot(x, y); }
static inline float norm3df(float a, float b, float c) { return (float)sqrt((double)a * a + (double)b * b + (double)c * c); }
static inline double norm3d(double a, double b, double c) { return sqrt(a * a + b * b + c * c); }
static inline float rnorm3df(float a, float b, float c) { return 1.0f / norm3df(a, b, c); }
static inline double rnorm3d(double a, double b, double c) { return 1.0 / norm3d(a, b, c); }
static inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
static inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752440); }
static inline float fdividef(float x, float y) { return x / y; }
// C++ overloads of math_functions.hpp: float versions of the double names, and abs.
#define CTEMU_F1(N) static inline float N(float x) { return N##f(x); }
#define CTEMU_F2(N) static inline float N(float x, float y) { return N##f(x, y); }
CTEMU_F1(acos) CTEMU_F1(acosh) CTEMU_F1(asin) CTEMU_F1(asinh) CTEMU_F1(atan) CTEMU_F1(atanh)
CTEMU_F1(cbrt) CTEMU_F1(ceil) CTEMU_F1(cos) CTEMU_F1(cosh) CTEMU_F1(erf) CTEMU_F1(erfc)
CTEMU_F1(exp) CTEMU_F1(exp2) CTEMU_F1(expm1) CTEMU_F1(fabs) CTEMU_F1(floor) CTEMU_F1(lgamma)
CTEMU_F1(log) CTEMU_F1(log10) CTEMU_F1(log1p) CTEMU_F1(log2) CTEMU_F1(logb) CTEMU_F1(nearbyint)
CTEMU_F1(rint) CTEMU_F1(round) CTEMU_F1(rsqrt) CTEMU_F1(sin) CTEMU_F1(sinh) CTEMU_F1(sqrt)
CTEMU_F1(tan) CTEMU_F1(tanh) CTEMU_F1(tgamma) CTEMU_F1(trunc)
CTEMU_F2(atan2) CTEMU_F2(copysign) CTEMU_F2(fdim) CTEMU_F2(fmax) CTEMU_F2(fmin) CTEMU_F2(fmod)
CTEMU_F2(hypot) CTEMU_F2(nextafter) CTEMU_F2(pow) CTEMU_F2(remainder)
#undef CTEMU_F1
#undef CTEMU_F2
static inline float fma(float x, float y, float z) { return fmaf(x, y, z); }
static inline float ldexp(float x, int e) { return ldexpf(x, e); }
static inline float pow(float x, int e) { return powf(x, (float)e); }
static inline double pow(double x, int e) { return pow(x, (double)e); }
static inline float abs(float x) { return fabsf(x); }
static inline double abs(double x) { return fabs(x); }
static inline long abs(long x) { return labs(x); }
static inline long long abs(long long x) { return llabs(x); }
static inline bool isfinite(float x) { return __builtin_isfinite(x); }
static inline bool isfinite(double x) { return __builtin_isfinite(x); }
static inline bool isinf(float x) { return __builtin_isinf(x); }
static inline bool isinf(double x) { return __builtin_isinf(x); }
static inline bool isnan(float x) { return __builtin_isnan(x); }
static inline bool isnan(double x) { return __builtin_isnan(x); }
static inline bool signbit(float x) { return __builtin_signbit(x); }
static inline bool signbit(double x) { return __builtin_signbit(x); }

// Intrinsics: the fast ones are full precision here; the _rn ones are the CPU's IEEE operations
// rounded to nearest even, never contracted into an fma, as NVCC documents: where the emulator
// contracts (emulator.checking(fmad=True) compiles with -ffp-contract=fast, as NVRTC's default
// -fmad=true), an empty asm makes their operands and results opaque to g++, so that neither
// __fmul_rn(a, b) + c nor __fadd_rn(a * b, c) becomes an fma.
#if defined(__x86_64__) || defined(__i386__)
#define CTEMU_OPAQUE(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define CTEMU_OPAQUE(v) __asm__("" : "+w"(v))
#else
#define CTEMU_OPAQUE(v) __asm__("" : "+m"(v))
#endif
template <typename T>
static inline T ctemu_rn_add(T x, T y) { CTEMU_OPAQUE(x); CTEMU_OPAQUE(y); T r = x + y; CTEMU_OPAQUE(r); return r; }
template <typename T>
static inline T ctemu_rn_sub(T x, T y) { CTEMU_OPAQUE(x); CTEMU_OPAQUE(y); T r = x - y; CTEMU_OPAQUE(r); return r; }
template <typename T>
static inline T ctemu_rn_mul(T x, T y) { CTEMU_OPAQUE(x); CTEMU_OPAQUE(y); T r = x * y; CTEMU_OPAQUE(r); return r; }
static inline float __expf(float x) { return expf(x); }
static inline float __exp10f(float x) { return exp10f(x); }
static inline float __logf(float x) { return logf(x); }
static inline float __log2f(float x) { return log2f(x); }
static inline float __log10f(float x) { return log10f(x); }
static inline float __powf(float x, float y) { return powf(x, y); }
static inline float __sinf(float x) { return sinf(x); }
static inline float __cosf(float x) { return cosf(x); }
static inline float __tanf(float x) { return tanf(x); }
static inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
static inline float __fdividef(float x, float y) { return x / y; }
static inline float __fadd_rn(float x, float y) { return ctemu_rn_add(x, y); }
static inline float __fsub_rn(float x, float y) { return ctemu_rn_sub(x, y); }
static inline float __fmul_rn(float x, float y) { return ctemu_rn_mul(x, y); }
static inline float __fdiv_rn(float x, float y) { return x / y; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __frsqrt_rn(float x) { return (float)(1.0 / sqrt((double)x)); }
static inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
static inline double __dadd_rn(double x, double y) { return ctemu_rn_add(x, y); }
static inline double __dsub_rn(double x, double y) { return ctemu_rn_sub(x, y); }
static inline double __dmul_rn(double x, double y) { return ctemu_rn_mul(x, y); }
static inline double __ddiv_rn(double x, double y) { return x / y; }
static inline double __drcp_rn(double x) { return 1.0 / x; }
static inline double __dsqrt_rn(double x) { return sqrt(x); }
static inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
// float -> integer as CUDA converts: nan gives 0, out of range saturates
template <typename I>
static inline I ctemu_f2i(double f) {
  if (f != f) return 0;
  if (f <= (double)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
  if (f >= (double)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
  return (I)f;
}
static inline int __float2int_rn(float x) { return ctemu_f2i<int>(nearbyintf(x)); }
static inline int __float2int_rz(float x) { return ctemu_f2i<int>(truncf(x)); }
static inline int __float2int_rd(float x) { return ctemu_f2i<int>(floorf(x)); }
static inline int __float2int_ru(float x) { return ctemu_f2i<int>(ceilf(x)); }
static inline unsigned __float2uint_rn(float x) { return ctemu_f2i<unsigned>(nearbyintf(x)); }
static inline unsigned __float2uint_rz(float x) { return ctemu_f2i<unsigned>(truncf(x)); }
static inline long long __float2ll_rn(float x) { return ctemu_f2i<long long>(nearbyintf(x)); }
static inline long long __float2ll_rz(float x) { return ctemu_f2i<long long>(truncf(x)); }
static inline int __double2int_rn(double x) { return ctemu_f2i<int>(nearbyint(x)); }
static inline int __double2int_rz(double x) { return ctemu_f2i<int>(trunc(x)); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }
static inline float __double2float_rn(double x) { return (float)x; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
static inline int __float_as_int(float x) { int r; __builtin_memcpy(&r, &x, 4); return r; }
static inline unsigned __float_as_uint(float x) { unsigned r; __builtin_memcpy(&r, &x, 4); return r; }
static inline float __int_as_float(int x) { float r; __builtin_memcpy(&r, &x, 4); return r; }
static inline float __uint_as_float(unsigned x) { float r; __builtin_memcpy(&r, &x, 4); return r; }
static inline long long __double_as_longlong(double x) { long long r; __builtin_memcpy(&r, &x, 8); return r; }
static inline double __longlong_as_double(long long x) { double r; __builtin_memcpy(&r, &x, 8); return r; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
// the low 24 bits of each operand (sign-extended for __mul24), the low 32 bits of the product
static inline int __mul24(int x, int y) {
  long long a = (int)((unsigned)x << 8) >> 8, b = (int)((unsigned)y << 8) >> 8;
  return (int)(unsigned)(a * b);
}
static inline unsigned __umul24(unsigned x, unsigned y) { return (x & 0xffffffu) * (y & 0xffffffu); }
static inline int __mulhi(int x, int y) { return (int)(((long long)x * y) >> 32); }
static inline unsigned __umulhi(unsigned x, unsigned y) { return (unsigned)(((unsigned long long)x * y) >> 32); }
static inline long long __mul64hi(long long x, long long y) { return (long long)(((__int128)x * y) >> 64); }
static inline unsigned long long __umul64hi(unsigned long long x, unsigned long long y) {
  return (unsigned long long)(((unsigned __int128)x * y) >> 64);
}
#if defined(__x86_64__) || defined(__i386__)
static inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }
#else
static inline long long clock64() { static long long t; return ++t; }
#endif
// Loads and stores with cache hints: plain accesses here, except that __ldg (the read-only
// non-coherent cache) of bytes the launch writes is an error (the runtime checks the load).
template <typename T> CTEMU_ATOMIC_FN static inline T __ldg(const T* p) {
  ::ctemu::nc_read(p, sizeof(T), CTEMU_CALLER);
  return *p;
}
template <typename T> static inline T __ldca(const T* p) { return *p; }
template <typename T> static inline T __ldcg(const T* p) { return *p; }
template <typename T> static inline T __ldcs(const T* p) { return *p; }
template <typename T> static inline T __ldlu(const T* p) { return *p; }
template <typename T> static inline T __ldcv(const T* p) { return *p; }
template <typename T> static inline void __stwb(T* p, T v) { *p = v; }
template <typename T> static inline void __stcg(T* p, T v) { *p = v; }
template <typename T> static inline void __stcs(T* p, T v) { *p = v; }
template <typename T> static inline void __stwt(T* p, T v) { *p = v; }
// min/max: the overloads of CUDA's math_functions.hpp, mixed signedness included (an int and an
// unsigned compare as unsigned), so that every call nvcc accepts resolves the same way here.
#define CTEMU_MINMAX(R, A, B) \
  static inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
  static inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
CTEMU_MINMAX(int, int, int)
CTEMU_MINMAX(unsigned int, unsigned int, unsigned int)
CTEMU_MINMAX(unsigned int, int, unsigned int)
CTEMU_MINMAX(unsigned int, unsigned int, int)
CTEMU_MINMAX(long, long, long)
CTEMU_MINMAX(unsigned long, unsigned long, unsigned long)
CTEMU_MINMAX(unsigned long, long, unsigned long)
CTEMU_MINMAX(unsigned long, unsigned long, long)
CTEMU_MINMAX(long long, long long, long long)
CTEMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CTEMU_MINMAX(unsigned long long, long long, unsigned long long)
CTEMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef CTEMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(float a, double b) { return fmin((double)a, b); }
static inline double max(float a, double b) { return fmax((double)a, b); }
static inline double min(double a, float b) { return fmin(a, (double)b); }
static inline double max(double a, float b) { return fmax(a, (double)b); }
static inline unsigned umin(unsigned a, unsigned b) { return min(a, b); }
static inline unsigned umax(unsigned a, unsigned b) { return max(a, b); }
static inline long long llmin(long long a, long long b) { return min(a, b); }
static inline long long llmax(long long a, long long b) { return max(a, b); }
static inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return min(a, b); }
static inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return max(a, b); }

// ---------------------------------------------------------------------------------------------
// Synchronisation and warp intrinsics
// The default arguments are the caller's file and line: threads of a block waiting at two
// different barriers are reported.
// Not inlined, and kernel code keeps frame pointers: the runtime walks the call's frames to its
// code address and those of the calls it is in. A helper holding a __syncthreads() has one source
// line, but each copy inlined into a caller its own address, and each call of it its own frames.
#define CTEMU_AT const char* ctemu_file_ = __builtin_FILE(), unsigned ctemu_line_ = __builtin_LINE()
#define CTEMU_BARRIER_FN __attribute__((noinline, no_sanitize("thread")))
CTEMU_BARRIER_FN static void __syncthreads(CTEMU_AT) {
  ::ctemu::block_barrier(0, ctemu_file_, ctemu_line_, __builtin_frame_address(0));
}
CTEMU_BARRIER_FN static int __syncthreads_count(int p, CTEMU_AT) {
  return ::ctemu::block_barrier(p, ctemu_file_, ctemu_line_, __builtin_frame_address(0));
}
CTEMU_BARRIER_FN static int __syncthreads_or(int p, CTEMU_AT) {
  return ::ctemu::block_barrier(p, ctemu_file_, ctemu_line_, __builtin_frame_address(0)) != 0;
}
CTEMU_BARRIER_FN static int __syncthreads_and(int p, CTEMU_AT) {
  int yes = ::ctemu::block_barrier(p, ctemu_file_, ctemu_line_, __builtin_frame_address(0));
  return yes == ::ctemu::barrier_total();     // every thread that took part, not those left now
}
#undef CTEMU_AT
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::ctemu::warp_collective(::ctemu::kSync, mask, 0, 0);
}
// Fences and __nanosleep let the other threads run: a thread spinning on a flag that another one
// sets needs them to (any interleaving is one a GPU may produce). __threadfence also takes part in
// the race detector's release/acquire through atomics.
static inline void __threadfence() { ::ctemu::fence(1); }
static inline void __threadfence_system() { ::ctemu::fence(1); }
static inline void __threadfence_block() { ::ctemu::fence(0); }
static inline void __nanosleep(unsigned) { ::ctemu::yield_now(); }
static inline unsigned __activemask() { return ::ctemu::active_mask(); }

namespace ctemu {
template <typename T>
static inline u64 to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
  u64 r = 0;
  __builtin_memcpy(&r, &v, sizeof(T));
  return r;
}
template <typename T>
static inline T from_bits(u64 r) {
  T v;
  __builtin_memcpy(&v, &r, sizeof(T));
  return v;
}
// Every lane of `mask` publishes v and gets the value of lane `src` (its own if src < 0).
template <typename T>
static inline T exchange(unsigned mask, T v, int src) {
  int lane = (int)cur->lane;
  return from_bits<T>(warp_collective(kShfl, mask, to_bits(v), src < 0 ? lane : src));
}
static inline unsigned vote(unsigned mask, int pred, unsigned* voters = nullptr) {
  u64 r = warp_collective(kVote, mask, pred ? 1 : 0, 0);
  if (voters) *voters = (unsigned)(r >> 32);
  return (unsigned)r;
}
}  // namespace ctemu

static inline unsigned __ballot_sync(unsigned mask, int p) { return ::ctemu::vote(mask, p); }
static inline int __any_sync(unsigned mask, int p) { return ::ctemu::vote(mask, p) != 0; }
static inline int __all_sync(unsigned mask, int p) {
  unsigned voters;
  unsigned yes = ::ctemu::vote(mask, p, &voters);
  return yes == voters;
}
// Source lanes as PTX's shfl.sync computes them (the lane operand is its low 5 bits); a source
// outside the lane's group of `width` gives the lane its own value.
template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::cur->lane;
  return ::ctemu::exchange(mask, v, (lane & ~(width - 1)) | (src & (width - 1)));
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::cur->lane, d = (int)(delta & 31u);
  return ::ctemu::exchange(mask, v, (lane & (width - 1)) + d < width ? lane + d : -1);
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::cur->lane, d = (int)(delta & 31u);
  return ::ctemu::exchange(mask, v, (lane & (width - 1)) >= d ? lane - d : -1);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::cur->lane;
  int src = lane ^ (lane_mask & 31);
  int seg_end = (lane & ~(width - 1)) + width;     // earlier groups may be read, later ones not
  return ::ctemu::exchange(mask, v, src < seg_end ? src : -1);
}

[[noreturn]] static inline void __trap() { ::ctemu::fail_here("__trap() called"); }
#undef assert
#define assert(e) ((e) ? (void)0 : ::ctemu::fail_here("assertion failed: " #e " (" __FILE__ ")"))

// ---------------------------------------------------------------------------------------------
// Atomics: the runtime checks the address (bounds; for the race detector an atomic access and a
// release/acquire point), may let other threads and blocks run first (random schedule), then the
// read-modify-write runs with no other fiber running.
#define CTEMU_ATOMIC(NAME, T, EXPR) CTEMU_ATOMIC_RMW(NAME, T, EXPR, 0)
#define CTEMU_ATOMIC_RMW(NAME, T, EXPR, EXCHANGE) \
  CTEMU_ATOMIC_FN static inline T NAME(T* a, T v) { \
    ::ctemu::atomic_access(a, sizeof(T), CTEMU_CALLER, EXCHANGE); T o = *a; *a = (EXPR); return o; }
CTEMU_ATOMIC(atomicAdd, int, o + v)
CTEMU_ATOMIC(atomicAdd, unsigned int, o + v)
CTEMU_ATOMIC(atomicAdd, unsigned long long, o + v)
CTEMU_ATOMIC(atomicAdd, float, o + v)
CTEMU_ATOMIC(atomicAdd, double, o + v)
CTEMU_ATOMIC(atomicSub, int, o - v)
CTEMU_ATOMIC(atomicSub, unsigned int, o - v)
CTEMU_ATOMIC_RMW(atomicExch, int, v, 1)
CTEMU_ATOMIC_RMW(atomicExch, unsigned int, v, 1)
CTEMU_ATOMIC_RMW(atomicExch, unsigned long long, v, 1)
CTEMU_ATOMIC_RMW(atomicExch, float, v, 1)
CTEMU_ATOMIC(atomicMax, int, o > v ? o : v)
CTEMU_ATOMIC(atomicMax, unsigned int, o > v ? o : v)
CTEMU_ATOMIC(atomicMax, unsigned long long, o > v ? o : v)
CTEMU_ATOMIC(atomicMax, long long, o > v ? o : v)
CTEMU_ATOMIC(atomicMin, int, o < v ? o : v)
CTEMU_ATOMIC(atomicMin, unsigned int, o < v ? o : v)
CTEMU_ATOMIC(atomicMin, unsigned long long, o < v ? o : v)
CTEMU_ATOMIC(atomicMin, long long, o < v ? o : v)
CTEMU_ATOMIC(atomicOr, int, o | v)
CTEMU_ATOMIC(atomicOr, unsigned int, o | v)
CTEMU_ATOMIC(atomicOr, unsigned long long, o | v)
CTEMU_ATOMIC(atomicAnd, int, o & v)
CTEMU_ATOMIC(atomicAnd, unsigned int, o & v)
CTEMU_ATOMIC(atomicAnd, unsigned long long, o & v)
CTEMU_ATOMIC(atomicXor, int, o ^ v)
CTEMU_ATOMIC(atomicXor, unsigned int, o ^ v)
CTEMU_ATOMIC(atomicXor, unsigned long long, o ^ v)
CTEMU_ATOMIC(atomicInc, unsigned int, o >= v ? 0u : o + 1u)
CTEMU_ATOMIC(atomicDec, unsigned int, (o == 0u || o > v) ? v : o - 1u)
#undef CTEMU_ATOMIC
#undef CTEMU_ATOMIC_RMW
#define CTEMU_CAS(T) \
  CTEMU_ATOMIC_FN static inline T atomicCAS(T* a, T cmp, T v) { \
    ::ctemu::atomic_access(a, sizeof(T), CTEMU_CALLER, 0); T o = *a; if (o == cmp) *a = v; return o; }
CTEMU_CAS(int)
CTEMU_CAS(unsigned int)
CTEMU_CAS(unsigned long long)
CTEMU_CAS(unsigned short)
#undef CTEMU_CAS

namespace ctemu {
// Parameter type codes of the signature (below); chainer_tc_emu_fp16.h adds the half types.
template <typename T> struct Code { static const char* get() { return nullptr; } };
}  // namespace ctemu

#include "chainer_tc_emu_fp16.h"

// ---------------------------------------------------------------------------------------------
// What the emulator's Python side generates code for.
namespace ctemu {

// A `__shared__ T name;` becomes `auto& name = ::ctemu::shared_ref<T, ID>("name");`: per
// block storage the runtime provides (filled with 0xff bytes when the block starts, a read of a
// byte no thread of the block wrote is an error, bounds checked, seen by the race detector).
// The slot is per module and per instantiation.
template <typename T, int ID>
static inline T& shared_ref(const char* name) {
  static int slot = -1;
  return *static_cast<T*>(shared_var(&slot, sizeof(T), sizeof(std::remove_all_extents_t<T>), name,
                                     __PRETTY_FUNCTION__));
}

// The launch's glue reads the launcher's own memory (the argument values, this Body): not
// instrumented, so that kernel code is the only code held to the memory the launch gives it.
template <typename... A, usize... I>
__attribute__((no_sanitize("thread")))
static inline void call_kernel(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <typename... A>
struct Body {
  void (*k)(A...);
  void** args;
  __attribute__((no_sanitize("thread"))) static void run(void* self) {
    Body* b = (Body*)self;
    call_kernel(b->k, b->args, std::index_sequence_for<A...>{});
  }
};

template <typename... A>
static int launch(void (*k)(A...), const char* name, const LaunchArgs* la) {
  static_assert(sizeof...(A) < kMaxParams, "too many kernel parameters");
  static constexpr usize aligns[] = {alignof(std::remove_cv_t<std::remove_reference_t<A>>)..., 1};
  void* vals[sizeof...(A) + 1];
  Body<A...> body{k, vals};
  return run_launch(name, la, (int)sizeof...(A), aligns, vals, &Body<A...>::run, &body);
}

// ---- parameter signatures, checked by the Python launcher before a launch -----------------------
#define CTEMU_CODE(T, C) template <> struct Code<T> { static const char* get() { return C; } };
CTEMU_CODE(bool, "b1")
CTEMU_CODE(char, "i1")
CTEMU_CODE(signed char, "i1")
CTEMU_CODE(unsigned char, "u1")
CTEMU_CODE(short, "i2")
CTEMU_CODE(unsigned short, "u2")
CTEMU_CODE(int, "i4")
CTEMU_CODE(unsigned int, "u4")
CTEMU_CODE(long, "i8")
CTEMU_CODE(unsigned long, "u8")
CTEMU_CODE(long long, "i8")
CTEMU_CODE(unsigned long long, "u8")
CTEMU_CODE(float, "f4")
CTEMU_CODE(double, "f8")
CTEMU_CODE(void, "v")
CTEMU_CODE(float2, "f4x2")
CTEMU_CODE(float4, "f4x4")
CTEMU_CODE(double2, "f8x2")
CTEMU_CODE(int2, "i4x2")
CTEMU_CODE(int4, "i4x4")
CTEMU_CODE(uint2, "u4x2")
CTEMU_CODE(uint4, "u4x4")
#undef CTEMU_CODE

struct SigBuf {
  char s[8192];
  usize n;
  void put(const char* t) { while (*t && n + 1 < sizeof s) s[n++] = *t++; s[n] = 0; }
  void put_size(usize v) {
    char d[24];
    int k = 0;
    do { d[k++] = (char)('0' + v % 10); v /= 10; } while (v);
    while (k) { char c[2] = {d[--k], 0}; put(c); }
  }
};

template <typename T>
static inline void param_code(SigBuf& b) {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_pointer_v<U>) {
    using P = std::remove_cv_t<std::remove_pointer_t<U>>;
    // 'P' a pointer the kernel may write through, 'C' a pointer to const (never copied back)
    b.put(std::is_const_v<std::remove_pointer_t<U>> ? "C" : "P");
    if constexpr (std::is_pointer_v<P>) { b.put("u8"); }      // a table of pointers
    else if constexpr (std::is_void_v<P>) { b.put("v"); }
    else if (Code<P>::get()) { b.put(Code<P>::get()); }
    else { b.put("s"); b.put_size(sizeof(P)); }
  } else {
    b.put("S");
    if (Code<U>::get()) { b.put(Code<U>::get()); }
    else { b.put("s"); b.put_size(sizeof(U)); }
  }
  b.put(":");                   // size and alignment in the parameter block
  b.put_size(sizeof(U));
  b.put(":");
  b.put_size(alignof(U));
  b.put(",");
}

template <typename... A>
static const char* signature(void (*)(A...)) {
  static SigBuf b;
  if (!b.n) {
    b.put("");
    (param_code<A>(b), ...);
  }
  return b.s;
}

}  // namespace ctemu
