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
// The fences make the lock order the update across blocks (acquire: the atomic, then a fence;
// release: a fence, then the atomic), as the CUDA programming guide's lock does.
extern "C" __global__ void cas_lock(int* lock, int* counter) {
  if (threadIdx.x == 0) {
    while (atomicCAS(lock, 0, 1) != 0) {}
    __threadfence();
    *counter += 1;
    __threadfence();
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

// Block-wide votes as the last barriers of a kernel, after threads t >= live returned:
// out[3i..3i+2] = __syncthreads_count, _or and _and of pred over the threads still running.
extern "C" __global__ void block_votes(const int* pred, int* out, int live) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if ((int)threadIdx.x >= live) return;
  const int p = pred[i];
  const int c = __syncthreads_count(p);
  const int o = __syncthreads_or(p);
  const int a = __syncthreads_and(p);
  out[3 * i] = c;
  out[3 * i + 1] = o;
  out[3 * i + 2] = a;
}

// Warp collectives over the lanes still running, in partial warps (blockDim not a multiple of 32)
// and after threads t >= live returned. Per thread, out[5i..5i+4] =
//   the ballot of x > 0, any, all (over the running lanes of the warp),
//   the sum over its group of `width` lanes by __shfl_xor_sync (-1 where the group is incomplete),
//   the sum of __popc(mask) over a loop of lane % 5 + 1 trips with __syncwarp and a ballot inside.
extern "C" __global__ void partial_warps(const int* x, int* out, int live, int width) {
  const int t = threadIdx.x, lane = t % 32, i = blockIdx.x * blockDim.x + t;
  if (t >= live) return;
  const unsigned act = __ballot_sync(0xffffffffu, 1);
  const int v = x[i];
  out[5 * i] = (int)__ballot_sync(act, v > 0);
  out[5 * i + 1] = __any_sync(act, v > 0);
  out[5 * i + 2] = __all_sync(act, v > 0);
  const unsigned group = (width == 32 ? 0xffffffffu : (1u << width) - 1u) << (lane & ~(width - 1));
  int s = -1;
  if ((act & group) == group) {
    s = v;
    for (int o = 1; o < width; o <<= 1) s += __shfl_xor_sync(group, s, o, width);
  }
  out[5 * i + 3] = s;
  int k = 0, trips = 0;
  unsigned m = __ballot_sync(act, k < lane % 5 + 1);
  while (k < lane % 5 + 1) {
    __syncwarp(m);
    trips += __popc(m);
    ++k;
    m = __ballot_sync(m, k < lane % 5 + 1);
  }
  out[5 * i + 4] = trips;
}

// __half arithmetic and comparisons, elementwise over n pairs:
//   out[k * n + i] for k = 0..6: a + b, a - b, a * b, a / b, __hmax, __hmin, fma(a, b, b)
//   flags[i] bits: a < b, a == b, a > b, a != b (unordered), __hne (ordered), isnan(a), isinf(a)
extern "C" __global__ void half_ops(const __half* a, const __half* b, __half* out,
                                    unsigned char* flags, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    const __half x = a[i], y = b[i];
    out[0 * n + i] = __hadd(x, y);
    out[1 * n + i] = x - y;
    out[2 * n + i] = __hmul(x, y);
    out[3 * n + i] = x / y;
    out[4 * n + i] = __hmax(x, y);
    out[5 * n + i] = __hmin(x, y);
    out[6 * n + i] = __hfma(x, y, y);
    flags[i] = (unsigned char)(__hlt(x, y) | (x == y) << 1 | (x > y) << 2 | (x != y) << 3 |
                               __hne(x, y) << 4 | __hisnan(x) << 5 | (__hisinf(x) != 0) << 6);
  }
}

// double -> half, three ways: __double2half, the constructor, the assignment (each rounds once).
extern "C" __global__ void double_to_half(const double* x, __half* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const __half c = x[i];
    __half a;
    a = x[i];
    y[3 * i] = __double2half(x[i]);
    y[3 * i + 1] = c;
    y[3 * i + 2] = a;
  }
}

namespace emu_idioms {
template <typename T> __device__ __forceinline__ T twice(T v) { return v + v; }
}  // namespace emu_idioms

