// chainer_tc emulator: what the kernel's translation unit and the runtime (runtime/emu_runtime.cpp)
// share. Both are linked into one shared object per module with hidden visibility, so every
// module has its own runtime state.
//
// This header includes no C library header: the kernel's translation unit must see only the
// names CUDA defines (a kernel may be called `signal`, `gamma` or `fadd`, which glibc declares).
#pragma once

// ---------------------------------------------------------------------------------------------
// Built-in vector types (trivial, so `__shared__ float4 tile[..]` needs no initialisation guard)
struct uint3 { unsigned int x, y, z; };
struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace ctemu {

typedef unsigned long long u64;
typedef unsigned long usize;

// The part of an emulated CUDA thread that kernel code reads (threadIdx, blockIdx, lanes); the
// runtime's Fiber begins with it.
struct Thread {
  uint3 tid;
  uint3 bid;
  unsigned lane, warp;
};

extern Thread* cur;              // the running CUDA thread (null outside a fiber)
extern dim3 grid_dim, block_dim;

enum Op : unsigned char { kSync, kShfl, kVote };      // the kinds of warp collective

// What Python passes for one launch (chainer_tc/testing/emulator.py, _LaunchArgs).
struct LaunchArgs {
  unsigned grid[3], block[3];
  u64 shared_mem;              // dynamic shared memory of the launch
  u64 max_dyn_shared;          // the kernel's max_dynamic_shared_size_bytes (48 KiB unless raised)
  int nargs;
  void** args;                 // per parameter: the address of its value (an array's host address)
  const u64* nbytes;           // per parameter: bytes of the array, or ~0 for a value
  const u64* itemsize;         // per parameter: element size of the array
  const int* writeback;        // per parameter: copy the array back after the launch
  const int* alias;            // per parameter: an earlier parameter with the same array, or -1
  const u64* misalign;         // per parameter: the array's first byte minus its allocation's,
                               // mod 256 (a view keeps it, as a view of a cudaMalloc'd block does)
  // Pointer tables: words inside arguments that hold addresses of arrays (a struct of gradient
  // addresses, a uint64 array of pointers). Each target is a whole allocation; each slot is a
  // word that points into one, rewritten for the launch to point into the target's copy.
  int ntargets;
  const u64* target_host;      // first byte of the allocation
  const u64* target_nbytes;
  const int* target_arg;       // the array argument that is this allocation, or -1
  int nslots;
  const int* slot_arg;         // the argument holding the word
  const u64* slot_offset;      // its byte offset in the argument's value or array
  const int* slot_target;
  // checks
  int race;                    // run the race detector
  const char* schedules;       // comma-separated: forward, reverse, random:<seed>
  char* err;                   // kErrLen bytes for the error message
  u64* slot_bytes;             // out: the arena's slot size (accesses that far off an array are caught)
  u64* counts;                 // out, or null: kCountsPerRegion accesses counted per argument, per
                               // target and for shared memory (emu_runtime.cpp: count_access)
  int ftz;                     // flush float32 subnormals, as CuPy's -ftz=true (floating-point
                               // control register: float64 ones flush too, unlike on a GPU)
  const int* restrict_;        // per parameter: 2 const T* __restrict__, 1 T* __restrict__, else 0
  int nc_all;                  // the module loads through __ldg: track every array's written bytes
  int far;                     // the far check: run the first schedule again over an arena laid
                               // out anew; every access must land where it did (emu_runtime.cpp)
  int* far_skipped;            // out: 1 where the far check was skipped (no address space for
                               // its second layout)
};

enum { kErrLen = 2048, kMaxParams = 1024, kCountsPerRegion = 21 };

// ---- runtime entry points used by the inline code of chainer_tc_emu.h ----------------------
int run_launch(const char* name, const LaunchArgs* la, int nparams, const usize* aligns,
               void** vals, void (*body)(void*), void* ctx);
[[noreturn]] void fail_here(const char* what);
void yield_now();                 // fences and __nanosleep: let other threads run
void fence(int device_scope);     // __threadfence (1) or __threadfence_block (0)
// __syncthreads*: how many threads that took part passed pred; file and line of the call (threads
// at two different barriers are an error)
// frame: the frame of the __syncthreads() function (kernel code keeps frame pointers): the code
// addresses of the call and of the calls it is in tell apart two calls of one helper.
int block_barrier(int pred, const char* file, unsigned line, const void* frame);
int barrier_total();              // threads that took part in the last barrier
u64 warp_collective(unsigned char op, unsigned mask, u64 value, int src);
unsigned active_mask();
void* dyn_smem();
// A static __shared__ variable of the running block: `signature` is the __PRETTY_FUNCTION__ of
// shared_ref, which names the variable's type.
void* shared_var(int* slot, usize size, usize itemsize, const char* name, const char* signature);
// before an atomic read-modify-write of p, called from code address pc (the kernel's call);
// exchange: the old value is not read by the operation (atomicExch), for the unwritten-shared check
void atomic_access(void* p, usize size, const void* pc, int exchange);
void check_width(int width);
// __ldg: a load through the read-only non-coherent cache, of size bytes at p, called from pc
void nc_read(const void* p, usize size, const void* pc);

}  // namespace ctemu
