// Small kernels that exercise the CPU CUDA emulator (tests/test_emulator.py), each written as it
// would be for a GPU. Every one is also compiled by NVRTC in the tests, so they stay valid CUDA.
#include <cuda_fp16.h>

// c[i] = a[i] + b[i], grid-stride loop.
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    c[i] = a[i] + b[i];
}

// out[block] = sum of the block's grid-stride partial sums, tree reduction in dynamic shared memory.
extern "C" __global__ void block_sum(const double* x, double* out, int n) {
  extern __shared__ double partial[];
  double v = 0.0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) v += x[i];
  partial[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

// out[block] = sum over the block, by warp shuffles; the second stage runs in warp 0 only.
extern "C" __global__ void warp_sum(const int* x, int* out, int n) {
  __shared__ int per_warp[32];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int v = i < n ? x[i] : 0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)((blockDim.x + 31) / 32) ? per_warp[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) out[blockIdx.x] = v;
  }
}

// Inclusive prefix sum within each warp (shfl_up), and each lane's value broadcast from lane 0 of
// its group of `width` (shfl with width).
extern "C" __global__ void warp_scan(const int* x, int* scan, int* bcast, int width, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int v = i < n ? x[i] : 0;
  const int lane = threadIdx.x % 32;
  for (int d = 1; d < 32; d <<= 1) {
    int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  int b = __shfl_sync(0xffffffffu, i < n ? x[i] : 0, 0, width);
  if (i < n) { scan[i] = v; bcast[i] = b; }
}

// Votes: per warp, the ballot of x[i] > 0, whether any / all are.
extern "C" __global__ void warp_votes(const float* x, unsigned* ballot, int* any, int* all, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int p = i < n && x[i] > 0.0f;
  unsigned b = __ballot_sync(0xffffffffu, p);
  int a = __any_sync(0xffffffffu, p), l = __all_sync(0xffffffffu, p);
  if (threadIdx.x % 32 == 0) {
    int w = i / 32;
    ballot[w] = b; any[w] = a; all[w] = l;
  }
}

// Atomics: a histogram of x into `bins` bins, the global max, and a count of negative values.
extern "C" __global__ void atomics(const int* x, unsigned* hist, int* max_out, unsigned long long* neg,
                                   float* fsum, int bins, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    int v = x[i];
    atomicAdd(&hist[((v % bins) + bins) % bins], 1u);
    atomicMax(max_out, v);
    if (v < 0) atomicAdd(neg, 1ull);
    atomicAdd(fsum, (float)v);
  }
}

// A spin lock with atomicCAS/atomicExch guarding a non-atomic update; one thread per block takes it.
extern "C" __global__ void cas_lock(int* lock, int* counter) {
  if (threadIdx.x == 0) {
    while (atomicCAS(lock, 0, 1) != 0) {}
    *counter += 1;
    atomicExch(lock, 0);
  }
}

// half2 arithmetic: out = a * b + c, elementwise in pairs, and the float sum of each pair.
extern "C" __global__ void half2_fma(const __half2* a, const __half2* b, const __half2* c,
                                     __half2* out, float* pair_sum, int npairs) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < npairs) {
    __half2 r = __hfma2(a[i], b[i], c[i]);
    out[i] = r;
    pair_sum[i] = __low2float(r) + __high2float(r);
  }
}

// half <-> float conversions of every element.
extern "C" __global__ void to_half(const float* x, __half* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half_rn(x[i]);
}
extern "C" __global__ void to_float(const __half* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __half2float(x[i]);
}

// 2-D launch: out[r][c] = in[r][c] * scale + r - c, with a 2-D grid and 2-D blocks.
extern "C" __global__ void grid2d(const float* in, float* out, int rows, int cols, float scale) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  int r = blockIdx.y * blockDim.y + threadIdx.y;
  if (r < rows && c < cols) out[r * cols + c] = in[r * cols + c] * scale + (float)(r - c);
}

// 3-D launch: records each thread's flat id and coordinates, to check the index mapping.
extern "C" __global__ void coords3d(int* out) {
  int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int g = bid * blockDim.x * blockDim.y * blockDim.z + tid;
  out[4 * g + 0] = tid;
  out[4 * g + 1] = bid;
  out[4 * g + 2] = threadIdx.z * 100 + threadIdx.y * 10 + threadIdx.x;
  out[4 * g + 3] = blockIdx.z * 100 + blockIdx.y * 10 + blockIdx.x;
}

// __syncthreads_count: out[block] = number of threads of the block whose x > 0.
extern "C" __global__ void count_positive(const float* x, int* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int c = __syncthreads_count(i < n && x[i] > 0.0f);
  if (threadIdx.x == 0) out[blockIdx.x] = c;
}

// In place: x[i] = x[i] * 2 + y[i], where the caller may pass the same array as x and y.
extern "C" __global__ void axpy_inplace(float* x, const float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 2.0f + y[i];
}

// Math functions the project's kernels use.
extern "C" __global__ void math_funcs(const float* x, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float v = x[i];
    out[5 * i + 0] = rsqrtf(fabsf(v) + 1.0f);
    out[5 * i + 1] = expf(-v * v);
    out[5 * i + 2] = fmaxf(v, 0.0f);
    out[5 * i + 3] = isfinite(v) ? 1.0f : 0.0f;
    out[5 * i + 4] = (float)__popc(__float_as_uint(v));
  }
}