// Idioms that must compile against the emulator as they do with NVRTC: const __restrict__
// pointers, __launch_bounds__ with two arguments, #pragma unroll, size_t / long long scalars,
// min/max of mixed integer types, __half from and to integers and floats, __ldg, a table of array
// addresses, atomicAdd returning the old value, templates in a namespace. Per element i < n:
//   y[i] = 8 x[i] + min(i, n - 1) + max(threadIdx.x, 3) + min(int(i), 5u) + table[0][i]
//   h[i] = half(i) + half(shift) + half(0.5f) + half(0)
//   tickets[i] = the value atomicAdd(counter, 1.0f) returned to thread i
extern "C" __global__ void __launch_bounds__(128, 2)
idioms(const float* __restrict__ x, float* __restrict__ y, __half* __restrict__ h, size_t n,
       long long shift, const unsigned long long* __restrict__ table, float* counter,
       float* tickets) {
  const unsigned stride = blockDim.x * gridDim.x;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = __ldg(x + i);
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) acc += emu_idioms::twice(v);
    const float* extra = reinterpret_cast<const float*>(table[0]);
    y[i] = acc + (float)min(i, n - 1) + (float)max(threadIdx.x, 3) + (float)min((int)i, 5u) +
           extra[i];
    const __half hi = i, hs = shift, half_ = static_cast<__half>(0.5f);
    __half zero = 0.0f;
    zero = 0;
    h[i] = __hadd(__hadd(hi, hs), __hadd(half_, zero));
    tickets[i] = atomicAdd(counter, 1.0f) + float(zero);
  }
}

// The _rn float intrinsics (IEEE round to nearest even, never contracted into an fma):
// out[k * n + i] for k = add, sub, mul, div, rcp(a), sqrt(|a|), fma(a, b, a).
extern "C" __global__ void float_rn(const float* a, const float* b, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float x = a[i], y = b[i];
    out[0 * n + i] = __fadd_rn(x, y);
    out[1 * n + i] = __fsub_rn(x, y);
    out[2 * n + i] = __fmul_rn(x, y);
    out[3 * n + i] = __fdiv_rn(x, y);
    out[4 * n + i] = __frcp_rn(x);
    out[5 * n + i] = __fsqrt_rn(fabsf(x));
    out[6 * n + i] = __fmaf_rn(x, y, x);
  }
}

// Vector types and a 16-byte aligned struct passed by value.
struct __align__(16) Affine {
  float scale, shift;
  int n, pad;
};
extern "C" __global__ void by_value(float4 v, __half2 h, Affine a, float* out) {
  if (threadIdx.x == 0) {
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    out[4] = __low2float(h);
    out[5] = __high2float(h);
    out[6] = a.scale * (float)a.n + a.shift;
  }
}

// Vector loads from a float array whose length need not be a multiple of 4 (as CuPy's 256-byte
// aligned allocations allow): out[0] = the sum of x[0..n), read as float4s, then the tail as floats.
extern "C" __global__ void sum_float4(const float4* __restrict__ x, float* out, int n) {
  if (threadIdx.x != 0) return;
  float s = 0.0f;
  for (int i = 0; i < n / 4; ++i) {
    const float4 v = x[i];
    s += (v.x + v.y) + (v.z + v.w);
  }
  for (int i = n / 4 * 4; i < n; ++i) s += reinterpret_cast<const float*>(x)[i];
  out[0] = s;
}

// The last-block reduction of the CUDA programming guide's __threadfence() example, with fences on
// both sides: every block writes its partial sum, fences, and takes a ticket; the block that takes
// the last ticket fences and sums the partial sums. out[0] = the sum of x; count is reset to 0.
extern "C" __global__ void last_block_sum(const float* x, float* partial, unsigned* count,
                                          float* out, int n) {
  __shared__ float s[256];
  __shared__ bool last;
  float v = 0.0f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) v += x[i];
  s[threadIdx.x] = v;
  __syncthreads();
  for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = s[0];
    __threadfence();                                         // release the partial sum
    last = atomicInc(count, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();                                         // acquire every block's
    float total = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total += partial[b];
    out[0] = total;
  }
}

// The same as the programming guide writes it: the partial sums are volatile (so the last block
// reads them from memory), thread 0 of each block fences before its ticket.
extern "C" __global__ void guide_sum(const float* x, volatile float* partial, unsigned* count,
                                     float* out, int n) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    float v = 0.0f;
    for (int i = blockIdx.x; i < n; i += gridDim.x) v += x[i];
    partial[blockIdx.x] = v;
    __threadfence();
    last = atomicInc(count, gridDim.x) == gridDim.x - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    float total = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total += partial[b];
    out[0] = total;
    *count = 0;
  }
}

