// Deliberately broken kernels: the emulator must fail loudly on each (tests/test_emulator.py).

// Reads and writes one element past the end: no bounds check on the last, partial block.
extern "C" __global__ void copy_no_bounds_check(const float* a, float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  b[i] = a[i];
}

// Reads one element before the start.
extern "C" __global__ void read_before_start(const float* a, float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i - 1];
}

// Lanes 0-15 wait at the block barrier while lanes 16-31 of the same warp wait for them in a
// shuffle: a hang on a GPU, a reported deadlock here.
extern "C" __global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
  }
}

// Shuffles from lane 16, which the mask leaves out.
extern "C" __global__ void shuffle_outside_mask(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 16);
}

// Calls __trap().
extern "C" __global__ void traps(int* out) {
  if (threadIdx.x == 3) __trap();
  out[threadIdx.x] = 1;
}

// Recurses without end: overflows the emulated thread's stack.
__device__ int depth(volatile int* p, int n) {
  volatile char pad[256];
  pad[0] = (char)n;
  return n > 1000000000 ? pad[0] : depth(p, n + 1) + pad[0];
}
extern "C" __global__ void recurse(int* out) { out[threadIdx.x] = depth(out, 0); }

// A full-mask reduction in a block of 48: the second warp has only lanes 0-15, and lane 0 reads
// lane 16, which does not exist (on a GPU: an undefined value).
extern "C" __global__ void reduce_partial_warp(int* out) {
  int v = (int)threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

// Lanes >= 20 return, then lane 4 reads lane 20.
extern "C" __global__ void shuffle_after_return(int* out) {
  if (threadIdx.x >= 20) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, threadIdx.x + 16);
}

// Half the warp votes while the other half shuffles: the lanes of one mask in different
// collectives.
extern "C" __global__ void mismatched_collectives(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
  else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}
