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
//   bn_stats_partial<T,V>(x, rows, C, rows_per_block, partial)
//     grid (ceil(C / (V * BN_TILE_C)), ceil(rows / rows_per_block)), block (BN_TILE_C, BN_ROWS):
//     thread (tx, ty) of block (bx, by) owns channels c .. c + V - 1, c = V * (bx * BN_TILE_C + tx)
//     (none when c >= C), and rows r0 + ty, r0 + ty + BN_ROWS, ... < min(r0 + rows_per_block,
//     rows) with r0 = by * rows_per_block (any rows_per_block >= 1). The flat offset r * C + c is
//     formed once per thread and advanced by a pointer add of BN_ROWS * C per row (64-bit: no
//     multiplication, no division per element); rows are read BN_UNROLL (4) at a time, every
//     load issued before the arithmetic that waits for it. V = 2 (C even, x aligned to
//     2 * sizeof(T)): one __half2/float2/double2 load per two channels, each channel computed
//     exactly as with V = 1 (the same operations in the same order: bitwise the same partial).
//     partial[(by * C + c) * 3 + {0,1,2}] = (count, mean, M2) of channel c over the rows of row
//     block by: shifted sums per thread (below), merged across the block's BN_ROWS threads with
//     Chan's formula. Writes only partial.
//     Shifted sums: a thread takes its first value K of a channel as the shift and accumulates
//     s1 = sum (v - K) and s2 = sum (v - K)^2 (one fma) in the acc type; at the end n = its row
//     count, mean = K + s1 / n, M2 = s2 - s1 * (s1 / n) (one fma, a negative residue clamped to 0).
//     One division per thread and channel instead of Welford's per element (an IEEE division is
//     a multi-instruction sequence, with a slow-path branch, in the dependent chain of every
//     element). Accuracy: this is the shifted-data algorithm; its cancellation in M2 is governed
//     by s2 / M2 = 1 + n (mean - K)^2 / M2, the distance of the shift from the mean relative to
//     the spread. K is one of the thread's own values, so (K - mean)^2 <= M2 and s2 <= (n + 1) M2
//     whatever the data's offset (1000 + N(0, 1), float16 near 60000), and typically
//     s2 ~ 2 M2 (K is a typical sample). v - K is exact where v and K are within a factor 2
//     (Sterbenz): an offset costs nothing there. Each thread sums its n =
//     ceil(rows_per_block / BN_ROWS) values by recursive summation: at least 4, and about
//     rows * ceil(C / 64) / 8192 for large inputs (the callers aim at 1024 blocks: n = 392 for
//     ResNet-50's first BN layers at batch 256, 256 * 112 * 112 rows of 64 channels). M2 errs by
//     at most ~3 n u s2 (u the acc type's unit roundoff: 7e-5 of s2 in float32 at n = 392, the
//     worst case; random roundings give ~sqrt(n) u); the tests hold the kernel to this bound
//     against float64 at n = 500 and 5. NaN and inf
//     propagate as with Welford: a NaN or inf value makes v - K (and K - K when it is K itself)
//     NaN or inf, so s2 - s1 * (s1 / n) is NaN: the channel's M2, hence var and invstd, are NaN
//     and its mean NaN or +-inf, through every merge.
//   bn_stats_finalize<P>(partial, blocks, C, rows, eps, decay, update, running_mean, running_var,
//                        mean, invstd, summary)
//     grid ceil(C/BN_TILE_C), block (BN_TILE_C, BN_FINAL_ROWS): the BN_FINAL_ROWS threads of a
//     channel each merge every BN_FINAL_ROWS-th row block's summary, then thread y = 0 merges
//     theirs (a short serial chain: one thread per channel walking 512 summaries one after
//     another took 0.25 ms on an H100 for C = 64, more than the statistics pass):
//     mean[c], invstd[c] (float buffers of the acc type); when update != 0 also
//     running_mean = decay * running_mean + (1 - decay) * mean and
//     running_var = decay * running_var + (1 - decay) * var * rows / max(rows - 1, 1), as Chainer.
//     The summaries may be any (count, mean, M2) triples whose counts add up to rows: the row
//     blocks of bn_stats_partial, or one summary per rank in chainer_tc.multinode; up to
//     BN_FINAL_ROWS of them are merged in their order (thread y takes summary y), more in the
//     fixed order above. Empty summaries (count 0) are skipped.
//     summary (may be null): when given, the merged (count, mean, M2) of channel c goes to
//     summary[c * 3 + {0,1,2}] and nothing else is written (rows, eps, decay, update and the other
//     pointers are not read; pass update = 0): the one summary per channel of a rank's rows
//     that chainer_tc.multinode gathers from every rank into (ranks, C, 3), to launch this
//     kernel again over them with blocks = ranks, rows = the global count, summary = null. On
//     one rank that second launch gives the bits of a launch over the rank's row blocks: the
//     first merge into the empty summary copies it exactly.
//   bn_apply<T,P,V>(x, z, gamma, beta, mean, invstd, y, rows, C, relu)
//     2-D: thread x of block column blockIdx.x owns channels V*g .. V*g + V - 1 with
//     g = blockIdx.x * blockDim.x + threadIdx.x < C / V (its gamma, beta, mean, invstd stay in
//     registers); threadIdx.y + blockIdx.y * blockDim.y is its first row, and it strides over rows
//     by gridDim.y * blockDim.y (any grid.y; grid.x * blockDim.x >= C / V; block at most
//     BN_THREADS threads). The flat offset row * C + c is formed once and advanced by an add: no
//     division. V = 2 (C even, x/z/y aligned to 2 * sizeof(T)): one __half2/float2/double2 access
//     per two channels, the same values as V = 1. Writes y only.
//   bn_backward_partial<T,V>(gy, y, x, mean, invstd, rows, C, rows_per_block, relu, partial)
//     launched and walking rows as bn_stats_partial (V = 2 needs gy, x, and y when relu,
//     aligned; y is not read, and may be null, when relu == 0):
//     partial[(by * C + c) * 2 + {0,1}] = (sum g, sum g * xhat) with
//     g = gy masked by y > 0 when relu, xhat = (x - mean) * invstd.
//   bn_backward_finalize<P>(partial, blocks, C, sums, ggamma, gbeta)
//     launched as bn_stats_finalize, the row blocks' sums added the same way:
//     sums[c] = sum g, sums[C + c] = sum g * xhat (acc type); gbeta = sums[c], ggamma = sums[C + c].
//   bn_backward_apply<T,P,V>(gy, y, x, gamma, mean, invstd, sums, rows, count, C, relu, gx, gz)
//     gx = gamma * invstd * (g - (xhat * sum(g xhat) + sum(g)) / count);  gz = g (gz may be
//     null). rows: the rows of gy, y, x, gx, gz; count: the rows the statistics and the sums
//     were taken over (rows for one process; the global count when sums are summed over the
//     ranks of chainer_tc.multinode). A count argument instead of sums scaled by rows / count:
//     scaling would add a rounding to every sum, and with count == rows the launch computes
//     the bits it computed before the argument existed.
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
#ifndef BN_UNROLL
#define BN_UNROLL 4
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