// -ftz probes (tests/test_emulator.py): float32 products, sums and comparisons of subnormals,
// float16 and float64 arithmetic on their own subnormals, each written out.
extern "C" __global__ void subnormal_ops(const float* f, const __half* h, const double* d,
                                         float* fo, __half* ho, double* dout) {
  fo[0] = f[0] * f[1];                 // 2^-70 * 2^-70: a subnormal product
  fo[1] = f[2] + 0.0f;                 // a subnormal input
  fo[2] = f[2] > 0.0f ? 1.0f : -1.0f;  // compared with zero
  fo[3] = f[0] * 1.0f;                 // a normal result, the same either way
  fo[4] = (float)d[0];                 // a double that rounds to a subnormal float
  ho[0] = __hmul(h[0], h[1]);          // a subnormal half times one
  dout[0] = d[1] * d[2];               // a subnormal double product
}

// A grid-wide barrier as cooperative groups' grid sync builds it: a __syncthreads(), then thread 0
// of each block fences and arrives on a counter, waits for every block, fences again, and a
// second __syncthreads() lets its block go on. The first fence is cumulative: it orders what the
// whole block did before the barrier, not only thread 0's own accesses. Each thread doubles its
// element, then (after the grid barrier) reads the element one block further on.
// Every block must be live at once: launch at most four blocks, under random schedules only.
extern "C" __global__ void grid_barrier_shift(const float* x, float* doubled, float* shifted,
                                              unsigned* arrived) {
  unsigned n = gridDim.x * blockDim.x;
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  doubled[i] = 2.0f * x[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrived, 1u);
    while (atomicAdd(arrived, 0u) < gridDim.x) __nanosleep(100);
    __threadfence();
  }
  __syncthreads();
  shifted[i] = doubled[(i + blockDim.x) % n];
}

// Thread 0 fences once more than the other threads before every thread reads x[0]; then every
// thread fences, a barrier, and thread 0 signals; block 1 waits, fences and writes x[0]. Every
// read is released: the others' by their own fences before the barrier, thread 0's by its
// second fence (blockDim 32, two blocks).
extern "C" __global__ void uneven_fences_then_release(float* x, unsigned* flag, float* out) {
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) __threadfence();
    out[threadIdx.x] = x[0];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(flag, 1u);
  } else if (threadIdx.x == 0) {
    while (atomicAdd(flag, 0u) < 1u) __nanosleep(100);
    __threadfence();
    x[0] = 2.0f;
  }
}

// Atomics and volatile reads of one counter never race with each other: thread 0 adds, threads
// 1 and 2 read it through a volatile pointer, thread 3 adds (blockDim 4).
extern "C" __global__ void atomics_around_volatile_reads(unsigned* c) {
  if (threadIdx.x == 0 || threadIdx.x == 3) {
    atomicAdd(c, 1u);
  } else {
    const unsigned v = *(volatile unsigned*)c;
    (void)v;
  }
}

// a * b + c written three ways: plainly (NVRTC contracts it into an fma by default, -fmad=true),
// through the _rn intrinsics (never contracted), and as __fadd_rn of a plain product (the add is
// never contracted, so neither is the product); in float, and the first two in double.
extern "C" __global__ void contraction(const float* a, const float* b, const float* c, float* out,
                                       const double* da, const double* db, const double* dc,
                                       double* dout) {
  const int i = threadIdx.x;
  out[3 * i] = a[i] * b[i] + c[i];
  out[3 * i + 1] = __fadd_rn(__fmul_rn(a[i], b[i]), c[i]);
  out[3 * i + 2] = __fadd_rn(a[i] * b[i], c[i]);
  dout[2 * i] = da[i] * db[i] + dc[i];
  dout[2 * i + 1] = __dadd_rn(__dmul_rn(da[i], db[i]), dc[i]);
}

// A module variable that counts the launches (state a GPU keeps from one launch to the next),
// and the number of this launch written out.
__device__ unsigned int launches_so_far;
extern "C" __global__ void count_launches(unsigned int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = atomicAdd(&launches_so_far, 1u) + 1u;
}

// A double buffer kept in a table of two addresses: the kernel swaps them and reads through the
// new first one (the host then sees the swapped addresses, as after a GPU launch).
extern "C" __global__ void swap_buffers(unsigned long long* table, float* out) {
  if (threadIdx.x == 0) {
    unsigned long long a = table[0];
    table[0] = table[1];
    table[1] = a;
    out[0] = reinterpret_cast<const float*>(table[0])[0];
  }
}
