// kernels/batchnorm.cu: BatchNormalization (+ residual Add + ReLU) over channels-last data.
//
// x, z, y, gy, gx, gz are (rows, C) row-major: NHWC with rows = N*H*W, C innermost. Computes
//   training:  y = act(gamma * (x - mean) * invstd + beta + z),  mean/var over the rows (biased var)
//   act = ReLU when relu != 0 (max(v, 0): NaN stays NaN, as Chainer's relu), identity otherwise; z may be null.
// Types: T (data) and P (gamma, beta, running statistics) in (half, half), (half, float),
// (float, float), (double, double); statistics and reductions accumulate in float (double for
// double data). invstd = 1 / sqrt(var + eps), correctly rounded as NumPy computes it.
//
// Kernels and their launch shapes (templates; the loader names them as name_expressions, e.g.
// "bn_apply<__half, float, 2>"):
//   bn_stats_partial<T>(x, rows, C, rows_per_block, partial)
//     grid (ceil(C/BN_TILE_C), ceil(rows/rows_per_block)), block (BN_TILE_C, BN_ROWS).
//     partial[(by * C + c) * 3 + {0,1,2}] = (count, mean, M2) of channel c over the rows of row
//     block by (Welford per thread, merged with Chan's formula). Writes only partial.
//   bn_stats_finalize<P>(partial, blocks, C, rows, eps, decay, update, running_mean, running_var,
//                        mean, invstd)
//     grid ceil(C/BN_TILE_C), block (BN_TILE_C, BN_FINAL_ROWS): the BN_FINAL_ROWS threads of a
//     channel each merge every BN_FINAL_ROWS-th row block's summary, then thread y = 0 merges
//     theirs (a short serial chain: one thread per channel walking 512 summaries one after
//     another took 0.25 ms on an H100 for C = 64, more than the statistics pass):
//     mean[c], invstd[c] (float buffers of the acc type); when update != 0 also
//     running_mean = decay * running_mean + (1 - decay) * mean and
//     running_var = decay * running_var + (1 - decay) * var * rows / max(rows - 1, 1), as Chainer.
//   bn_apply<T,P,V>(x, z, gamma, beta, mean, invstd, y, rows, C, relu)
//     2-D: thread x of block column blockIdx.x owns channels V*g .. V*g + V - 1 with
//     g = blockIdx.x * blockDim.x + threadIdx.x < C / V (its gamma, beta, mean, invstd stay in
//     registers); threadIdx.y + blockIdx.y * blockDim.y is its first row, and it strides over rows
//     by gridDim.y * blockDim.y (any grid.y; grid.x * blockDim.x >= C / V; block at most
//     BN_THREADS threads). The flat offset row * C + c is formed once and advanced by an add: no
//     division. V = 2 (C even, x/z/y aligned to 2 * sizeof(T)): one __half2/float2/double2 access
//     per two channels, the same values as V = 1. Writes y only.
//   bn_backward_partial<T>(gy, y, x, mean, invstd, rows, C, rows_per_block, relu, partial)
//     like bn_stats_partial: partial[(by * C + c) * 2 + {0,1}] = (sum g, sum g * xhat) with
//     g = gy masked by y > 0 when relu, xhat = (x - mean) * invstd.
//   bn_backward_finalize<P>(partial, blocks, C, sums, ggamma, gbeta)
//     launched as bn_stats_finalize, the row blocks' sums added the same way:
//     sums[c] = sum g, sums[C + c] = sum g * xhat (acc type); gbeta = sums[c], ggamma = sums[C + c].
//   bn_backward_apply<T,P,V>(gy, y, x, gamma, mean, invstd, sums, rows, C, relu, gx, gz)
//     gx = gamma * invstd * (g - (xhat * sum(g xhat) + sum(g)) / rows);  gz = g (gz may be null).
//     Launched as bn_apply (V = 2 needs gy, y, x, gx, gz aligned). Writes gx and gz only.
#include "dtype.cuh"

#ifndef BN_TILE_C
#define BN_TILE_C 32
#endif
#ifndef BN_ROWS
#define BN_ROWS 8
#endif
#ifndef BN_THREADS
#define BN_THREADS 256
#endif
#ifndef BN_FINAL_ROWS
#define BN_FINAL_ROWS 16
#endif