// The merge for a thread's V channels, which share their count: each channel's (mean, m2) exactly
// as the one-channel merge above computes it.
template <typename A, int V>
__device__ __forceinline__ void merge(A& n, A (&mean)[V], A (&m2)[V], A nb, const A* meanb,
                                      const A* m2b) {
  A total = n;
  for (int j = 0; j < V; ++j) {
    total = n;
    merge(total, mean[j], m2[j], nb, meanb[j], m2b[j]);
  }
  n = total;
}

// Blocks per SM the partial kernels ask ptxas for (their __launch_bounds__): with none, NVRTC
// 12.9's ptxas aimed at 32-48 registers and spilled 8 bytes in the double2 backward, whose
// BN_UNROLL rows of three double2 loads in flight take 48 registers; 6 blocks (at most 40
// registers) compile half and float without spills, 4 (64 registers) double.
template <typename T>
__host__ __device__ constexpr int min_blocks() { return sizeof(T) == 8 ? 4 : 6; }

__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }

// One value v into the shifted sums of its channel: s1 += v - k, s2 += (v - k)^2 (one rounding).
template <typename A>
__device__ __forceinline__ void shifted_add(A v, A k, A& s1, A& s2) {
  const A d = v - k;
  s1 += d;
  s2 = fma_rn(d, d, s2);
}

