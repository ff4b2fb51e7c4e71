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