namespace bn {

using ctc::Acc;
using ctc::load;
using ctc::load_v;
using ctc::store;
using ctc::store_v;

__device__ __forceinline__ float inv_sqrt(float v) { return __frcp_rn(__fsqrt_rn(v)); }
__device__ __forceinline__ double inv_sqrt(double v) { return 1.0 / sqrt(v); }

// Chan et al.'s merge of two (count, mean, M2) summaries into the first.
template <typename A>
__device__ __forceinline__ void merge(A& n, A& mean, A& m2, A nb, A meanb, A m2b) {
  if (nb == A(0)) return;
  const A total = n + nb;
  const A delta = meanb - mean;
  mean += delta * (nb / total);
  m2 += m2b + delta * delta * (n * nb / total);
  n = total;
}

}  // namespace bn

template <typename T>
__global__ void __launch_bounds__(BN_TILE_C * BN_ROWS)
bn_stats_partial(const T* __restrict__ x, long long rows, int C, long long rows_per_block,
                 typename bn::Acc<T>::type* __restrict__ partial) {
  typedef typename bn::Acc<T>::type A;
  __shared__ A sn[BN_ROWS][BN_TILE_C], smean[BN_ROWS][BN_TILE_C], sm2[BN_ROWS][BN_TILE_C];
  const int c = blockIdx.x * BN_TILE_C + threadIdx.x;
  const long long r0 = (long long)blockIdx.y * rows_per_block;
  const long long r1 = min(r0 + rows_per_block, rows);
  A n = 0, mean = 0, m2 = 0;
  if (c < C) {
    for (long long r = r0 + threadIdx.y; r < r1; r += BN_ROWS) {   // Welford
      const A v = bn::load(x, r * C + c);
      n += A(1);
      const A d = v - mean;
      mean += d / n;
      m2 += d * (v - mean);
    }
  }
  sn[threadIdx.y][threadIdx.x] = n;
  smean[threadIdx.y][threadIdx.x] = mean;
  sm2[threadIdx.y][threadIdx.x] = m2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < BN_ROWS; ++k)
      bn::merge(n, mean, m2, sn[k][threadIdx.x], smean[k][threadIdx.x], sm2[k][threadIdx.x]);
    A* out = partial + ((long long)blockIdx.y * C + c) * 3;
    out[0] = n;
    out[1] = mean;
    out[2] = m2;
  }
}

template <typename P>
__global__ void __launch_bounds__(BN_TILE_C * BN_FINAL_ROWS)
bn_stats_finalize(const typename bn::Acc<P>::type* __restrict__ partial, int blocks, int C,
                  long long rows, double eps, double decay, int update, P* running_mean,
                  P* running_var, typename bn::Acc<P>::type* __restrict__ mean_out,
                  typename bn::Acc<P>::type* __restrict__ invstd_out) {
  typedef typename bn::Acc<P>::type A;
  __shared__ A sn[BN_FINAL_ROWS][BN_TILE_C], smean[BN_FINAL_ROWS][BN_TILE_C],
      sm2[BN_FINAL_ROWS][BN_TILE_C];
  const int c = blockIdx.x * BN_TILE_C + threadIdx.x;
  A n = 0, mean = 0, m2 = 0;
  if (c < C) {
    for (int b = threadIdx.y; b < blocks; b += BN_FINAL_ROWS) {
      const A* p = partial + ((long long)b * C + c) * 3;
      bn::merge(n, mean, m2, p[0], p[1], p[2]);
    }
  }
  sn[threadIdx.y][threadIdx.x] = n;
  smean[threadIdx.y][threadIdx.x] = mean;
  sm2[threadIdx.y][threadIdx.x] = m2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < BN_FINAL_ROWS; ++k)
      bn::merge(n, mean, m2, sn[k][threadIdx.x], smean[k][threadIdx.x], sm2[k][threadIdx.x]);
    const A var = m2 / A(rows);
    mean_out[c] = mean;
    invstd_out[c] = bn::inv_sqrt(var + A(eps));
    if (update) {
      const A d = A(decay), adjust = A(rows) / A(rows > 1 ? rows - 1 : 1);
      bn::store(running_mean, c, bn::load(running_mean, c) * d + (A(1) - d) * mean);
      bn::store(running_var, c, bn::load(running_var, c) * d + (A(1) - d) * adjust * var);
    }
  }
}