// The backward sums of V channels over `count` rows, `step` elements apart, the first at gy, y, x
// (y read only when RELU): sum_g += g, sum_gx += g * xhat with g = gy, or 0 where the ReLU mask
// drops it (not y > 0). BN_UNROLL rows at a time, their loads issued before the arithmetic that
// waits for them; the rows are added in order either way. RELU is a template parameter so that
// the loop has no branch on it.
template <bool RELU, int V, typename T, typename A>
__device__ __forceinline__ void backward_rows(const T* __restrict__ gy, const T* __restrict__ y,
                                              const T* __restrict__ x, const A* __restrict__ mean,
                                              const A* __restrict__ invstd, long long step,
                                              long long count, A (&sum_g)[V],
                                              A (&sum_gx)[V]) {
  constexpr int U = BN_UNROLL;
  A m[V], s[V];
  for (int j = 0; j < V; ++j) {
    m[j] = mean[j];
    s[j] = invstd[j];
  }
#pragma unroll 1
  for (; count >= U; count -= U) {
    A g[U][V], yv[U][V], xv[U][V];
    for (int u = 0; u < U; ++u) {
      load_v<V>(gy, u * step, g[u]);
      if (RELU) load_v<V>(y, u * step, yv[u]);
      load_v<V>(x, u * step, xv[u]);
    }
    for (int u = 0; u < U; ++u) {
      for (int j = 0; j < V; ++j) {
        if (RELU && !(yv[u][j] > A(0))) g[u][j] = A(0);
        sum_g[j] += g[u][j];
        sum_gx[j] += g[u][j] * ((xv[u][j] - m[j]) * s[j]);
      }
    }
    gy += U * step;
    if (RELU) y += U * step;
    x += U * step;
  }
#pragma unroll 1
  for (; count > 0; --count) {
    A g[V], yv[V], xv[V];
    load_v<V>(gy, 0, g);
    if (RELU) load_v<V>(y, 0, yv);
    load_v<V>(x, 0, xv);
    for (int j = 0; j < V; ++j) {
      if (RELU && !(yv[j] > A(0))) g[j] = A(0);
      sum_g[j] += g[j];
      sum_gx[j] += g[j] * ((xv[j] - m[j]) * s[j]);
    }
    gy += step;
    if (RELU) y += step;
    x += step;
  }
}

// (count n > 0, mean, M2) of n values from their shifted sums s1 = sum (v - k), s2 = sum (v - k)^2:
// mean = k + s1 / n, M2 = s2 - s1 * (s1 / n) (one rounding: fma). M2 >= 0 exactly; a negative
// rounding residue is clamped to 0 (a NaN stays NaN: the comparison is false).
template <typename A>
__device__ __forceinline__ void shifted_to_summary(A n, A k, A s1, A s2, A& mean, A& m2) {
  const A d = s1 / n;
  mean = k + d;
  m2 = fma_rn(-s1, d, s2);
  if (m2 < A(0)) m2 = A(0);
}

}  // namespace bn

