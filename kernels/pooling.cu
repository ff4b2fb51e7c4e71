// kernels/pooling.cu: max and average pooling over channels-last (NHWC) arrays, forward and
// backward, with Chainer's semantics (chainer.functions.max_pooling_2d / average_pooling_2d).
//
// Geometry, passed by value: PoolShape {N, H, W, C, OH, OW, kh, kw, sy, sx, ph, pw}.
//   Output (oh, ow) covers input rows oh*sy - ph .. + kh - 1 and columns ow*sx - pw .. + kw - 1;
//   positions outside the input count as -inf for max and as 0 for average (which divides by
//   kh*kw, padding included, as Chainer's average_pooling_2d). OH/OW come from the caller
//   (cover_all for max pooling only changes them).
// Kernels and their launch shapes (templates on T in {__half, float, double} and the vector
// width V in {1, 2}; all pointers C-contiguous). Every kernel is 2-D: thread x of block column
// blockIdx.x owns channels c = V*g .. c + V - 1 with g = blockIdx.x * blockDim.x + threadIdx.x
// < C / V (grid.x * blockDim.x >= C / V); threadIdx.y + blockIdx.y * blockDim.y is its first
// position (n, oh, ow) of the output (forward) or (n, h, w) of the input (backward), and it
// strides by gridDim.y * blockDim.y (any grid.y; block at most POOL_THREADS threads). A thread
// unflattens its first position once; later positions follow by adds (pool::Walk), so no
// element costs a division. V = 2 (C even, every array aligned to two of its elements): one
// __half2/float2/double2 (int2 for argmax) access per two channels, each channel computed as
// with V = 1 (its own max, argmax and first NaN).
//   max_pool_forward<T,V>(s, x, y, argmax)   y[n,oh,ow,c] = max over the window (NaN if the
//                                            window holds one); argmax = the window offset
//                                            i*kw+j of the first maximum (first NaN) (int32).
//   max_pool_backward<T,V>(s, gy, argmax, gx) gx[n,h,w,c] = sum of gy over the outputs whose
//                                            argmax is (h, w) (a gather: deterministic, no atomics).
//   avg_pool_forward<T,V>(s, x, y)           y = sum over the window / (kh*kw).
//   avg_pool_backward<T,V>(s, gy, gx)        gx = sum of gy / (kh*kw) over the covering outputs.
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
using ctc::load_v;
using ctc::store_v;

__device__ __forceinline__ void neg_inf(float& v) { v = -__int_as_float(0x7f800000); }
__device__ __forceinline__ void neg_inf(double& v) { v = -__longlong_as_double(0x7ff0000000000000LL); }

// The positions (n, row, col) of an (N, rows, cols) grid that one thread visits: flat position
// p = (n * rows + row) * cols + col starting at `first` and stepping by `step`, both below 2^31
// (grid.y <= 65535, block.y <= 1024). They are split once, in 32 bits, when the walk starts;
// each step is adds and compares (a mixed-radix add), no division.
struct Walk {
  long long p, step;
  int n, dn;
  unsigned row, col, drow, dcol;     // unsigned: col + dcol may pass 2^31 - 1 before the carry

  __device__ __forceinline__ static void split(unsigned v, unsigned plane, unsigned cols, int& n,
                                               unsigned& row, unsigned& col) {
    n = (int)(v / plane);
    const unsigned in_plane = v - (unsigned)n * plane;
    row = in_plane / cols;
    col = in_plane - row * cols;
  }
  __device__ __forceinline__ Walk(unsigned first, unsigned step_, int rows, int cols)
      : p(first), step(step_) {
    // a plane larger than 2^31 - 1 holds every v < 2^31: clamping it changes no quotient
    const long long plane = (long long)rows * cols;
    const unsigned plane32 = (unsigned)min(plane, (long long)0x7fffffff);
    split(first, plane32, (unsigned)cols, n, row, col);
    split(step_, plane32, (unsigned)cols, dn, drow, dcol);
  }
  // The next position; only called while it is inside the grid, so n never passes N - 1.
  __device__ __forceinline__ void next(int rows, int cols) {
    p += step;
    col += dcol;
    unsigned carry = col >= (unsigned)cols;
    if (carry) col -= cols;
    row += drow + carry;
    carry = row >= (unsigned)rows;
    if (carry) row -= rows;
    n += dn + (int)carry;
  }
};

// Outputs along one axis whose window contains input position p: [lo, hi].
__device__ __forceinline__ void covering(int p, int k, int s, int pad, int out, int& lo, int& hi) {
  const int q = p + pad;                       // position in padded coordinates
  lo = q < k ? 0 : (q - k) / s + 1;            // first o with o*s + k > q
  hi = min(q / s, out - 1);                    // last o with o*s <= q
}

// Thread layout of every pooling kernel: thread x of block column blockIdx.x owns channels
// c = V * g .. c + V - 1, g = blockIdx.x * blockDim.x + threadIdx.x < C / V; threadIdx.y +
// blockIdx.y * blockDim.y is its first position, and it strides by gridDim.y * blockDim.y.

