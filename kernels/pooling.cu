// kernels/pooling.cu: max and average pooling over channels-last (NHWC) arrays, forward and
// backward, with Chainer's semantics (chainer.functions.max_pooling_2d / average_pooling_2d).
//
// Geometry, passed by value: PoolShape {N, H, W, C, OH, OW, kh, kw, sy, sx, ph, pw}.
//   Output (oh, ow) covers input rows oh*sy - ph .. + kh - 1 and columns ow*sx - pw .. + kw - 1;
//   positions outside the input count as -inf for max and as 0 for average (which divides by
//   kh*kw, padding included, as Chainer's average_pooling_2d). OH/OW come from the caller
//   (cover_all for max pooling only changes them).
// Kernels and their launch shapes (templates on T in {__half, float, double}, the vector width
// V in {1, 2} and, for max pooling, the window offset type I in {unsigned char, int}; all pointers
// C-contiguous). Every kernel is 2-D: thread x of block column blockIdx.x owns channels
// c = V*g .. c + V - 1 with g = blockIdx.x * blockDim.x + threadIdx.x < C / V
// (grid.x * blockDim.x >= C / V); threadIdx.y + blockIdx.y * blockDim.y is its first work item
// and it strides over the items by gridDim.y * blockDim.y (any grid.y; block at most
// POOL_THREADS threads). Forward an item is one output position (n, oh, ow): N*OH*OW items.
// Backward it is a run of consecutive input columns of one row (n, h): each row of W columns is
// cut into runs = ceil(W / POOL_RUN) runs of len = ceil(W / runs) columns (the last may be
// shorter, none is empty): N*H*runs items. A thread unflattens its first item once; later items
// follow by adds (pool::Walk), so no element costs a division, and backward only a run's first
// column does (two 32-bit divisions: which outputs cover it); the run's other columns update
// that by compares and adds. V = 2 (C even, every array aligned to two of its elements): one
// __half2/float2/double2 (int2 or two bytes for argmax) access per two channels, each channel
// computed as with V = 1 (its own max, argmax and first NaN).
//   max_pool_forward<T,I,V>(s, x, y, argmax)  y[n,oh,ow,c] = max over the window (NaN if the
//                                             window holds one); argmax = the window offset
//                                             i*kw+j of the first maximum (first NaN), as I:
//                                             the caller takes unsigned char where kh*kw <= 256
//                                             (a quarter of int's bytes), int otherwise.
//   max_pool_backward<T,I,V>(s, gy, argmax, gx)  gx[n,h,w,c] = sum of gy over the outputs whose
//                                             argmax is (h, w) (a gather: deterministic, no
//                                             atomics), added in order of oh, then ow.
//   avg_pool_forward<T,V>(s, x, y)            y = sum over the window / (kh*kw).
//   avg_pool_backward<T,V>(s, gy, gx)         gx = sum of gy over the covering outputs (in order
//                                             of oh, then ow) / (kh*kw).
// Each writes only its output array, every element of it.
#include "dtype.cuh"

#ifndef POOL_THREADS
#define POOL_THREADS 256
#endif
// Backward: the most consecutive input columns one work item walks (see above). Longer runs
// spread a run's divisions over more columns; shorter ones make more items for small inputs.
#ifndef POOL_RUN
#define POOL_RUN 16
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

// Window offsets (argmax) of V consecutive channels as I (unsigned char or int). Two bytes are one
// 2-byte access (CUDA's uchar2, spelled out: the emulator has no uchar2); p + i is then aligned
// to two elements, as the caller checks before it takes V = 2.
struct __align__(2) Bytes2 {
  unsigned char x, y;
};

template <int V, typename I>
__device__ __forceinline__ void load_offsets(const I* p, long long i, int (&v)[V]) {
  static_assert(V == 1 || V == 2, "vector width 1 or 2");
  if constexpr (V == 1) {
    v[0] = p[i];
  } else if constexpr (sizeof(I) == 1) {
    const Bytes2 b = *reinterpret_cast<const Bytes2*>(p + i);
    v[0] = b.x;
    v[1] = b.y;
  } else {
    const int2 b = *reinterpret_cast<const int2*>(p + i);
    v[0] = b.x;
    v[1] = b.y;
  }
}