template <typename T, int V>
__global__ void __launch_bounds__(BN_TILE_C * BN_ROWS, bn::min_blocks<T>())
bn_stats_partial(const T* __restrict__ x, long long rows, int C, long long rows_per_block,
                 typename bn::Acc<T>::type* __restrict__ partial) {
  typedef typename bn::Acc<T>::type A;
  __shared__ A sn[BN_ROWS][BN_TILE_C], smean[BN_ROWS][BN_TILE_C * V], sm2[BN_ROWS][BN_TILE_C * V];
  const int c = (int)(blockIdx.x * BN_TILE_C + threadIdx.x) * V;
  const long long first = (long long)blockIdx.y * rows_per_block + threadIdx.y;   // its first row
  const long long r1 = min((long long)blockIdx.y * rows_per_block + rows_per_block, rows);
  A n = 0, mean[V], m2[V];
  for (int j = 0; j < V; ++j) mean[j] = m2[j] = A(0);
  if (c < C && first < r1) {
    // Shifted sums (header comment: why they are accurate): K = the thread's first value of each
    // channel.
    A k[V], s1[V], s2[V];
    const long long step = (long long)BN_ROWS * C, after = (r1 - 1 - first) / BN_ROWS;
    const T* p = x + (first * C + c);     // advanced by a row step: no multiplication per row
    bn::load_v<V>(p, 0, k);
    for (int j = 0; j < V; ++j) s1[j] = s2[j] = A(0);
    constexpr int U = BN_UNROLL;
    long long left = after;                // rows still to read, U at a time (loads first)
#pragma unroll 1
    for (; left >= U; left -= U) {
      A v[U][V];
      for (int u = 0; u < U; ++u) bn::load_v<V>(p, (u + 1) * step, v[u]);
      for (int u = 0; u < U; ++u)
        for (int j = 0; j < V; ++j) bn::shifted_add(v[u][j], k[j], s1[j], s2[j]);
      p += U * step;
    }
#pragma unroll 1
    for (; left > 0; --left) {
      A v[V];
      p += step;
      bn::load_v<V>(p, 0, v);
      for (int j = 0; j < V; ++j) bn::shifted_add(v[j], k[j], s1[j], s2[j]);
    }
    // K's own term, added last so that the first rows' loads need not wait for K: K - K is 0, or
    // NaN when K is NaN or inf, which then poisons both sums as it poisoned Welford's update
    for (int j = 0; j < V; ++j) bn::shifted_add(k[j], k[j], s1[j], s2[j]);
    n = A(after + 1);
    for (int j = 0; j < V; ++j) bn::shifted_to_summary(n, k[j], s1[j], s2[j], mean[j], m2[j]);
  }
  sn[threadIdx.y][threadIdx.x] = n;
  for (int j = 0; j < V; ++j) {
    smean[threadIdx.y][threadIdx.x * V + j] = mean[j];
    sm2[threadIdx.y][threadIdx.x * V + j] = m2[j];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < BN_ROWS; ++k)
      bn::merge(n, mean, m2, sn[k][threadIdx.x], smean[k] + threadIdx.x * V,
                sm2[k] + threadIdx.x * V);
    for (int j = 0; j < V; ++j) {
      A* out = partial + ((long long)blockIdx.y * C + c + j) * 3;
      out[0] = n;
      out[1] = mean[j];
      out[2] = m2[j];
    }
  }
}

