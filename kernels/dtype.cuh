// kernels/dtype.cuh: element access shared by the kernel families. Data of type __half, float or
// double is read into, and written from, its arithmetic type Acc<T> (float for __half and float,
// double for double); stores round to nearest even. chainer_tc.kernels.source() inlines this
// file where a .cu says #include "dtype.cuh", so every compiler sees one self-contained source.
#ifndef CHAINER_TC_DTYPE_CUH
#define CHAINER_TC_DTYPE_CUH
#include <cuda_fp16.h>

namespace ctc {

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float load(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ void store(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(double* p, long long i, double v) { p[i] = v; }

}  // namespace ctc

#endif  // CHAINER_TC_DTYPE_CUH