template <typename T, typename P, int V>
__global__ void __launch_bounds__(BN_THREADS)
bn_apply(const T* __restrict__ x, const T* __restrict__ z, const P* __restrict__ gamma,
         const P* __restrict__ beta, const typename bn::Acc<T>::type* __restrict__ mean,
         const typename bn::Acc<T>::type* __restrict__ invstd, T* __restrict__ y, long long rows,
         int C, int relu) {
  typedef typename bn::Acc<T>::type A;
  const unsigned group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= (unsigned)(C / V)) return;
  const int c = (int)group * V;
  A g[V], b[V], m[V], s[V];
  for (int k = 0; k < V; ++k) {
    g[k] = A(bn::load(gamma, c + k));
    b[k] = A(bn::load(beta, c + k));
    m[k] = mean[c + k];
    s[k] = invstd[c + k];
  }
  const long long n = rows * C, step = (long long)(gridDim.y * blockDim.y) * C;
  for (long long i = (long long)(blockIdx.y * blockDim.y + threadIdx.y) * C + c; i < n; i += step) {
    A v[V], w[V];
    bn::load_v<V>(x, i, v);
    if (z) bn::load_v<V>(z, i, w);
    for (int k = 0; k < V; ++k) {
      v[k] = g[k] * ((v[k] - m[k]) * s[k]) + b[k];
      if (z) v[k] += w[k];
      if (relu && v[k] < A(0)) v[k] = A(0);   // max(v, 0) as NumPy and Chainer: NaN stays NaN
    }
    bn::store_v<V>(y, i, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(BN_TILE_C * BN_ROWS)
bn_backward_partial(const T* __restrict__ gy, const T* __restrict__ y, const T* __restrict__ x,
                    const typename bn::Acc<T>::type* __restrict__ mean,
                    const typename bn::Acc<T>::type* __restrict__ invstd, long long rows, int C,
                    long long rows_per_block, int relu,
                    typename bn::Acc<T>::type* __restrict__ partial) {
  typedef typename bn::Acc<T>::type A;
  __shared__ A sg[BN_ROWS][BN_TILE_C], sgx[BN_ROWS][BN_TILE_C];
  const int c = blockIdx.x * BN_TILE_C + threadIdx.x;
  const long long r0 = (long long)blockIdx.y * rows_per_block;
  const long long r1 = min(r0 + rows_per_block, rows);
  A sum_g = 0, sum_gx = 0;
  if (c < C) {
    const A m = mean[c], s = invstd[c];
    for (long long r = r0 + threadIdx.y; r < r1; r += BN_ROWS) {
      const long long i = r * C + c;
      A g = bn::load(gy, i);
      if (relu && !(A(bn::load(y, i)) > A(0))) g = A(0);
      sum_g += g;
      sum_gx += g * ((A(bn::load(x, i)) - m) * s);
    }
  }
  sg[threadIdx.y][threadIdx.x] = sum_g;
  sgx[threadIdx.y][threadIdx.x] = sum_gx;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < BN_ROWS; ++k) {
      sum_g += sg[k][threadIdx.x];
      sum_gx += sgx[k][threadIdx.x];
    }
    A* out = partial + ((long long)blockIdx.y * C + c) * 2;
    out[0] = sum_g;
    out[1] = sum_gx;
  }
}

template <typename P>
__global__ void __launch_bounds__(BN_TILE_C * BN_FINAL_ROWS)
bn_backward_finalize(const typename bn::Acc<P>::type* __restrict__ partial, int blocks, int C,
                     typename bn::Acc<P>::type* __restrict__ sums, P* __restrict__ ggamma,
                     P* __restrict__ gbeta) {
  typedef typename bn::Acc<P>::type A;
  __shared__ A sg[BN_FINAL_ROWS][BN_TILE_C], sgx[BN_FINAL_ROWS][BN_TILE_C];
  const int c = blockIdx.x * BN_TILE_C + threadIdx.x;
  A sum_g = 0, sum_gx = 0;
  if (c < C) {
    for (int b = threadIdx.y; b < blocks; b += BN_FINAL_ROWS) {
      sum_g += partial[((long long)b * C + c) * 2];
      sum_gx += partial[((long long)b * C + c) * 2 + 1];
    }
  }
  sg[threadIdx.y][threadIdx.x] = sum_g;
  sgx[threadIdx.y][threadIdx.x] = sum_gx;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < BN_FINAL_ROWS; ++k) {
      sum_g += sg[k][threadIdx.x];
      sum_gx += sgx[k][threadIdx.x];
    }
    sums[c] = sum_g;
    sums[C + c] = sum_gx;
    bn::store(gbeta, c, sum_g);
    bn::store(ggamma, c, sum_gx);
  }
}