template <typename P>
__global__ void __launch_bounds__(BN_TILE_C * BN_FINAL_ROWS)
bn_stats_finalize(const typename bn::Acc<P>::type* __restrict__ partial, int blocks, int C,
                  long long rows, double eps, double decay, int update, P* running_mean,
                  P* running_var, typename bn::Acc<P>::type* __restrict__ mean_out,
                  typename bn::Acc<P>::type* __restrict__ invstd_out,
                  typename bn::Acc<P>::type* __restrict__ summary) {
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
    if (summary) {                         // the rank's summary, for the other ranks
      A* out = summary + (long long)c * 3;
      out[0] = n;
      out[1] = mean;
      out[2] = m2;
      return;
    }
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

template <typename T, int V>
__global__ void __launch_bounds__(BN_TILE_C * BN_ROWS, bn::min_blocks<T>())
bn_backward_partial(const T* __restrict__ gy, const T* __restrict__ y, const T* __restrict__ x,
                    const typename bn::Acc<T>::type* __restrict__ mean,
                    const typename bn::Acc<T>::type* __restrict__ invstd, long long rows, int C,
                    long long rows_per_block, int relu,
                    typename bn::Acc<T>::type* __restrict__ partial) {
  typedef typename bn::Acc<T>::type A;
  __shared__ A sg[BN_ROWS][BN_TILE_C * V], sgx[BN_ROWS][BN_TILE_C * V];
  const int c = (int)(blockIdx.x * BN_TILE_C + threadIdx.x) * V;
  const long long first = (long long)blockIdx.y * rows_per_block + threadIdx.y;
  const long long r1 = min((long long)blockIdx.y * rows_per_block + rows_per_block, rows);
  A sum_g[V], sum_gx[V];
  for (int j = 0; j < V; ++j) sum_g[j] = sum_gx[j] = A(0);
  if (c < C && first < r1) {
    const long long i = first * C + c, rows_here = (r1 - 1 - first) / BN_ROWS + 1;
    if (relu)
      bn::backward_rows<true, V>(gy + i, y + i, x + i, mean + c, invstd + c,
                                 (long long)BN_ROWS * C, rows_here, sum_g, sum_gx);
    else                                   // y is not read (and may be null)
      bn::backward_rows<false, V>(gy + i, y, x + i, mean + c, invstd + c,
                                  (long long)BN_ROWS * C, rows_here, sum_g, sum_gx);
  }
  for (int j = 0; j < V; ++j) {
    sg[threadIdx.y][threadIdx.x * V + j] = sum_g[j];
    sgx[threadIdx.y][threadIdx.x * V + j] = sum_gx[j];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int k = 1; k < BN_ROWS; ++k) {
      for (int j = 0; j < V; ++j) {
        sum_g[j] += sg[k][threadIdx.x * V + j];
        sum_gx[j] += sgx[k][threadIdx.x * V + j];
      }
    }
    for (int j = 0; j < V; ++j) {
      A* out = partial + ((long long)blockIdx.y * C + c + j) * 2;
      out[0] = sum_g[j];
      out[1] = sum_gx[j];
    }
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
                  const typename bn::Acc<T>::type* __restrict__ sums, long long rows,
                  long long count, int C, int relu, T* __restrict__ gx, T* __restrict__ gz) {
  typedef typename bn::Acc<T>::type A;
  const unsigned group = blockIdx.x * blockDim.x + threadIdx.x;
  if (group >= (unsigned)(C / V)) return;
  const int c = (int)group * V;
  const A inv_m = A(1) / A(count);
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
#define BN_DATA_V(T, V) \
  template __global__ void bn_stats_partial<T, V>(const T*, long long, int, long long, \
      bn::Acc<T>::type*); \
  template __global__ void bn_backward_partial<T, V>(const T*, const T*, const T*, \
      const bn::Acc<T>::type*, const bn::Acc<T>::type*, long long, int, long long, int, \
      bn::Acc<T>::type*);
#define BN_DATA(T) BN_DATA_V(T, 1) BN_DATA_V(T, 2)
#define BN_PARAM(P) \
  template __global__ void bn_stats_finalize<P>(const bn::Acc<P>::type*, int, int, long long, double, \
      double, int, P*, P*, bn::Acc<P>::type*, bn::Acc<P>::type*, bn::Acc<P>::type*); \
  template __global__ void bn_backward_finalize<P>(const bn::Acc<P>::type*, int, int, bn::Acc<P>::type*, \
      P*, P*);
#define BN_PAIR_V(T, P, V) \
  template __global__ void bn_apply<T, P, V>(const T*, const T*, const P*, const P*, \
      const bn::Acc<T>::type*, const bn::Acc<T>::type*, T*, long long, int, int); \
  template __global__ void bn_backward_apply<T, P, V>(const T*, const T*, const T*, const P*, \
      const bn::Acc<T>::type*, const bn::Acc<T>::type*, const bn::Acc<T>::type*, long long, \
      long long, int, int, T*, T*);
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
