// chainer_tc emulator: __half and __half2 with the cuda_fp16.h functions our kernels use.
//
// Conversions are IEEE binary16 with round-to-nearest-even, denormals, inf and nan (NaN payloads are
// kept and quietened, as NumPy does); doubles and integers are rounded to half directly, never
// through float (that would round twice). Arithmetic is done in float and rounded once to half: for
// +, -, * and / of two halves a float carries at least 2*11+2 bits, so the double rounding is
// innocuous and the result is the correctly rounded one, as on the GPU. fma is done in double (exact
// unless the addend is too small to matter) and rounded once from double.
#pragma once

namespace ctemu {

static inline unsigned short float_to_half_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {                        // inf or nan
    if (ax == 0x7f800000u) return (unsigned short)(sign | 0x7c00u);
    return (unsigned short)(sign | 0x7c00u | 0x200u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);   // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                         // below 2^-14: subnormal half (or zero)
    float af;
    memcpy(&af, &ax, 4);
    uint32_t m = (uint32_t)nearbyintf(af * 16777216.0f);   // exact scaling by 2^24, then RNE
    return (unsigned short)(sign | m);
  }
  uint32_t e = ax - 0x38000000u;                  // rebias the exponent from 127 to 15
  uint32_t r = e >> 13, rem = e & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (unsigned short)(sign | r);
}

// The same for a double, rounded once (through float it could round twice: a double just below a
// midpoint between two halves can become that midpoint as a float, and then round to even).
static inline unsigned short double_to_half_bits(double d) {
  uint64_t x;
  memcpy(&x, &d, 8);
  uint32_t sign = (uint32_t)(x >> 48) & 0x8000u;
  uint64_t ax = x & 0x7fffffffffffffffull;
  if (ax >= 0x7ff0000000000000ull) {              // inf or nan
    if (ax == 0x7ff0000000000000ull) return (unsigned short)(sign | 0x7c00u);
    return (unsigned short)(sign | 0x7c00u | 0x200u | ((ax >> 42) & 0x3ffu));
  }
  if (ax >= 0x40effe0000000000ull) return (unsigned short)(sign | 0x7c00u);   // >= 65520 rounds to inf
  if (ax < 0x3f10000000000000ull) {               // below 2^-14: subnormal half (or zero)
    double ad;
    memcpy(&ad, &ax, 8);
    uint32_t m = (uint32_t)nearbyint(ad * 16777216.0);      // exact scaling by 2^24, then RNE
    return (unsigned short)(sign | m);
  }
  uint64_t e = ax - 0x3f00000000000000ull;        // rebias the exponent from 1023 to 15
  uint64_t r = e >> 42, rem = e & 0x3ffffffffffull;
  if (rem > 0x20000000000ull || (rem == 0x20000000000ull && (r & 1u))) r++;
  return (unsigned short)(sign | r);
}

// Integers: every one below 65520 in magnitude is exact in float; the rest round to inf.
static inline unsigned short int_to_half_bits(long long i) {
  if (i >= 65520) return 0x7c00u;
  if (i <= -65520) return 0xfc00u;
  return float_to_half_bits((float)i);
}
static inline unsigned short uint_to_half_bits(unsigned long long i) {
  return i >= 65520u ? 0x7c00u : float_to_half_bits((float)i);
}