template <int V, typename I>
__device__ __forceinline__ void store_offsets(I* p, long long i, const int (&v)[V]) {
  static_assert(V == 1 || V == 2, "vector width 1 or 2");
  if constexpr (V == 1) {
    p[i] = (I)v[0];
  } else if constexpr (sizeof(I) == 1) {
    Bytes2 b;
    b.x = (unsigned char)v[0];
    b.y = (unsigned char)v[1];
    *reinterpret_cast<Bytes2*>(p + i) = b;
  } else {
    *reinterpret_cast<int2*>(p + i) = make_int2(v[0], v[1]);
  }
}

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

// The outputs along one axis (window k, stride s) whose windows contain the input position at
// padded coordinate q >= 0: lo .. hi (hi not yet clipped to the last output), and how many steps
// of q + 1 until each moves: lo moves on when q reaches the end of window lo (lo * s + k), hi when
// q reaches the start of window hi + 1. One 32-bit division; ks = k / s and kr = k % s are the
// caller's, divided once per thread. Walking q up by one is then (step()) compares and adds.
// Everything stays in int: to_lo <= max(k, s) and to_hi <= s.
struct Cover {
  int lo, hi, to_lo, to_hi;

  __device__ __forceinline__ Cover(int q, int k, int s, int ks, int kr) {
    const int qs = (int)((unsigned)q / (unsigned)s), qr = q - qs * s;
    hi = qs;                                      // the last o with o * s <= q
    to_hi = s - qr;
    // the first o with o * s + k > q: o = floor((q - k) / s) + 1, with q - k = (qs - ks) * s +
    // (qr - kr), qr - kr in (-s, s)
    if (q < k) {
      lo = 0;
      to_lo = k - q;
    } else if (qr >= kr) {
      lo = qs - ks + 1;
      to_lo = s - (qr - kr);
    } else {
      lo = qs - ks;
      to_lo = kr - qr;
    }
  }
  // q + 1
  __device__ __forceinline__ void step(int s) {
    if (--to_hi == 0) {
      ++hi;
      to_hi = s;
    }
    if (--to_lo == 0) {
      ++lo;
      to_lo = s;
    }
  }
};

// One output position (V channels) per step: the max (and its window offset) or the mean.
template <bool kMax, int V, typename T, typename I>
__device__ __forceinline__ void forward(const PoolShape& s, const T* __restrict__ x,
                                        T* __restrict__ y, I* __restrict__ argmax) {
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
    if (kMax) store_offsets<V>(argmax, o, where);
    if (at.p + at.step >= total) break;
    at.next(s.OH, s.OW);
  }
}

