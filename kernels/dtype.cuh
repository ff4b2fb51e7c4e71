// kernels/dtype.cuh: element access shared by the kernel families. Data of type __half, float or
// double is read into, and written from, its arithmetic type Acc<T> (float for __half and float,
// double for double); stores round to nearest even. chainer_tc.kernels.source() inlines this
// file where a .cu says #include "dtype.cuh", so every compiler sees one self-contained source.
//
// load_v<V>/store_v<V> move V (1 or 2) consecutive elements p[i], p[i + 1]. V == 2 is one vector
// access (__half2, float2, double2, int2): p + i must be aligned to 2 * sizeof(T), which the
// callers check on the host before they choose V = 2. The values are the same as V scalar
// accesses (each lane converts and rounds on its own).
#ifndef CHAINER_TC_DTYPE_CUH
#define CHAINER_TC_DTYPE_CUH
#include <cuda_fp16.h>

namespace ctc {

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float load(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ int load(const int* p, long long i) { return p[i]; }
__device__ __forceinline__ void store(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ void store(int* p, long long i, int v) { p[i] = v; }

__device__ __forceinline__ void load2(const __half* p, long long i, float* v) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(p + i));
  v[0] = f.x;
  v[1] = f.y;
}
__device__ __forceinline__ void load2(const float* p, long long i, float* v) {
  const float2 f = *reinterpret_cast<const float2*>(p + i);
  v[0] = f.x;
  v[1] = f.y;
}
__device__ __forceinline__ void load2(const double* p, long long i, double* v) {
  const double2 f = *reinterpret_cast<const double2*>(p + i);
  v[0] = f.x;
  v[1] = f.y;
}
__device__ __forceinline__ void load2(const int* p, long long i, int* v) {
  const int2 f = *reinterpret_cast<const int2*>(p + i);
  v[0] = f.x;
  v[1] = f.y;
}
__device__ __forceinline__ void store2(__half* p, long long i, const float* v) {
  *reinterpret_cast<__half2*>(p + i) = __floats2half2_rn(v[0], v[1]);
}
__device__ __forceinline__ void store2(float* p, long long i, const float* v) {
  *reinterpret_cast<float2*>(p + i) = make_float2(v[0], v[1]);
}
__device__ __forceinline__ void store2(double* p, long long i, const double* v) {
  *reinterpret_cast<double2*>(p + i) = make_double2(v[0], v[1]);
}
__device__ __forceinline__ void store2(int* p, long long i, const int* v) {
  *reinterpret_cast<int2*>(p + i) = make_int2(v[0], v[1]);
}

template <int V, typename T, typename A>
__device__ __forceinline__ void load_v(const T* p, long long i, A (&v)[V]) {
  static_assert(V == 1 || V == 2, "vector width 1 or 2");
  if constexpr (V == 2) load2(p, i, v);
  else v[0] = load(p, i);
}
template <int V, typename T, typename A>
__device__ __forceinline__ void store_v(T* p, long long i, const A (&v)[V]) {
  static_assert(V == 1 || V == 2, "vector width 1 or 2");
  if constexpr (V == 2) store2(p, i, v);
  else store(p, i, v[0]);
}

}  // namespace ctc

#endif  // CHAINER_TC_DTYPE_CUH