// Half (as float) to an integer type as CUDA converts: nan gives 0, out of range saturates.
template <typename I>
static inline I saturate(float f) {
  if (f != f) return 0;
  if (f <= (float)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
  if (f >= (float)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
  return (I)f;
}

static inline float half_bits_to_float(unsigned short h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
  if (exp == 0) {
    float v = (float)man * 5.9604644775390625e-08f;   // man * 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 31) x = sign | 0x7f800000u | (man << 13);
  else x = sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  memcpy(&f, &x, 4);
  return f;
}

}  // namespace ctemu

struct __half_raw { unsigned short x; };

// Implicit conversions from float, double and every integer type, as cuda_fp16.h allows them.
#define CTEMU_HALF_FROM(T, F) \
  __half(T v) : __x(::ctemu::F(v)) {} \
  __half& operator=(T v) { __x = ::ctemu::F(v); return *this; }
struct __half {
  unsigned short __x;
  __half() = default;
  __half(const __half_raw& r) : __x(r.x) {}
  CTEMU_HALF_FROM(float, float_to_half_bits)
  CTEMU_HALF_FROM(double, double_to_half_bits)
  CTEMU_HALF_FROM(short, int_to_half_bits)
  CTEMU_HALF_FROM(int, int_to_half_bits)
  CTEMU_HALF_FROM(long, int_to_half_bits)
  CTEMU_HALF_FROM(long long, int_to_half_bits)
  CTEMU_HALF_FROM(unsigned short, uint_to_half_bits)
  CTEMU_HALF_FROM(unsigned int, uint_to_half_bits)
  CTEMU_HALF_FROM(unsigned long, uint_to_half_bits)
  CTEMU_HALF_FROM(unsigned long long, uint_to_half_bits)
  operator float() const { return ::ctemu::half_bits_to_float(__x); }
  operator __half_raw() const { __half_raw r; r.x = __x; return r; }
};
#undef CTEMU_HALF_FROM

struct __attribute__((aligned(4))) __half2 {
  __half x, y;
  __half2() = default;
  __half2(__half a, __half b) : x(a), y(b) {}
};

typedef __half half;
typedef __half2 half2;

static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline float __half2float(__half h) { return (float)h; }
static inline __half2 __float2half2_rn(float f) { return __half2(__half(f), __half(f)); }
static inline __half2 __floats2half2_rn(float a, float b) { return __half2(__half(a), __half(b)); }
static inline __half2 __float22half2_rn(float2 f) { return __half2(__half(f.x), __half(f.y)); }
static inline float2 __half22float2(__half2 h) { return make_float2((float)h.x, (float)h.y); }
static inline float __low2float(__half2 h) { return (float)h.x; }
static inline float __high2float(__half2 h) { return (float)h.y; }
static inline __half __low2half(__half2 h) { return h.x; }
static inline __half __high2half(__half2 h) { return h.y; }
static inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
static inline __half2 __half2half2(__half a) { return __half2(a, a); }
static inline __half2 __lowhigh2highlow(__half2 h) { return __half2(h.y, h.x); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline short __half_as_short(__half h) { return (short)h.__x; }
static inline __half __ushort_as_half(unsigned short u) { __half_raw r; r.x = u; return __half(r); }
static inline __half __short_as_half(short s) { return __ushort_as_half((unsigned short)s); }
static inline __half __double2half(double d) { return __half(d); }
static inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
static inline __half __short2half_rn(short i) { return __half(i); }
static inline __half __int2half_rn(int i) { return __half(i); }
static inline __half __ll2half_rn(long long i) { return __half(i); }
static inline __half __ushort2half_rn(unsigned short i) { return __half(i); }
static inline __half __uint2half_rn(unsigned int i) { return __half(i); }
static inline __half __ull2half_rn(unsigned long long i) { return __half(i); }
#define CTEMU_H2I(T, N) \
  static inline T __half2##N##_rz(__half h) { return ::ctemu::saturate<T>((float)h); } \
  static inline T __half2##N##_rn(__half h) { return ::ctemu::saturate<T>(nearbyintf((float)h)); }
CTEMU_H2I(short, short)
CTEMU_H2I(int, int)
CTEMU_H2I(long long, ll)
CTEMU_H2I(unsigned short, ushort)
CTEMU_H2I(unsigned int, uint)
CTEMU_H2I(unsigned long long, ull)
#undef CTEMU_H2I

#define CTEMU_H1(NAME, EXPR) \
  static inline __half NAME(__half a, __half b) { float x = (float)a, y = (float)b; return __half(EXPR); }
CTEMU_H1(__hadd, x + y)
CTEMU_H1(__hsub, x - y)
CTEMU_H1(__hmul, x * y)
CTEMU_H1(__hdiv, x / y)
#undef CTEMU_H1
static inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
// __hmax/__hmin: a nan loses to a number, two nans give the canonical nan, and -0 < +0.
static inline __half __hmax(__half a, __half b) {
  if (__hisnan(a) || __hisnan(b))
    return __hisnan(a) ? (__hisnan(b) ? __half(__half_raw{0x7fffu}) : b) : a;
  float x = (float)a, y = (float)b;
  if (x == y) return (a.__x & 0x8000u) ? b : a;
  return x > y ? a : b;
}
static inline __half __hmin(__half a, __half b) {
  if (__hisnan(a) || __hisnan(b))
    return __hisnan(a) ? (__hisnan(b) ? __half(__half_raw{0x7fffu}) : b) : a;
  float x = (float)a, y = (float)b;
  if (x == y) return (a.__x & 0x8000u) ? a : b;
  return x < y ? a : b;
}
// ..._nan: a nan input gives the canonical nan.
static inline __half __hmax_nan(__half a, __half b) {
  return (__hisnan(a) || __hisnan(b)) ? __half(__half_raw{0x7fffu}) : __hmax(a, b);
}
static inline __half __hmin_nan(__half a, __half b) {
  return (__hisnan(a) || __hisnan(b)) ? __half(__half_raw{0x7fffu}) : __hmin(a, b);
}
// a * b is exact in double (22 bits); + c is exact too unless c is too small to move the result
// across a half rounding boundary. One rounding, from double.
static inline __half __hfma(__half a, __half b, __half c) {
  return __half(fma((double)(float)a, (double)(float)b, (double)(float)c));
}
static inline __half __hfma_relu(__half a, __half b, __half c) {
  __half r = __hfma(a, b, c);
  return (float)r < 0.0f ? __half(0.0f) : r;
}
static inline __half __hneg(__half a) { return __ushort_as_half(a.__x ^ 0x8000u); }
static inline __half __habs(__half a) { return __ushort_as_half(a.__x & 0x7fffu); }
static inline __half hsqrt(__half a) { return __half(sqrtf((float)a)); }
static inline __half hrsqrt(__half a) { return __half(1.0f / sqrtf((float)a)); }
static inline __half hexp(__half a) { return __half(expf((float)a)); }
static inline __half hlog(__half a) { return __half(logf((float)a)); }
static inline __half hrcp(__half a) { return __half(1.0f / (float)a); }
static inline __half hfloor(__half a) { return __half(floorf((float)a)); }
static inline __half hceil(__half a) { return __half(ceilf((float)a)); }
static inline __half htrunc(__half a) { return __half(truncf((float)a)); }
static inline __half hrint(__half a) { return __half(nearbyintf((float)a)); }
static inline int __hisinf(__half a) { return a.__x == 0x7c00u ? 1 : (a.__x == 0xfc00u ? -1 : 0); }
static inline bool __heq(__half a, __half b) { return (float)a == (float)b; }
static inline bool __hne(__half a, __half b) { return (float)a != (float)b && !__hisnan(a) && !__hisnan(b); }
static inline bool __hlt(__half a, __half b) { return (float)a < (float)b; }
static inline bool __hle(__half a, __half b) { return (float)a <= (float)b; }
static inline bool __hgt(__half a, __half b) { return (float)a > (float)b; }
static inline bool __hge(__half a, __half b) { return (float)a >= (float)b; }
// unordered comparisons: true when either is nan
static inline bool __hequ(__half a, __half b) { return (float)a == (float)b || __hisnan(a) || __hisnan(b); }
static inline bool __hneu(__half a, __half b) { return (float)a != (float)b; }
static inline bool __hltu(__half a, __half b) { return !((float)a >= (float)b); }
static inline bool __hleu(__half a, __half b) { return !((float)a > (float)b); }
static inline bool __hgtu(__half a, __half b) { return !((float)a <= (float)b); }
static inline bool __hgeu(__half a, __half b) { return !((float)a < (float)b); }

#define CTEMU_H2(NAME, F) \
  static inline __half2 NAME(__half2 a, __half2 b) { return __half2(F(a.x, b.x), F(a.y, b.y)); }
CTEMU_H2(__hadd2, __hadd)
CTEMU_H2(__hsub2, __hsub)
CTEMU_H2(__hmul2, __hmul)
CTEMU_H2(__h2div, __hdiv)
CTEMU_H2(__hmax2, __hmax)
CTEMU_H2(__hmin2, __hmin)
#undef CTEMU_H2
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
static inline __half2 __hneg2(__half2 a) { return __half2(__hneg(a.x), __hneg(a.y)); }
static inline __half2 __habs2(__half2 a) { return __half2(__habs(a.x), __habs(a.y)); }

// Operators, as cuda_fp16.hpp defines them for device code.
static inline __half operator+(const __half& a, const __half& b) { return __hadd(a, b); }
static inline __half operator-(const __half& a, const __half& b) { return __hsub(a, b); }
static inline __half operator*(const __half& a, const __half& b) { return __hmul(a, b); }
static inline __half operator/(const __half& a, const __half& b) { return __hdiv(a, b); }
static inline __half operator-(const __half& a) { return __hneg(a); }
static inline __half& operator+=(__half& a, const __half& b) { return a = __hadd(a, b); }
static inline __half& operator-=(__half& a, const __half& b) { return a = __hsub(a, b); }
static inline __half& operator*=(__half& a, const __half& b) { return a = __hmul(a, b); }
static inline __half& operator/=(__half& a, const __half& b) { return a = __hdiv(a, b); }
static inline bool operator==(const __half& a, const __half& b) { return __heq(a, b); }
static inline bool operator!=(const __half& a, const __half& b) { return (float)a != (float)b; }
static inline bool operator<(const __half& a, const __half& b) { return __hlt(a, b); }
static inline bool operator<=(const __half& a, const __half& b) { return __hle(a, b); }
static inline bool operator>(const __half& a, const __half& b) { return __hgt(a, b); }
static inline bool operator>=(const __half& a, const __half& b) { return __hge(a, b); }
static inline __half2 operator+(const __half2& a, const __half2& b) { return __hadd2(a, b); }
static inline __half2 operator-(const __half2& a, const __half2& b) { return __hsub2(a, b); }
static inline __half2 operator*(const __half2& a, const __half2& b) { return __hmul2(a, b); }
static inline __half2 operator/(const __half2& a, const __half2& b) { return __h2div(a, b); }
static inline __half2 operator-(const __half2& a) { return __hneg2(a); }

// atomicAdd on halves (sm_70+): a plain read-modify-write, like the other atomics.
CTEMU_ATOMIC_FN static inline __half atomicAdd(__half* a, __half v) {
  ::ctemu::atomic_access(a, sizeof *a, CTEMU_CALLER, 0);
  __half o = *a;
  *a = __hadd(o, v);
  return o;
}
CTEMU_ATOMIC_FN static inline __half2 atomicAdd(__half2* a, __half2 v) {
  ::ctemu::atomic_access(a, sizeof *a, CTEMU_CALLER, 0);
  __half2 o = *a;
  *a = __hadd2(o, v);
  return o;
}

namespace ctemu {
template <> struct Code<__half> { static const char* get() { return "f2"; } };
template <> struct Code<__half2> { static const char* get() { return "f2x2"; } };
}  // namespace ctemu
