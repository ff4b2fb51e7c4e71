// chainer_tc emulator: __half and __half2 with the cuda_fp16.h functions our kernels use.
//
// Conversions are IEEE binary16 with round-to-nearest-even, denormals, inf and nan (NaN payloads are
// kept and quietened, as NumPy does). Arithmetic is done in float (or double for fma) and rounded
// once to half: for +, -, * and / of two halves a float carries more than 2*11+2 bits, so the
// double rounding is innocuous and the result is the correctly rounded one, as on the GPU.
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

struct __half {
  unsigned short __x;
  __half() = default;
  __half(const __half_raw& r) : __x(r.x) {}
  __half(float f) : __x(::ctemu::float_to_half_bits(f)) {}
  __half(double f) : __x(::ctemu::float_to_half_bits((float)f)) {}
  __half(int i) : __x(::ctemu::float_to_half_bits((float)i)) {}
  operator float() const { return ::ctemu::half_bits_to_float(__x); }
  operator __half_raw() const { __half_raw r; r.x = __x; return r; }
  __half& operator=(float f) { __x = ::ctemu::float_to_half_bits(f); return *this; }
};

struct __attribute__((aligned(4))) __half2 {
  __half x, y;
  __half2() = default;
  __half2(__half a, __half b) : x(a), y(b) {}
};

typedef __half half;
typedef __half2 half2;

static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline __half __double2half(double f) { return __half((float)f); }  // TEMP
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
static inline __half __int2half_rn(int i) { return __half((float)i); }
static inline int __half2int_rz(__half h) { return (int)(float)h; }
static inline int __half2int_rn(__half h) { return (int)nearbyintf((float)h); }

#define CTEMU_H1(NAME, EXPR) \
  static inline __half NAME(__half a, __half b) { float x = (float)a, y = (float)b; return __half(EXPR); }
CTEMU_H1(__hadd, x + y)
CTEMU_H1(__hsub, x - y)
CTEMU_H1(__hmul, x * y)
CTEMU_H1(__hdiv, x / y)
CTEMU_H1(__hmax, (x != x) ? y : ((y != y) ? x : (x > y ? x : y)))
CTEMU_H1(__hmin, (x != x) ? y : ((y != y) ? x : (x < y ? x : y)))
#undef CTEMU_H1
static inline __half __hfma(__half a, __half b, __half c) {
  return __half((float)fma((double)(float)a, (double)(float)b, (double)(float)c));
}
static inline __half __hneg(__half a) { return __ushort_as_half(a.__x ^ 0x8000u); }
static inline __half __habs(__half a) { return __ushort_as_half(a.__x & 0x7fffu); }
static inline __half hsqrt(__half a) { return __half(sqrtf((float)a)); }
static inline __half hrsqrt(__half a) { return __half(1.0f / sqrtf((float)a)); }
static inline __half hexp(__half a) { return __half(expf((float)a)); }
static inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
static inline int __hisinf(__half a) { return a.__x == 0x7c00u ? 1 : (a.__x == 0xfc00u ? -1 : 0); }
static inline bool __heq(__half a, __half b) { return (float)a == (float)b; }
static inline bool __hne(__half a, __half b) { return (float)a != (float)b && !__hisnan(a) && !__hisnan(b); }
static inline bool __hlt(__half a, __half b) { return (float)a < (float)b; }
static inline bool __hle(__half a, __half b) { return (float)a <= (float)b; }
static inline bool __hgt(__half a, __half b) { return (float)a > (float)b; }
static inline bool __hge(__half a, __half b) { return (float)a >= (float)b; }

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

namespace ctemu {
template <> struct Code<__half> { static std::string get() { return "f2"; } };
template <> struct Code<__half2> { static std::string get() { return "f2x2"; } };
}  // namespace ctemu