// One run of input columns (V channels) per step: each column's gradient gathered from the
// outputs whose windows cover it, in order of oh, then ow (float sums round differently in
// another order). The covering outputs' rows are the run's; their columns move with the column
// (Cover::step): no division, and one 64-bit product per column (the first covering output's
// index), none per output.
template <bool kMax, int V, typename T, typename I>
__device__ __forceinline__ void backward(const PoolShape& s, const T* __restrict__ gy,
                                         const I* __restrict__ argmax, T* __restrict__ gx) {
  typedef typename Acc<T>::type A;
  const unsigned group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= (unsigned)(s.C / V)) return;
  const int c = (int)group * V;
  const int runs = (s.W - 1) / POOL_RUN + 1, len = (s.W - 1) / runs + 1;
  const long long total = (long long)s.N * s.H * runs;
  const unsigned first = blockIdx.y * blockDim.y + threadIdx.y;
  if (first >= total) return;
  const int ksy = s.kh / s.sy, kry = s.kh - ksy * s.sy;
  const int ksx = s.kw / s.sx, krx = s.kw - ksx * s.sx;
  const long long out_row = (long long)s.OW * s.C;
  Walk at(first, gridDim.y * blockDim.y, s.H, runs);
  while (true) {
    const int h = (int)at.row, w = (int)at.col * len;       // the run's first column
    const int count = min(len, s.W - w);
    const Cover cy(h + s.ph, s.kh, s.sy, ksy, kry);
    Cover cx(w + s.pw, s.kw, s.sx, ksx, krx);
    const int rows = min(cy.hi, s.OH - 1) - cy.lo + 1;
    // The window offset of (h, w) in output (cy.lo + r, cx.lo + q) is i * kw + j: its row
    // i = h + ph - cy.lo * sy - r * sy, first kh - cy.to_lo, in [0, kh) for r < rows; its column
    // j = w + pw - cx.lo * sx - q * sx, first kw - cx.to_lo. Each is formed only where it is used
    // (sy * kw < kh * kw where there is a second row), so no int overflows.
    const int i0 = rows > 0 ? (s.kh - cy.to_lo) * s.kw : 0, row_step = rows > 1 ? s.sy * s.kw : 0;
    // indices of gy/argmax at (cy.lo, 0) and of gx at (h, w)
    const long long o0 = ((long long)at.n * s.OH + cy.lo) * out_row + c;
    long long i = (((long long)at.n * s.H + h) * s.W + w) * s.C + c;
    // Not unrolled: the output loops run once or twice for a 3x3/2 window, and the remainder
    // loop NVRTC adds to a loop unrolled by 4 cost more set-up per row than the loop (SASS).
#pragma unroll 1
    for (int t = 0; t < count; ++t) {
      A sum[V];
      for (int k = 0; k < V; ++k) sum[k] = 0;
      const int cols = min(cx.hi, s.OW - 1) - cx.lo + 1;
      long long o_row = o0 + (long long)cx.lo * s.C;
      const int j0 = s.kw - cx.to_lo;
      int i_kw = i0;
#pragma unroll 1
      for (int r = 0; r < rows; ++r) {
        long long o = o_row;
        int offset = i_kw + j0;
#pragma unroll 1
        for (int q = 0; q < cols; ++q) {
          if constexpr (!kMax) {
            A v[V];
            load_v<V>(gy, o, v);
            for (int k = 0; k < V; ++k) sum[k] += v[k];
          } else {
            int am[V];
            load_offsets<V>(argmax, o, am);
            if constexpr (V == 1) {
              if (am[0] == offset) sum[0] += load(gy, o);
            } else if (am[0] == offset || am[1] == offset) {   // gy only where it is used
              A v[V];
              load_v<V>(gy, o, v);
              for (int k = 0; k < V; ++k)
                if (am[k] == offset) sum[k] += v[k];
            }
          }
          o += s.C;
          offset -= s.sx;
        }
        o_row += out_row;
        i_kw -= row_step;
      }
      if (!kMax)
        for (int k = 0; k < V; ++k) sum[k] = sum[k] / A(s.kh * s.kw);
      store_v<V>(gx, i, sum);
      i += s.C;
      cx.step(s.sx);
    }
    if (at.p + at.step >= total) break;
    at.next(s.H, runs);
  }
}

}  // namespace pool

template <typename T, typename I, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
max_pool_forward(const PoolShape s, const T* __restrict__ x, T* __restrict__ y,
                 I* __restrict__ argmax) {
  pool::forward<true, V>(s, x, y, argmax);
}

template <typename T, typename I, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
max_pool_backward(const PoolShape s, const T* __restrict__ gy, const I* __restrict__ argmax,
                  T* __restrict__ gx) {
  pool::backward<true, V>(s, gy, argmax, gx);
}

template <typename T, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
avg_pool_forward(const PoolShape s, const T* __restrict__ x, T* __restrict__ y) {
  pool::forward<false, V>(s, x, y, (unsigned char*)nullptr);
}

template <typename T, int V>
__global__ void __launch_bounds__(POOL_THREADS, POOL_MIN_BLOCKS)
avg_pool_backward(const PoolShape s, const T* __restrict__ gy, T* __restrict__ gx) {
  pool::backward<false, V>(s, gy, (const unsigned char*)nullptr, gx);
}

#define POOL_INSTANTIATE_MAX(T, I, V) \
  template __global__ void max_pool_forward<T, I, V>(const PoolShape, const T*, T*, I*); \
  template __global__ void max_pool_backward<T, I, V>(const PoolShape, const T*, const I*, T*);
#define POOL_INSTANTIATE_V(T, V) \
  POOL_INSTANTIATE_MAX(T, unsigned char, V) \
  POOL_INSTANTIATE_MAX(T, int, V) \
  template __global__ void avg_pool_forward<T, V>(const PoolShape, const T*, T*); \
  template __global__ void avg_pool_backward<T, V>(const PoolShape, const T*, T*);
#define POOL_INSTANTIATE(T) POOL_INSTANTIATE_V(T, 1) POOL_INSTANTIATE_V(T, 2)
POOL_INSTANTIATE(__half)
POOL_INSTANTIATE(float)
POOL_INSTANTIATE(double)