// One output position (V channels) per step: the max (and its window offset) or the mean.
template <bool kMax, int V, typename T>
__device__ __forceinline__ void forward(const PoolShape& s, const T* __restrict__ x,
                                        T* __restrict__ y, int* __restrict__ argmax) {
  typedef typename Acc<T>::type A;
  const unsigned group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= (unsigned)(s.C / V)) return;
  const int c = (int)group * V;
  const long long total = (long long)s.N * s.OH * s.OW;
  const unsigned first = blockIdx.y * blockDim.y + threadIdx.y;
  if (first >= total) return;
  Walk at(first, gridDim.y * blockDim.y, s.OH, s.OW);
  while (true) {
    A acc[V];
    int where[V];
    for (int k = 0; k < V; ++k) {
      acc[k] = 0;
      if (kMax) neg_inf(acc[k]);
      where[k] = 0;
    }
    const long long img = (long long)at.n * s.H;
    const int h0 = (int)at.row * s.sy - s.ph, w0 = (int)at.col * s.sx - s.pw;
    for (int a = 0; a < s.kh; ++a) {
      const int h = h0 + a;
      if (h < 0 || h >= s.H) continue;
      const long long line = ((img + h) * s.W + w0) * s.C + c;   // element (n, h, w0, c)
      for (int b = 0; b < s.kw; ++b) {
        const int w = w0 + b;
        if (w < 0 || w >= s.W) continue;
        A v[V];
        load_v<V>(x, line + (long long)b * s.C, v);
        for (int k = 0; k < V; ++k) {
          if (!kMax) {
            acc[k] += v[k];
          } else if (v[k] > acc[k] || (v[k] != v[k] && acc[k] == acc[k])) {
            // strict: ties keep the first maximum; the first NaN wins and stays (as Chainer's
            // argmax over the window does: NaN propagates)
            acc[k] = v[k];
            where[k] = a * s.kw + b;
          }
        }
      }
    }
    const long long o = at.p * s.C + c;
    if (!kMax)
      for (int k = 0; k < V; ++k) acc[k] = acc[k] / A(s.kh * s.kw);
    store_v<V>(y, o, acc);
    if (kMax) store_v<V>(argmax, o, where);
    if (at.p + at.step >= total) break;
    at.next(s.OH, s.OW);
  }
}

// One input position (V channels) per step, its gradient gathered from the outputs whose windows
// cover it.
template <bool kMax, int V, typename T>
__device__ __forceinline__ void backward(const PoolShape& s, const T* __restrict__ gy,
                                         const int* __restrict__ argmax, T* __restrict__ gx) {
  typedef typename Acc<T>::type A;
  const unsigned group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= (unsigned)(s.C / V)) return;
  const int c = (int)group * V;
  const long long total = (long long)s.N * s.H * s.W;
  const unsigned first = blockIdx.y * blockDim.y + threadIdx.y;
  if (first >= total) return;
  Walk at(first, gridDim.y * blockDim.y, s.H, s.W);
  while (true) {
    const int h = (int)at.row, w = (int)at.col;
    int oh0, oh1, ow0, ow1;
    covering(h, s.kh, s.sy, s.ph, s.OH, oh0, oh1);
    covering(w, s.kw, s.sx, s.pw, s.OW, ow0, ow1);
    A sum[V];
    for (int k = 0; k < V; ++k) sum[k] = 0;
    const long long img = (long long)at.n * s.OH;
    for (int oh = oh0; oh <= oh1; ++oh)
      for (int ow = ow0; ow <= ow1; ++ow) {
        const long long o = ((img + oh) * s.OW + ow) * s.C + c;
        if (!kMax) {
          A g[V];
          load_v<V>(gy, o, g);
          for (int k = 0; k < V; ++k) sum[k] += g[k];
        } else {
          const int offset = (h + s.ph - oh * s.sy) * s.kw + (w + s.pw - ow * s.sx);
          int am[V];
          load_v<V>(argmax, o, am);
          if constexpr (V == 1) {
            if (am[0] == offset) sum[0] += load(gy, o);
          } else {
            A g[V];
            load_v<V>(gy, o, g);
            for (int k = 0; k < V; ++k)
              if (am[k] == offset) sum[k] += g[k];
          }
        }
      }
    if (!kMax)
      for (int k = 0; k < V; ++k) sum[k] = sum[k] / A(s.kh * s.kw);
    store_v<V>(gx, at.p * s.C + c, sum);
    if (at.p + at.step >= total) break;
    at.next(s.H, s.W);
  }
}

}  // namespace pool

template <typename T, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
max_pool_forward(const PoolShape s, const T* __restrict__ x, T* __restrict__ y,
                 int* __restrict__ argmax) {
  pool::forward<true, V>(s, x, y, argmax);
}

template <typename T, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
max_pool_backward(const PoolShape s, const T* __restrict__ gy, const int* __restrict__ argmax,
                  T* __restrict__ gx) {
  pool::backward<true, V>(s, gy, argmax, gx);
}

template <typename T, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
avg_pool_forward(const PoolShape s, const T* __restrict__ x, T* __restrict__ y) {
  pool::forward<false, V>(s, x, y, (int*)nullptr);
}

template <typename T, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
avg_pool_backward(const PoolShape s, const T* __restrict__ gy, T* __restrict__ gx) {
  pool::backward<false, V>(s, gy, (const int*)nullptr, gx);
}

#define POOL_INSTANTIATE_V(T, V) \
  template __global__ void max_pool_forward<T, V>(const PoolShape, const T*, T*, int*); \
  template __global__ void max_pool_backward<T, V>(const PoolShape, const T*, const int*, T*); \
  template __global__ void avg_pool_forward<T, V>(const PoolShape, const T*, T*); \
  template __global__ void avg_pool_backward<T, V>(const PoolShape, const T*, T*);
#define POOL_INSTANTIATE(T) POOL_INSTANTIATE_V(T, 1) POOL_INSTANTIATE_V(T, 2)
POOL_INSTANTIATE(__half)
POOL_INSTANTIATE(float)
POOL_INSTANTIATE(double)
