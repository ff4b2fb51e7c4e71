// kernels/layout.cu: NCHW <-> NHWC layout changes, with an optional float32 <-> float16 cast.
//
// Both directions are one operation: a batch of row-major matrices is transposed.
//   NCHW -> NHWC: each of the N images is a C x (H*W) matrix; its transpose is (H*W) x C.
//   NHWC -> NCHW: each image is an (H*W) x C matrix; its transpose is C x (H*W).
//
// Entry points (Tin, Tout in {f32 = float, f16 = __half}):
//   batched_transpose_<Tin>_<Tout>(const Tin* src, Tout* dst, int rows, int cols, long long batch)
//     src: batch x rows x cols, C-contiguous.   dst: batch x cols x rows, C-contiguous.
//     dst[b][c][r] = convert(src[b][r][c]), the float -> half conversion rounding to nearest even.
//     Any rows, cols >= 1 (not only multiples of the tile) and any batch >= 1.
// Launch shape (the loader passes LAYOUT_TILE and LAYOUT_BLOCK_ROWS as -D options):
//     block = (LAYOUT_TILE, LAYOUT_BLOCK_ROWS)
//     grid  = (ceil(cols / TILE), min(ceil(rows / TILE), 65535), min(batch, 65535));
//     blocks stride over the row tiles with gridDim.y and over the batch with gridDim.z.
// Each block stages a TILE x TILE tile through shared memory (padded by one column against bank
// conflicts), so both the reads of src and the writes of dst are coalesced. Every element of dst is
// written exactly once; src is only read; no other memory is touched.
#include <cuda_fp16.h>

#ifndef LAYOUT_TILE
#define LAYOUT_TILE 32
#endif
#ifndef LAYOUT_BLOCK_ROWS
#define LAYOUT_BLOCK_ROWS 8
#endif
// Occupancy target for ptxas (blocks per SM). Without it NVRTC 12.9's ptxas spills on sm_70 even at
// 40 registers; asking for 4 blocks of 256 threads (<= 64 registers) compiles spill-free everywhere.
#define LAYOUT_MIN_BLOCKS 4

namespace layout {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename Tin, typename Tout>
__device__ __forceinline__ void batched_transpose(const Tin* __restrict__ src, Tout* __restrict__ dst,
                                                  int rows, int cols, long long batch) {
  // float holds every float16 value exactly, so staging in float never changes a value.
  __shared__ float tile[LAYOUT_TILE][LAYOUT_TILE + 1];
  const int row_tiles = (rows + LAYOUT_TILE - 1) / LAYOUT_TILE;
  const long long plane = (long long)rows * cols;
  const int c0 = blockIdx.x * LAYOUT_TILE;
  // Walk the batch by pointer increments: on sm_70 ptxas spills when it keeps b * plane live.
  const long long step = (long long)gridDim.z * plane;
  const Tin* s = src + (long long)blockIdx.z * plane;
  Tout* d = dst + (long long)blockIdx.z * plane;
  for (long long b = blockIdx.z; b < batch; b += gridDim.z, s += step, d += step) {
    for (int tr = blockIdx.y; tr < row_tiles; tr += gridDim.y) {
      const int r0 = tr * LAYOUT_TILE;
      // read a tile of src: threads of a warp read consecutive columns
      for (int i = threadIdx.y; i < LAYOUT_TILE; i += LAYOUT_BLOCK_ROWS) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = to_float(s[(long long)r * cols + c]);
      }
      __syncthreads();
      // write its transpose: threads of a warp write consecutive rows of src (columns of dst)
      for (int i = threadIdx.y; i < LAYOUT_TILE; i += LAYOUT_BLOCK_ROWS) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (c < cols && r < rows) d[(long long)c * rows + r] = from_float<Tout>(tile[threadIdx.x][i]);
      }
      __syncthreads();
    }
  }
}

}  // namespace layout

// Entry points: explicit extern "C" wrappers around the one templated body.
extern "C" __global__ void __launch_bounds__(LAYOUT_TILE * LAYOUT_BLOCK_ROWS, LAYOUT_MIN_BLOCKS)
batched_transpose_f32_f32(const float* src, float* dst, int rows, int cols, long long batch) {
  layout::batched_transpose(src, dst, rows, cols, batch);
}

extern "C" __global__ void __launch_bounds__(LAYOUT_TILE * LAYOUT_BLOCK_ROWS, LAYOUT_MIN_BLOCKS)
batched_transpose_f32_f16(const float* src, __half* dst, int rows, int cols, long long batch) {
  layout::batched_transpose(src, dst, rows, cols, batch);
}

extern "C" __global__ void __launch_bounds__(LAYOUT_TILE * LAYOUT_BLOCK_ROWS, LAYOUT_MIN_BLOCKS)
batched_transpose_f16_f32(const __half* src, float* dst, int rows, int cols, long long batch) {
  layout::batched_transpose(src, dst, rows, cols, batch);
}

extern "C" __global__ void __launch_bounds__(LAYOUT_TILE * LAYOUT_BLOCK_ROWS, LAYOUT_MIN_BLOCKS)
batched_transpose_f16_f16(const __half* src, __half* dst, int rows, int cols, long long batch) {
  layout::batched_transpose(src, dst, rows, cols, batch);
}
