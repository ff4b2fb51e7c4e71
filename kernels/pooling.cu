// kernels/pooling.cu: max and average pooling over channels-last (NHWC) arrays, forward and
// backward, with Chainer's semantics (chainer.functions.max_pooling_2d / average_pooling_2d).
//
// Geometry, passed by value: PoolShape {N, H, W, C, OH, OW, kh, kw, sy, sx, ph, pw}.
//   Output (oh, ow) covers input rows oh*sy - ph .. + kh - 1 and columns ow*sx - pw .. + kw - 1;
//   positions outside the input count as -inf for max and as 0 for average (which divides by
//   kh*kw, padding included, as Chainer's average_pooling_2d). OH/OW come from the caller
//   (cover_all for max pooling only changes them).
// Kernels and their launch shapes (templates on T in {__half, float, double}; any 1-D grid, block
// POOL_THREADS, grid-stride loops; all pointers C-contiguous):
//   max_pool_forward<T>(s, x, y, argmax)     y[n,oh,ow,c] = max over the window (NaN if the
//                                            window holds one); argmax = the window offset
//                                            i*kw+j of the first maximum (first NaN) (int32).
//   max_pool_backward<T>(s, gy, argmax, gx)  gx[n,h,w,c] = sum of gy over the outputs whose
//                                            argmax is (h, w) (a gather: deterministic, no atomics).
//   avg_pool_forward<T>(s, x, y)             y = sum over the window / (kh*kw).
//   avg_pool_backward<T>(s, gy, gx)          gx = sum of gy / (kh*kw) over the covering outputs.
// Each writes only its output array, every element of it.
#include "dtype.cuh"

#ifndef POOL_THREADS
#define POOL_THREADS 256
#endif
// Occupancy target for ptxas (blocks per SM): the block size alone makes NVRTC 12.9 aim at 32
// registers and spill; 4 blocks of 256 threads allow 64, enough for every instantiation.
#define POOL_MIN_BLOCKS 4

struct PoolShape {
  int N, H, W, C, OH, OW, kh, kw, sy, sx, ph, pw;
};

namespace pool {

using ctc::Acc;
using ctc::load;
using ctc::store;

__device__ __forceinline__ void neg_inf(float& v) { v = -__int_as_float(0x7f800000); }
__device__ __forceinline__ void neg_inf(double& v) { v = -__longlong_as_double(0x7ff0000000000000LL); }

// (n, h, w, c) of flat index i into an (N, height, width, C) array.
__device__ __forceinline__ void unflatten(long long i, int height, int width, int C, int& n, int& h,
                                          int& w, int& c) {
  c = (int)(i % C);
  i /= C;
  w = (int)(i % width);
  i /= width;
  h = (int)(i % height);
  n = (int)(i / height);
}

// Outputs along one axis whose window contains input position p: [lo, hi].
__device__ __forceinline__ void covering(int p, int k, int s, int pad, int out, int& lo, int& hi) {
  const int q = p + pad;                       // position in padded coordinates
  lo = q < k ? 0 : (q - k) / s + 1;            // first o with o*s + k > q
  hi = min(q / s, out - 1);                    // last o with o*s <= q
}

}  // namespace pool

namespace pool {

// One output per thread: the max (and its window offset) or the mean of the window.
template <bool kMax, typename T>
__device__ __forceinline__ void forward(const PoolShape& s, const T* __restrict__ x,
                                        T* __restrict__ y, int* __restrict__ argmax) {
  typedef typename Acc<T>::type A;
  const long long total = (long long)s.N * s.OH * s.OW * s.C;
  for (long long i = blockIdx.x * (long long)POOL_THREADS + threadIdx.x; i < total;
       i += (long long)gridDim.x * POOL_THREADS) {
    int n, oh, ow, c;
    unflatten(i, s.OH, s.OW, s.C, n, oh, ow, c);
    A acc = 0;
    if (kMax) neg_inf(acc);
    int where = 0;
    for (int a = 0; a < s.kh; ++a) {
      const int h = oh * s.sy - s.ph + a;
      if (h < 0 || h >= s.H) continue;
      for (int b = 0; b < s.kw; ++b) {
        const int w = ow * s.sx - s.pw + b;
        if (w < 0 || w >= s.W) continue;
        const A v = load(x, (((long long)n * s.H + h) * s.W + w) * s.C + c);
        if (!kMax) {
          acc += v;
        } else if (v > acc || (v != v && acc == acc)) {
          // strict: ties keep the first maximum; the first NaN wins and stays (as Chainer's
          // argmax over the window does: NaN propagates)
          acc = v;
          where = a * s.kw + b;
        }
      }
    }
    store(y, i, kMax ? acc : acc / A(s.kh * s.kw));
    if (kMax) argmax[i] = where;
  }
}

// One input gradient per thread, gathered from the outputs whose windows cover it.
template <bool kMax, typename T>
__device__ __forceinline__ void backward(const PoolShape& s, const T* __restrict__ gy,
                                         const int* __restrict__ argmax, T* __restrict__ gx) {
  typedef typename Acc<T>::type A;
  const long long total = (long long)s.N * s.H * s.W * s.C;
  for (long long i = blockIdx.x * (long long)POOL_THREADS + threadIdx.x; i < total;
       i += (long long)gridDim.x * POOL_THREADS) {
    int n, h, w, c;
    unflatten(i, s.H, s.W, s.C, n, h, w, c);
    int oh0, oh1, ow0, ow1;
    covering(h, s.kh, s.sy, s.ph, s.OH, oh0, oh1);
    covering(w, s.kw, s.sx, s.pw, s.OW, ow0, ow1);
    A sum = 0;
    for (int oh = oh0; oh <= oh1; ++oh)
      for (int ow = ow0; ow <= ow1; ++ow) {
        const long long o = (((long long)n * s.OH + oh) * s.OW + ow) * s.C + c;
        if (!kMax || argmax[o] == (h + s.ph - oh * s.sy) * s.kw + (w + s.pw - ow * s.sx))
          sum += load(gy, o);
      }
    store(gx, i, kMax ? sum : sum / A(s.kh * s.kw));
  }
}

}  // namespace pool

template <typename T>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
max_pool_forward(const PoolShape s, const T* __restrict__ x, T* __restrict__ y,
                 int* __restrict__ argmax) {
  pool::forward<true>(s, x, y, argmax);
}

template <typename T>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
max_pool_backward(const PoolShape s, const T* __restrict__ gy, const int* __restrict__ argmax,
                  T* __restrict__ gx) {
  pool::backward<true>(s, gy, argmax, gx);
}

template <typename T>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
avg_pool_forward(const PoolShape s, const T* __restrict__ x, T* __restrict__ y) {
  pool::forward<false>(s, x, y, (int*)nullptr);
}

template <typename T>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
avg_pool_backward(const PoolShape s, const T* __restrict__ gy, T* __restrict__ gx) {
  pool::backward<false>(s, gy, (const int*)nullptr, gx);
}

#define POOL_INSTANTIATE(T) \
  template __global__ void max_pool_forward<T>(const PoolShape, const T*, T*, int*); \
  template __global__ void max_pool_backward<T>(const PoolShape, const T*, const int*, T*); \
  template __global__ void avg_pool_forward<T>(const PoolShape, const T*, T*); \
  template __global__ void avg_pool_backward<T>(const PoolShape, const T*, T*);
POOL_INSTANTIATE(__half)
POOL_INSTANTIATE(float)
POOL_INSTANTIATE(double)