template <typename T, typename P, int V>
__global__ void __launch_bounds__(BN_THREADS)
bn_backward_apply(const T* __restrict__ gy, const T* __restrict__ y, const T* __restrict__ x,
                  const P* __restrict__ gamma, const typename bn::Acc<T>::type* __restrict__ mean,
                  const typename bn::Acc<T>::type* __restrict__ invstd,
                  const typename bn::Acc<T>::type* __restrict__ sums, long long rows, int C,
                  int relu, T* __restrict__ gx, T* __restrict__ gz) {
  typedef typename bn::Acc<T>::type A;
  const unsigned group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= (unsigned)(C / V)) return;
  const int c = (int)group * V;
  const A inv_m = A(1) / A(rows);
  A gam[V], m[V], s[V], sum_g[V], sum_gx[V];
  for (int k = 0; k < V; ++k) {
    gam[k] = A(bn::load(gamma, c + k));
    m[k] = mean[c + k];
    s[k] = invstd[c + k];
    sum_g[k] = sums[c + k];
    sum_gx[k] = sums[C + c + k];
  }
  const long long n = rows * C, step = (long long)(gridDim.y * blockDim.y) * C;
  for (long long i = (long long)(blockIdx.y * blockDim.y + threadIdx.y) * C + c; i < n; i += step) {
    A g[V], yv[V], xv[V], out[V];
    bn::load_v<V>(gy, i, g);
    if (relu) bn::load_v<V>(y, i, yv);
    bn::load_v<V>(x, i, xv);
    for (int k = 0; k < V; ++k) {
      if (relu && !(yv[k] > A(0))) g[k] = A(0);
      const A xhat = (xv[k] - m[k]) * s[k];
      out[k] = gam[k] * s[k] * (g[k] - (xhat * sum_gx[k] + sum_g[k]) * inv_m);
    }
    bn::store_v<V>(gx, i, out);
    if (gz) bn::store_v<V>(gz, i, g);
  }
}

// The instantiations the loader asks for (and the compile check sees).
#define BN_DATA(T) \
  template __global__ void bn_stats_partial<T>(const T*, long long, int, long long, bn::Acc<T>::type*); \
  template __global__ void bn_backward_partial<T>(const T*, const T*, const T*, const bn::Acc<T>::type*, \
      const bn::Acc<T>::type*, long long, int, long long, int, bn::Acc<T>::type*);
#define BN_PARAM(P) \
  template __global__ void bn_stats_finalize<P>(const bn::Acc<P>::type*, int, int, long long, double, \
      double, int, P*, P*, bn::Acc<P>::type*, bn::Acc<P>::type*); \
  template __global__ void bn_backward_finalize<P>(const bn::Acc<P>::type*, int, int, bn::Acc<P>::type*, \
      P*, P*);
#define BN_PAIR_V(T, P, V) \
  template __global__ void bn_apply<T, P, V>(const T*, const T*, const P*, const P*, \
      const bn::Acc<T>::type*, const bn::Acc<T>::type*, T*, long long, int, int); \
  template __global__ void bn_backward_apply<T, P, V>(const T*, const T*, const T*, const P*, \
      const bn::Acc<T>::type*, const bn::Acc<T>::type*, const bn::Acc<T>::type*, long long, int, int, \
      T*, T*);
#define BN_PAIR(T, P) BN_PAIR_V(T, P, 1) BN_PAIR_V(T, P, 2)
BN_DATA(__half)
BN_DATA(float)
BN_DATA(double)
BN_PARAM(__half)
BN_PARAM(float)
BN_PARAM(double)
BN_PAIR(__half, __half)
BN_PAIR(__half, float)
BN_PAIR(float, float)
BN_PAIR(double, double)
