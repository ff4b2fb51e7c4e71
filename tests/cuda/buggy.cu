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

// ---- memcheck: accesses the emulator must refuse (tests/test_emulator_checks.py) ----------------

// Reads `far` elements past each thread's own one: past the end by more than a page.
extern "C" __global__ void read_far(const float* a, float* b, int n, int far) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i + far];
}

// Read element `index` of `a` (a 64-bit index: any distance) beside the arrays `b` and `out`, with
// `a` the first array argument or the last: an access far off `a` must be reported against `a`,
// never read from `b` or `out` and never from memory outside the launch.
extern "C" __global__ void read_first_at(const float4* a, const float4* b, float4* out, long long index) {
  out[0] = a[index];
  out[1] = b[0];
}
extern "C" __global__ void read_last_at(const float4* b, float4* out, const float4* a, long long index) {
  out[0] = a[index];
  out[1] = b[0];
}

// Sums each gradient of a table of addresses, one element too many (i <= count).
extern "C" __global__ void table_sum_off_by_one(const unsigned long long* table, const int* count,
                                                float* out, int n) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const float* g = reinterpret_cast<const float*>(table[j]);
  float s = 0.0f;
  for (int i = 0; i <= count[j]; ++i) s += g[i];
  out[j] = s;
}

// A static __shared__ array of 32 floats indexed by threadIdx.x: overflows with more threads.
extern "C" __global__ void shared_overflow(float* out) {
  __shared__ float s[32];
  s[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

// The same through a pointer: no array type for the bounds check, the region catches it.
extern "C" __global__ void shared_overflow_by_pointer(float* out) {
  __shared__ float s[32];
  float* p = s;
  p[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = p[threadIdx.x];
}

// A local array indexed out of range.
extern "C" __global__ void local_overflow(const int* idx, float* out) {
  float local[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  out[threadIdx.x] = local[idx[threadIdx.x]];
}

// Bounded to 256 threads per block.
extern "C" __global__ void __launch_bounds__(256) bounded(float* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// Integer division: by zero, and INT_MIN / -1.
extern "C" __global__ void divide(const int* a, const int* d, int* out) {
  out[threadIdx.x] = a[threadIdx.x] / d[threadIdx.x];
}

// The same division without the sanitizer's checks: INT_MIN / -1 traps (SIGFPE), which the
// emulator's fault handler reports.
__attribute__((no_sanitize("signed-integer-overflow", "integer-divide-by-zero")))
__device__ __noinline__ int divide_unchecked(int a, int d) { return a / d; }

extern "C" __global__ void divide_trap(const int* a, const int* d, int* out) {
  out[threadIdx.x] = divide_unchecked(a[threadIdx.x], d[threadIdx.x]);
}

// A float4 load from x + 1: misaligned (a GPU faults).
extern "C" __global__ void misaligned_float4(const float* x, float* out) {
  const float4 v = reinterpret_cast<const float4*>(x + 1)[0];
  out[0] = v.x + v.y + v.z + v.w;
}

// The low bits of each array argument's address.
extern "C" __global__ void addresses(const float* a, const __half* b, const double* c,
                                     unsigned long long* out) {
  out[0] = (unsigned long long)a;
  out[1] = (unsigned long long)b;
  out[2] = (unsigned long long)c;
}

// Sums pairs of floats with one 8-byte float2 load each: the caller must pass an array whose
// address is a multiple of 8 (a GPU faults on a misaligned vector access).
extern "C" __global__ void pair_sums(const float* x, float* out, int pairs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const float2 v = reinterpret_cast<const float2*>(x)[i];
  out[i] = v.x + v.y;
}

// Kernels named after C library functions: valid CUDA, which declares none of these names.
extern "C" __global__ void signal(float* x) { x[threadIdx.x] = 1.0f; }
extern "C" __global__ void gamma(float* x) { x[threadIdx.x] = 2.0f; }
extern "C" __global__ void fadd(float* x) { x[threadIdx.x] = 3.0f; }

// ---- racecheck: order-dependent kernels ---------------------------------------------------------

// A tree reduction whose barrier inside the loop is missing.
extern "C" __global__ void tree_sum_no_barrier(const float* x, float* out) {
  __shared__ float s[256];
  s[threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

// last_block_sum (selftest.cu) without its fences: the last block may read stale partial sums.
extern "C" __global__ void last_block_sum_no_fence(const float* x, float* partial, unsigned* count,
                                                   float* out, int n) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    float v = 0.0f;
    for (int i = blockIdx.x; i < n; i += gridDim.x) v += x[i];
    partial[blockIdx.x] = v;
    last = atomicInc(count, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    float total = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total += partial[b];
    out[0] = total;
  }
}

// A counter incremented with a plain ++ by one thread of every block.
extern "C" __global__ void plain_counter(unsigned* count) {
  if (threadIdx.x == 0) *count += 1;
}

// Each thread takes a ticket with atomicAdd and writes its index there: no data race, but the
// result depends on the order in which threads run.
extern "C" __global__ void tickets(unsigned* counter, int* out) {
  out[atomicAdd(counter, 1u)] = blockIdx.x * blockDim.x + threadIdx.x;
}

// ---- racecheck: a race with one reader among many ----------------------------------------------

// Waits until *flag reaches n, then fences: the acquiring side of a release through `flag`.
__device__ void acquire_at_least(unsigned* flag, unsigned n) {
  while (atomicAdd(flag, 0u) < n) __nanosleep(100);
  __threadfence();
}

// Thread 0 of each block but the last reads x[0]; every one of them except block `silent`
// releases its read (a fence, then an atomic on `flag`). The last block acquires those releases
// (the atomic, then a fence) and writes x[0]: the write races with block `silent`'s read only.
// silent < 0: every read is released, no race.
extern "C" __global__ void write_after_unreleased_read(float* x, unsigned* flag, float* out,
                                                       int silent) {
  unsigned readers = gridDim.x - 1;
  if (threadIdx.x) return;
  if (blockIdx.x < readers) {
    out[blockIdx.x] = x[0];
    if ((int)blockIdx.x != silent) {
      __threadfence();
      atomicAdd(flag, 1u);
    }
    return;
  }
  unsigned released = silent < 0 ? readers : readers - 1;
  acquire_at_least(flag, released);
  x[0] = 2.0f;
}

// As write_after_unreleased_read, but every reading block releases once, and block `silent` has a
// read that no release follows: how == 0, it releases and then reads; how == 1, it reads,
// releases and reads again. The last block acquires every release and writes x[0]: the write
// races with that one read. (A block that released at some time is not thereby ordered.)
extern "C" __global__ void write_after_read_after_release(float* x, unsigned* flag, float* out,
                                                          int silent, int how) {
  unsigned readers = gridDim.x - 1;
  if (threadIdx.x) return;
  if (blockIdx.x < readers) {
    bool odd = (int)blockIdx.x == silent;
    if (odd && how == 0) {
      __threadfence();
      atomicAdd(flag, 1u);
    }
    out[blockIdx.x] = x[0];
    if (!odd || how == 1) {
      __threadfence();
      atomicAdd(flag, 1u);
    }
    if (odd && how == 1) out[blockIdx.x] += x[0];
    return;
  }
  acquire_at_least(flag, readers);
  x[0] = 2.0f;
}

// Thread 0 of every block but the last reads x[0] through a volatile pointer; blocks 0-2 release
// their reads through `flag`, the others release nothing. The last block acquires those three
// releases and writes x[0], with an atomic (ordered: a volatile read and an atomic write are both
// atomic accesses) or a plain store (a race with the reads of blocks 3 on).
extern "C" __global__ void volatile_reads_then_write(float* x, unsigned* flag, float* out,
                                                     int atomic) {
  if (threadIdx.x) return;
  if (blockIdx.x + 1 < gridDim.x) {
    out[blockIdx.x] = *(volatile float*)x;
    if (blockIdx.x < 3) {
      __threadfence();
      atomicAdd(flag, 1u);
    }
    return;
  }
  acquire_at_least(flag, 3);
  if (atomic) atomicAdd(x, 1.0f);
  else x[0] = 2.0f;
}

// Every block reads all of w: a byte read by every block of the launch, as a weight is.
extern "C" __global__ void every_block_reads_all(const float* w, float* out, int n) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += w[i];
  atomicAdd(out, s);
}

// Lanes 0 and 1 read s, and thread 32 (another warp) reads it between them: lane 1 waits for
// thread 32 through a volatile flag, which orders nothing. After a __syncwarp of lanes 0 and 1,
// lane 0 writes s: ordered after both lanes' reads, not after thread 32's (blockDim 64).
extern "C" __global__ void write_after_other_warps_read(float* out) {
  __shared__ float s;
  __shared__ volatile int flag;
  if (threadIdx.x == 0) {
    s = 1.0f;
    flag = 0;
  }
  __syncthreads();
  if (threadIdx.x == 32) {
    out[1] = s;
    flag = 1;
  }
  if (threadIdx.x < 2) {
    if (threadIdx.x == 1)
      while (!flag) __nanosleep(100);
    out[2 * threadIdx.x] = s;
    __syncwarp(3u);
    if (threadIdx.x == 0) s = 2.0f;
  }
}

// A fence in the wrong place: block 0's thread 0 fences before it writes the data, then signals.
// Block 1 waits for the signal, fences and reads the data: nothing orders the write before the
// read (the fence covers what the thread did before it, in the same barrier interval too).
extern "C" __global__ void fence_before_the_write(float* data, unsigned* flag, float* out) {
  if (threadIdx.x) return;
  if (blockIdx.x == 0) {
    __threadfence();
    data[0] = 1.0f;
    atomicAdd(flag, 1u);
  } else {
    acquire_at_least(flag, 1u);
    out[0] = data[0];
  }
}

// Every thread reads s; after a barrier, the threads below `again` and every thread of warp 1 read
// it again; warp 1 syncs and thread 63 writes s. The write is ordered after every read but the
// second ones of the threads below `again` (blockDim 64; again = 0: no race).
extern "C" __global__ void write_after_reads_in_two_intervals(float* out, int again) {
  __shared__ float s;
  if (threadIdx.x == 0) s = 1.0f;
  __syncthreads();
  float v = s;
  __syncthreads();
  if ((int)threadIdx.x < again || threadIdx.x >= 32) v += s;
  if (threadIdx.x >= 32) {
    __syncwarp();
    if (threadIdx.x == 63) s = 2.0f;
  }
  out[threadIdx.x] = v;
}

// Thread 0 of every block but the last reads x[0] (a volatile read); the last block's thread 0
// then writes it, with an atomic or a plain store. No fence orders anything.
extern "C" __global__ void write_after_volatile_reads(unsigned* x, unsigned* out, int atomic) {
  if (threadIdx.x) return;
  if (blockIdx.x + 1 < gridDim.x) {
    out[blockIdx.x] = *(volatile unsigned*)x;
  } else if (atomic) {
    atomicAdd(x, 1u);
  } else {
    x[0] = 5u;
  }
}

// Every thread of block 0 publishes data[tid], then thread 0 signals after a barrier; block 1
// waits, fences, and each of its threads reads data[tid]. Race-free with every thread's fence
// between its write and the barrier (fence_first = 0); with the fences before the writes
// (fence_first = 1) nothing orders the writes before the reads.
extern "C" __global__ void publish_with_every_thread_fencing(float* data, unsigned* flag,
                                                             float* out, int fence_first) {
  if (blockIdx.x == 0) {
    if (fence_first) __threadfence();
    data[threadIdx.x] = 1.0f + threadIdx.x;
    if (!fence_first) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(flag, 1u);
  } else {
    if (threadIdx.x == 0) {
      acquire_at_least(flag, 1u);
    }
    __syncthreads();
    out[threadIdx.x] = data[threadIdx.x];
  }
}

// Block 0's thread 0 reads x[0] plainly, then through a volatile pointer; block 1's thread 0 then
// stores to it through a volatile pointer: a race with the plain read (not with the volatile one).
extern "C" __global__ void volatile_write_after_plain_read(unsigned* x, unsigned* out) {
  if (threadIdx.x) return;
  if (blockIdx.x == 0) {
    out[0] = x[0];
    out[1] = *(volatile unsigned*)x;
  } else {
    *(volatile unsigned*)x = 7u;
  }
}

// Block 0 writes data and releases it on flags[0]. In block 1, thread 0 fences first; thread 1
// then acquires flags[0]; after a barrier, thread 0 signals on flags[1]. Block 2 acquires
// flags[1] and reads data. Thread 0's release covers what it and its block knew at its fence,
// which came before thread 1's acquire: nothing orders block 0's write before block 2's read.
extern "C" __global__ void release_before_the_acquire_it_passes_on(float* data, unsigned* flags,
                                                                   float* out) {
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      data[0] = 5.0f;
      __threadfence();
      atomicAdd(flags, 1u);
    }
  } else if (blockIdx.x == 1) {
    if (threadIdx.x == 0) __threadfence();
    if (threadIdx.x == 1) {
      acquire_at_least(flags, 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(flags + 1, 1u);
  } else if (threadIdx.x == 0) {
    acquire_at_least(flags + 1, 1u);
    out[0] = data[0];
  }
}

// Lane 2 reads s (and lane 0 too if lane0_reads); lanes 0 and 1 read it, meet at __syncwarp(3)
// and lane 0 writes s: the partial __syncwarp orders lanes 0 and 1 only, so the write races
// with lane 2's read (blockDim 32).
extern "C" __global__ void partial_syncwarp_write(float* out, int lane0_reads) {
  __shared__ float s;
  if (threadIdx.x == 0) s = 1.0f;
  __syncthreads();
  if (threadIdx.x == 2) out[2] = s;
  if (threadIdx.x < 2) {
    if (threadIdx.x == 1 || lane0_reads) out[threadIdx.x] = s;
    __syncwarp(3u);
    if (threadIdx.x == 0) s = 2.0f;
  }
}

// Lanes 0-15 read s on one line, lanes 16-31 on another; lanes 16-31 then meet at a __syncwarp
// and lane 16 writes s: the write races with the reads of lanes 0-15, made on the first line.
extern "C" __global__ void write_after_reads_on_two_lines(float* out) {
  __shared__ float s;
  if (threadIdx.x == 0) s = 1.0f;
  __syncthreads();
  if (threadIdx.x < 16) {
    out[threadIdx.x] = s;  // the first line
  } else {
    out[threadIdx.x] = 2.0f * s;
    __syncwarp(0xffff0000u);
    if (threadIdx.x == 16) s = 3.0f;
  }
}

// Reads through an address passed as an integer (a host pointer, or a device pointer of an
// allocation the kernel was not given): memory the launch does not hold.
extern "C" __global__ void through_an_integer(unsigned long long address, float* out) {
  out[threadIdx.x] = reinterpret_cast<const float*>(address)[threadIdx.x];
}

// Counts the threads through a volatile read-modify-write: volatile orders nothing between
// threads, so a GPU loses updates (it needs atomicAdd).
extern "C" __global__ void volatile_count(unsigned* count) {
  volatile unsigned* c = count;
  *c = *c + 1;
}

// Sums a row into an accumulator never initialised: on a GPU it starts with whatever the
// register held.
__device__ __noinline__ float row_sum_uninitialised(const float* x, int n) {
  float acc;
  for (int i = 0; i < n; ++i) acc += x[i];
  return acc;
}

extern "C" __global__ void uninitialised_accumulator(const float* x, float* out, int n) {
  out[threadIdx.x] = row_sum_uninitialised(x + threadIdx.x * n, n);
}

// A helper that fills three elements of the two-element local array it is given by pointer.
__device__ __forceinline__ void load_three(const float* p, float* v) {
  v[0] = p[0];
  v[1] = p[1];
  v[2] = p[2];
}

extern "C" __global__ void local_array_overrun(const float* x, float* out) {
  float keep = x[3];
  float v[2];
  load_three(x, v);
  out[threadIdx.x] = v[0] + v[1] + keep;
}

// A block maximum over warp maxima that reads all 32 slots, of which only blockDim.x / 32 were
// written: the emulator's 0xff bytes are a NaN that fmaxf drops (the right answer); a GPU's
// leftover bytes from the previous block are not.
extern "C" __global__ void max_over_unwritten_slots(const float* x, float* out) {
  __shared__ float part[32];
  float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int d = 16; d; d >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, d));
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float m = part[threadIdx.x];
    for (int d = 16; d; d >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, d));
    if (threadIdx.x == 0) out[blockIdx.x] = m;
  }
}

// A barrier inside a loop whose trip count differs between threads, then one after it: in the
// second round some threads wait inside the loop and others after it.
extern "C" __global__ void barrier_in_an_uneven_loop(const float* x, float* out, int n) {
  __shared__ float total;
  if (threadIdx.x == 0) total = 0.0f;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    atomicAdd(&total, x[i]);
    __syncthreads();
  }
  __syncthreads();
  out[threadIdx.x] = total;
}

// An NCHW offset computed in int: n * c * hw passes 2^31 for a large tensor.
extern "C" __global__ void offset_in_int(const float* x, float* out, int n, int c, int hw) {
  int last = (n - 1) * c * hw;
  out[threadIdx.x] = x[threadIdx.x] + (float)(last & 1);
}

// 1u << 32: a GPU's shift clamps (gives 0), x86's takes the count mod 32 (gives 1).
extern "C" __global__ void shift_by_width(const unsigned* s, unsigned* out) {
  out[threadIdx.x] = 1u << s[threadIdx.x];
}

// A float cast to int with no clamp: a GPU saturates 3e9 to 2147483647 and turns NaN into 0;
// x86 gives -2147483648 for both.
extern "C" __global__ void cast_out_of_range(const float* x, int* out) {
  out[threadIdx.x] = (int)x[threadIdx.x];
}

// Far accesses with a 64-bit index: `index` elements off `a`, where the caller puts another
// array of the launch (the emulator's far check must find the one that lands in it).
extern "C" __global__ void write_at(float* a, float* b, long long index) {
  a[index] = 1.0f;
  b[1] = 2.0f;
}
extern "C" __global__ void atomic_at(float* a, float* b, long long index) {
  atomicAdd(a + index, 1.0f);
  b[1] = 2.0f;
}
// Through the first address of a table of two.
extern "C" __global__ void table_read_at(const unsigned long long* table, float* out,
                                         long long index) {
  out[0] = reinterpret_cast<const float*>(table[0])[index];
}

// An atomic on an address passed as an integer: host memory no launch gives a kernel.
extern "C" __global__ void atomic_to_address(unsigned long long address) {
  atomicAdd(reinterpret_cast<float*>(address), 1.0f);
}
