// chainer_tc CUDA emulator: compiles CUDA C++ kernels with g++ and runs them on the CPU.
//
// This header is force-included (g++ -include) before a kernel's .cu text. It provides what our
// kernels use from CUDA: the execution-space keywords, threadIdx/blockIdx/blockDim/gridDim,
// __syncthreads, warp collectives, atomics, __half/__half2, vector types and math intrinsics.
//
// Execution model
// - Blocks run one after another. The threads of a block are cooperative fibers (ucontext), all on
//   the launching OS thread; a fiber runs until it reaches a barrier or a warp collective, then the
//   scheduler resumes the next one. No two fibers ever run at the same time, so atomics are plain
//   read-modify-writes and `__shared__` maps to static storage (one block at a time uses it).
//   A fiber is started with makecontext/setcontext; after that the switches are _setjmp/_longjmp,
//   which, unlike swapcontext, make no system call (the signal mask is the same in every fiber).
// - __syncthreads waits for every live (not yet returned) thread of the block.
// - Warp collectives (__shfl_*_sync, __ballot_sync, __syncwarp, ...) wait only for the lanes named
//   in their mask that are still live; the lane that completes one (the last to arrive, or the last
//   to return) computes every participant's result. Reading a lane that is not in the mask, or
//   lanes of one mask meeting in different collectives, is reported as an error.
// - A waiting fiber is not resumed until its barrier or collective completes; a round of the
//   scheduler in which no fiber can run is a deadlock, reported as an error.
// - Array arguments live in guarded copies: the data ends exactly at a PROT_NONE page and starts after
//   one, so an out-of-bounds access faults; the fault is turned into an error message naming the
//   argument, the offset and the thread.
#pragma once
#define CHAINER_TC_EMULATOR 1

#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <stdio.h>
#include <math.h>
#include <cmath>
#include <csetjmp>
#include <signal.h>
#include <ucontext.h>
#include <sys/mman.h>
#include <unistd.h>
#include <pthread.h>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------------
// Execution-space keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __constant__
#define __managed__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

// ---------------------------------------------------------------------------------------------
// Built-in vector types (trivial, so `__shared__ float4 tile[..]` needs no initialisation guard)
struct uint3 { unsigned int x, y, z; };
struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
#define CTEMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N { T x, y; }; \
  static inline N make_##N(T x, T y) { N v; v.x = x; v.y = y; return v; }
#define CTEMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N { T x, y, z, w; }; \
  static inline N make_##N(T x, T y, T z, T w) { N v; v.x = x; v.y = y; v.z = z; v.w = w; return v; }
CTEMU_VEC2(float, float2, 8)
CTEMU_VEC4(float, float4, 16)
CTEMU_VEC2(double, double2, 16)
CTEMU_VEC2(int, int2, 8)
CTEMU_VEC4(int, int4, 16)
CTEMU_VEC2(unsigned int, uint2, 8)
CTEMU_VEC4(unsigned int, uint4, 16)
CTEMU_VEC2(short, short2, 4)
CTEMU_VEC4(unsigned char, uchar4, 4)
#undef CTEMU_VEC2
#undef CTEMU_VEC4

// ---------------------------------------------------------------------------------------------
// Runtime state
namespace ctemu {

struct Fiber {
  ucontext_t ctx;          // to start it
  jmp_buf jb;              // where it waits once started
  bool started;
  uint3 tid;
  unsigned lane, warp;
  bool done;
  bool at_bar;             // waiting at the __syncthreads of generation bar_gen
  unsigned bar_gen;
};

enum Op : unsigned char { kSync, kShfl, kVote };      // the kinds of warp collective

struct Warp {
  unsigned live;           // lanes that exist and have not returned
  unsigned arrived;        // lanes waiting in a warp collective (cleared when it completes)
  unsigned lanes;          // lanes that exist in this warp (blockDim may leave the last one partial)
  // per lane, what it brought to the collective it waits in, and what it gets back
  unsigned mask[32];
  unsigned char op[32];
  int src[32];             // shuffle: the lane it reads
  uint64_t slot[32];       // the value it publishes
  uint64_t result[32];     // shuffle: the value read; vote: ballot | voters << 32
};

// CUDA allows 4 KiB of parameters (32 KiB on Volta and later with CUDA 12.1): 512 pointers.
enum { kMaxParams = 512, kMaxWarps = 32, kErrLen = 1024 };

struct Region {        // one guarded copy of an array argument
  char* base;          // start of the mapping (leading guard page)
  size_t map_len;
  char* data;          // first byte of the copy
  size_t nbytes;
  size_t itemsize;
};

struct Runtime {
  // launch shape
  dim3 grid_dim, block_dim;
  uint3 block_idx;
  // fibers of the current block
  Fiber* fibers;
  char* stacks;            // nthreads stacks, each preceded by a guard page
  size_t stack_bytes, stacks_len;
  unsigned nfibers_cap;
  unsigned nthreads, live;
  Fiber* cur;
  jmp_buf sched;           // the scheduler, while a fiber runs
  // __syncthreads: arrivals and votes of the open generation; count and participants of the last
  unsigned bar_arrived, bar_gen;
  int bar_acc, bar_count, bar_total;
  Warp warps[kMaxWarps];
  // dynamic shared memory (guarded like an argument)
  Region smem;
  // the kernel body
  void (*body)(void*);
  void* body_ctx;
  // errors
  const char* kernel_name;
  char err[kErrLen];
  sigjmp_buf jmp;
  volatile sig_atomic_t in_launch;
  pthread_t launch_thread;
  Region regions[kMaxParams];
  int nregions;
  struct sigaction old_segv, old_bus;
  stack_t old_altstack;
  char* altstack;
};

inline Runtime rt;

static inline size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }

[[noreturn]] static inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] static inline void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rt.err, kErrLen, fmt, ap);
  va_end(ap);
  siglongjmp(rt.jmp, 1);
}

static inline void where(char* buf, size_t n) {
  if (rt.cur)
    snprintf(buf, n, "thread (%u,%u,%u) of block (%u,%u,%u)", rt.cur->tid.x, rt.cur->tid.y,
             rt.cur->tid.z, rt.block_idx.x, rt.block_idx.y, rt.block_idx.z);
  else
    snprintf(buf, n, "the launcher");
}

[[noreturn]] static inline void fail_here(const char* what) {
  char w[128];
  where(w, sizeof w);
  fail("kernel '%s': %s in %s", rt.kernel_name, what, w);
}

// Give control back to the scheduler; it resumes this fiber once what it waits for has happened.
__attribute__((noinline)) static void yield() {
  if (!_setjmp(rt.cur->jb)) _longjmp(rt.sched, 1);
}

// Run fiber f until it yields or ends.
__attribute__((noinline)) static void resume(Fiber* f) {
  rt.cur = f;
  if (_setjmp(rt.sched)) return;
  if (f->started) _longjmp(f->jb, 1);
  f->started = true;
  setcontext(&f->ctx);
}

// ---- block barrier --------------------------------------------------------------------------
// Completed by the last live thread to arrive, or by the return of the last one missing.
static inline void release_block_barrier() {
  rt.bar_count = rt.bar_acc;
  rt.bar_total = (int)rt.bar_arrived;
  rt.bar_arrived = 0;
  rt.bar_acc = 0;
  rt.bar_gen++;
}

// Returns how many of the threads that took part passed a nonzero `pred` (rt.bar_total took part).
static inline int block_barrier(int pred) {
  Fiber* f = rt.cur;
  rt.bar_acc += pred ? 1 : 0;
  if (++rt.bar_arrived >= rt.live) {
    release_block_barrier();
  } else {
    f->at_bar = true;
    f->bar_gen = rt.bar_gen;
    while (f->bar_gen == rt.bar_gen) yield();
    f->at_bar = false;
  }
  return rt.bar_count;      // not overwritten before this thread reaches the next barrier
}

// ---- warp collectives -----------------------------------------------------------------------
static inline Warp& my_warp() { return rt.warps[rt.cur->warp]; }

static inline const char* op_name(unsigned char op) {
  return op == kShfl ? "a shuffle" : op == kVote ? "a vote (__ballot/__any/__all_sync)" : "__syncwarp";
}

// A shuffle of lane k (of warp w) read lane src, which did not take part: reported as lane k's error.
[[noreturn]] static inline void bad_shuffle(Warp& w, unsigned k, unsigned src) {
  char msg[160];
  int n = snprintf(msg, sizeof msg, "warp shuffle reads lane %u, which ", src);
  if (!(w.mask[k] >> src & 1u)) snprintf(msg + n, sizeof msg - n, "is not in mask 0x%08x", w.mask[k]);
  else if (w.lanes >> src & 1u) snprintf(msg + n, sizeof msg - n, "has exited");
  else snprintf(msg + n, sizeof msg - n, "does not exist (this warp has %d lanes: blockDim %u)",
                __builtin_popcount(w.lanes), rt.nthreads);
  rt.cur = &rt.fibers[(&w - rt.warps) * 32 + k];
  fail_here(msg);
}

// Completes the collective lane `l` waits in if every live lane of its mask has arrived: checks that
// they all are in the same kind of collective with the same mask, computes every result, releases.
static inline void try_complete(Warp& w, unsigned l) {
  unsigned m = w.mask[l] & w.live;
  if ((w.arrived & m) != m) return;
  for (unsigned k = 0; k < 32; ++k) {
    if (!(m >> k & 1u) || (w.op[k] == w.op[l] && w.mask[k] == w.mask[l])) continue;
    char msg[256];
    snprintf(msg, sizeof msg, "warp collective mismatch: lane %u is in %s with mask 0x%08x while "
             "lane %u is in %s with mask 0x%08x (all lanes of a mask must call the same one)",
             l, op_name(w.op[l]), w.mask[l], k, op_name(w.op[k]), w.mask[k]);
    fail_here(msg);
  }
  if (w.op[l] == kShfl) {
    for (unsigned k = 0; k < 32; ++k) {
      if (!(m >> k & 1u)) continue;
      unsigned src = (unsigned)w.src[k];
      if (!(m >> src & 1u)) bad_shuffle(w, k, src);      // the lowest lane that reads badly
      w.result[k] = w.slot[src];
    }
  } else if (w.op[l] == kVote) {
    uint64_t ballot = 0;                         // over the lanes that took part
    for (unsigned k = 0; k < 32; ++k)
      if ((m >> k & 1u) && w.slot[k]) ballot |= 1u << k;
    for (unsigned k = 0; k < 32; ++k)
      if (m >> k & 1u) w.result[k] = ballot | (uint64_t)m << 32;
  }
  w.arrived &= ~m;
}

// One lane's part in a collective: publish, wait until the collective completes, take the result.
static inline uint64_t warp_collective(unsigned char op, unsigned mask, uint64_t value, int src) {
  Warp& w = my_warp();
  unsigned lane = rt.cur->lane, bit = 1u << lane;
  if (!(mask & bit)) {
    char msg[96];
    snprintf(msg, sizeof msg, "warp collective with mask 0x%08x that excludes the calling lane %u",
             mask, lane);
    fail_here(msg);
  }
  w.mask[lane] = mask;
  w.op[lane] = op;
  w.src[lane] = src;
  w.slot[lane] = value;
  w.arrived |= bit;
  try_complete(w, lane);
  while (w.arrived & bit) yield();
  return w.result[lane];
}

template <typename T>
static inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
  uint64_t r = 0;
  memcpy(&r, &v, sizeof(T));
  return r;
}
template <typename T>
static inline T from_bits(uint64_t r) {
  T v;
  memcpy(&v, &r, sizeof(T));
  return v;
}

// Every lane of `mask` publishes v and gets the value of lane `src` (its own if src < 0).
template <typename T>
static inline T exchange(unsigned mask, T v, int src) {
  int lane = (int)rt.cur->lane;
  return from_bits<T>(warp_collective(kShfl, mask, to_bits(v), src < 0 ? lane : src));
}

static inline void check_width(int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail_here("warp shuffle width must be a power of 2 in [1, 32]");
}

// Ballot of `pred` over the lanes of `mask`; *voters receives the lanes that took part.
static inline unsigned vote(unsigned mask, int pred, unsigned* voters = nullptr) {
  uint64_t r = warp_collective(kVote, mask, pred ? 1 : 0, 0);
  if (voters) *voters = (unsigned)(r >> 32);
  return (unsigned)r;
}

// ---- fibers and the scheduler -----------------------------------------------------------------
static void fiber_main() {
  rt.body(rt.body_ctx);
  Fiber* f = rt.cur;
  Warp& w = rt.warps[f->warp];
  f->done = true;
  rt.live--;
  w.live &= ~(1u << f->lane);
  // collectives and a barrier that waited only for this thread complete now
  for (unsigned l = 0; l < 32; ++l)
    if (w.arrived >> l & 1u) try_complete(w, l);
  if (rt.bar_arrived && rt.bar_arrived >= rt.live) release_block_barrier();
  _longjmp(rt.sched, 1);      // never returns (uc_link is unused)
}

static inline void ensure_stacks(unsigned n) {
  if (n <= rt.nfibers_cap) return;
  if (rt.stacks) munmap(rt.stacks, rt.stacks_len);
  delete[] rt.fibers;
  rt.stacks = nullptr;
  rt.fibers = nullptr;
  rt.nfibers_cap = 0;
  size_t page = page_size();
  const char* env = getenv("CHAINER_TC_EMULATOR_STACK_KB");
  size_t kb = env ? strtoul(env, nullptr, 10) : 128;
  if (kb < 16) kb = 16;
  rt.stack_bytes = (kb * 1024 + page - 1) / page * page;
  rt.stacks_len = (size_t)n * (rt.stack_bytes + page);
  void* m = mmap(nullptr, rt.stacks_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) fail("emulator: cannot map %zu bytes of fiber stacks", rt.stacks_len);
  rt.stacks = (char*)m;
  rt.fibers = new Fiber[n];
  for (unsigned i = 0; i < n; ++i) {
    mprotect(rt.stacks + (size_t)i * (rt.stack_bytes + page), page, PROT_NONE);
    getcontext(&rt.fibers[i].ctx);     // once; each block only re-makes the context
  }
  rt.nfibers_cap = n;
}

static inline void run_block() {
  size_t page = page_size();
  unsigned bx = rt.block_dim.x, by = rt.block_dim.y;
  rt.live = rt.nthreads;
  rt.bar_arrived = 0;
  rt.bar_acc = 0;
  for (unsigned w = 0; w < kMaxWarps; ++w) rt.warps[w].live = rt.warps[w].arrived = 0;
  for (unsigned i = 0; i < rt.nthreads; ++i) {
    Fiber& f = rt.fibers[i];
    f.tid.x = i % bx;
    f.tid.y = (i / bx) % by;
    f.tid.z = i / (bx * by);
    f.lane = i % 32;
    f.warp = i / 32;
    f.done = false;
    f.at_bar = false;
    rt.warps[f.warp].live |= 1u << f.lane;
    f.ctx.uc_stack.ss_sp = rt.stacks + (size_t)i * (rt.stack_bytes + page) + page;
    f.ctx.uc_stack.ss_size = rt.stack_bytes;
    f.ctx.uc_link = nullptr;
    f.started = false;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (unsigned w = 0; w < kMaxWarps; ++w) rt.warps[w].lanes = rt.warps[w].live;
  if (rt.smem.nbytes) memset(rt.smem.data, 0xff, rt.smem.nbytes);   // uninitialised: NaN pattern
  for (;;) {
    bool any = false, ran = false;
    for (unsigned i = 0; i < rt.nthreads; ++i) {
      Fiber& f = rt.fibers[i];
      if (f.done) continue;
      any = true;
      if (f.at_bar && f.bar_gen == rt.bar_gen) continue;             // still at __syncthreads
      if (rt.warps[f.warp].arrived >> f.lane & 1u) continue;         // still in a collective
      ran = true;
      resume(&f);
    }
    rt.cur = nullptr;
    if (!any) return;
    if (!ran) {
      unsigned at_bar = rt.bar_arrived, at_warp = 0;
      for (unsigned w = 0; w < kMaxWarps; ++w) at_warp += __builtin_popcount(rt.warps[w].arrived);
      fail("kernel '%s': deadlock in block (%u,%u,%u): %u live threads, %u waiting at __syncthreads, "
           "%u in warp collectives (a barrier not reached by every thread of the block, or a warp "
           "collective whose mask names lanes that never arrive)",
           rt.kernel_name, rt.block_idx.x, rt.block_idx.y, rt.block_idx.z, rt.live, at_bar, at_warp);
    }
  }
}

// ---- guarded argument copies ------------------------------------------------------------------
// The copy touches the trailing guard page (`front` false: every access past the end faults) or the
// leading one (`front` true: every access before the start faults). The slack on the other side,
// inside the data pages, is filled with kCanary and checked after the launch, so stray writes there
// are reported too.
enum : unsigned char { kCanary = 0xA5 };

static inline bool map_region(Region& r, const void* src, size_t nbytes, size_t itemsize,
                              bool front = false) {
  size_t page = page_size();
  size_t data_pages = (nbytes + page - 1) / page * page;
  r.map_len = data_pages + 2 * page;
  void* m = mmap(nullptr, r.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return false;
  r.base = (char*)m;
  mprotect(r.base, page, PROT_NONE);
  mprotect(r.base + page + data_pages, page, PROT_NONE);
  memset(r.base + page, kCanary, data_pages);
  r.data = front ? r.base + page : r.base + page + data_pages - nbytes;
  r.nbytes = nbytes;
  r.itemsize = itemsize ? itemsize : 1;
  if (src && nbytes) memcpy(r.data, src, nbytes);
  return true;
}

// Bytes of the slack around the copy that no longer hold the canary: (before, after).
static inline void slack_damage(const Region& r, size_t* before, size_t* after) {
  size_t page = page_size();
  char* lo = r.base + page;
  char* hi = r.base + r.map_len - page;
  *before = *after = 0;
  for (char* p = lo; p < r.data; ++p) *before += (unsigned char)*p != kCanary;
  for (char* p = r.data + r.nbytes; p < hi; ++p) *after += (unsigned char)*p != kCanary;
}

static inline void unmap_region(Region& r) {
  if (r.base) munmap(r.base, r.map_len);
  r.base = r.data = nullptr;
  r.nbytes = 0;
}

static void on_fault(int sig, siginfo_t* info, void* uctx) {
  if (!rt.in_launch || !pthread_equal(pthread_self(), rt.launch_thread)) {
    // not ours: hand it to whoever handled it before
    struct sigaction* old = sig == SIGSEGV ? &rt.old_segv : &rt.old_bus;
    sigaction(sig, old, nullptr);
    return;   // the faulting instruction runs again and reaches the old handler
  }
  char* a = (char*)info->si_addr;
  size_t page = page_size();
  char w[128];
  where(w, sizeof w);
  for (int i = -1; i < rt.nregions; ++i) {
    Region& r = i < 0 ? rt.smem : rt.regions[i];
    if (!r.base || a < r.base || a >= r.base + r.map_len) continue;
    char what[64];
    if (i < 0) snprintf(what, sizeof what, "dynamic shared memory (%zu bytes)", r.nbytes);
    else snprintf(what, sizeof what, "argument %d (%zu bytes)", i, r.nbytes);
    long long off = (long long)(a - r.data);
    snprintf(rt.err, kErrLen,
             "kernel '%s': out-of-bounds access to %s at byte offset %lld (element %lld of %zu) in %s",
             rt.kernel_name, what, off, off >= 0 ? off / (long long)r.itemsize : -((-off + (long long)r.itemsize - 1) / (long long)r.itemsize),
             r.nbytes / r.itemsize, w);
    siglongjmp(rt.jmp, 1);
  }
  if (rt.stacks && a >= rt.stacks && a < rt.stacks + rt.stacks_len) {
    snprintf(rt.err, kErrLen,
             "kernel '%s': stack overflow of an emulated thread in %s (raise "
             "CHAINER_TC_EMULATOR_STACK_KB, now %zu)", rt.kernel_name, w, rt.stack_bytes / 1024);
    siglongjmp(rt.jmp, 1);
  }
  snprintf(rt.err, kErrLen,
           "kernel '%s': invalid memory access (%s) at address %p in %s: not inside any argument "
           "(a wild pointer, a misaligned vector access, or a host address)",
           rt.kernel_name, sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", (void*)a, w);
  siglongjmp(rt.jmp, 1);
}

static inline void install_fault_handler() {
  size_t alt = 256 * 1024;
  if (!rt.altstack) rt.altstack = new char[alt];
  stack_t ss;
  ss.ss_sp = rt.altstack;
  ss.ss_size = alt;
  ss.ss_flags = 0;
  sigaltstack(&ss, &rt.old_altstack);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &rt.old_segv);
  sigaction(SIGBUS, &sa, &rt.old_bus);
}

static inline void restore_fault_handler() {
  sigaction(SIGSEGV, &rt.old_segv, nullptr);
  sigaction(SIGBUS, &rt.old_bus, nullptr);
  sigaltstack(&rt.old_altstack, nullptr);
}

// ---- launching --------------------------------------------------------------------------------
// What Python passes for one launch. args[i] points to the value of parameter i; for an array
// parameter that value is the host address of the array, replaced by the guarded copy's address.
struct LaunchArgs {
  unsigned grid[3], block[3];
  uint64_t shared_mem;
  int nargs;
  void** args;
  const uint64_t* nbytes;      // per parameter: bytes of the array, or UINT64_MAX for a scalar
  const uint64_t* itemsize;    // per parameter: element size of the array
  const int* writeback;        // per parameter: copy the array back after the launch
  const int* alias;            // per parameter: index of an earlier parameter with the same array, or -1
  int guard_front;             // guard page before the copies instead of after (see map_region)
  char* err;                   // kErrLen bytes for the error message
};

template <typename... A, size_t... I>
static inline void call_kernel(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <typename... A>
struct Body {
  void (*k)(A...);
  void** args;
  static void run(void* self) {
    Body* b = (Body*)self;
    call_kernel(b->k, b->args, std::index_sequence_for<A...>{});
  }
};

template <typename... A>
static int launch(void (*k)(A...), const char* name, const LaunchArgs* la) {
  static_assert(sizeof...(A) <= kMaxParams, "more kernel parameters than CUDA's 4 KiB can hold");
  rt.kernel_name = name;
  rt.err[0] = 0;
  rt.nregions = 0;
  rt.cur = nullptr;
  rt.smem.base = nullptr;
  rt.smem.nbytes = 0;
  void* slots[kMaxParams];
  void* vals[kMaxParams];
  static constexpr size_t aligns[] = {alignof(std::remove_cv_t<std::remove_reference_t<A>>)..., 1};
  int rc = 0;
  rt.launch_thread = pthread_self();
  install_fault_handler();
  rt.in_launch = 1;
  if (sigsetjmp(rt.jmp, 1) == 0) {
    if (la->nargs != (int)sizeof...(A))
      fail("kernel '%s' takes %zu arguments, launcher passed %d", name, sizeof...(A), la->nargs);
    for (int i = 0; i < la->nargs; ++i) rt.regions[i].base = nullptr;
    rt.nregions = la->nargs;
    for (int i = 0; i < la->nargs; ++i) {
      if (la->nbytes[i] == UINT64_MAX) {          // by value: read in place, so it must be aligned
        if ((uintptr_t)la->args[i] % aligns[i])
          fail("emulator: the value of argument %d is at %p, not aligned to the %zu bytes of its type",
               i, la->args[i], aligns[i]);
        vals[i] = la->args[i];
        continue;
      }
      if (la->alias[i] >= 0) {                 // the same array passed twice: one copy
        rt.regions[i].base = nullptr;
        slots[i] = slots[la->alias[i]];
        vals[i] = &slots[i];
        continue;
      }
      const void* host = *(void* const*)la->args[i];
      if (!map_region(rt.regions[i], host, la->nbytes[i], la->itemsize[i], la->guard_front))
        fail("emulator: cannot map %llu bytes for argument %d", (unsigned long long)la->nbytes[i], i);
      slots[i] = rt.regions[i].data;
      vals[i] = &slots[i];
    }
    if (la->shared_mem && !map_region(rt.smem, nullptr, la->shared_mem, 1, la->guard_front))
      fail("emulator: cannot map %llu bytes of dynamic shared memory", (unsigned long long)la->shared_mem);
    rt.grid_dim = dim3(la->grid[0], la->grid[1], la->grid[2]);
    rt.block_dim = dim3(la->block[0], la->block[1], la->block[2]);
    rt.nthreads = la->block[0] * la->block[1] * la->block[2];
    ensure_stacks(rt.nthreads);
    Body<A...> body{k, vals};
    rt.body = &Body<A...>::run;
    rt.body_ctx = &body;
    for (unsigned z = 0; z < la->grid[2]; ++z)
      for (unsigned y = 0; y < la->grid[1]; ++y)
        for (unsigned x = 0; x < la->grid[0]; ++x) {
          rt.block_idx.x = x;
          rt.block_idx.y = y;
          rt.block_idx.z = z;
          run_block();
        }
    rt.cur = nullptr;
    for (int i = 0; i < rt.nregions; ++i) {
      if (!rt.regions[i].base) continue;
      size_t before, after;
      slack_damage(rt.regions[i], &before, &after);
      if (before || after)
        fail("kernel '%s': out-of-bounds write to argument %d: %zu bytes changed %s its %zu bytes "
             "(seen after the launch; CHAINER_TC_EMULATOR_GUARD=%s catches the access itself)",
             name, i, before ? before : after, before ? "before the start of" : "after the end of",
             rt.regions[i].nbytes, before ? "start" : "end");
    }
    for (int i = 0; i < rt.nregions; ++i)
      if (rt.regions[i].base && la->writeback[i] && la->nbytes[i])
        memcpy(*(void**)la->args[i], rt.regions[i].data, la->nbytes[i]);
  } else {
    rc = 1;
    snprintf(la->err, kErrLen, "%s", rt.err);
  }
  rt.in_launch = 0;
  rt.cur = nullptr;
  restore_fault_handler();
  for (int i = 0; i < rt.nregions; ++i) unmap_region(rt.regions[i]);
  rt.nregions = 0;
  unmap_region(rt.smem);
  return rc;
}

static inline void* dyn_smem() {
  if (!rt.smem.nbytes) fail_here("extern __shared__ memory used but the launch asked for shared_mem=0");
  return rt.smem.data;
}

// ---- parameter signatures, checked by the Python launcher before a launch -----------------------
template <typename T> struct Code { static std::string get() { return "s" + std::to_string(sizeof(T)); } };
#define CTEMU_CODE(T, C) template <> struct Code<T> { static std::string get() { return C; } };
CTEMU_CODE(bool, "b1")
CTEMU_CODE(char, "i1")
CTEMU_CODE(signed char, "i1")
CTEMU_CODE(unsigned char, "u1")
CTEMU_CODE(short, "i2")
CTEMU_CODE(unsigned short, "u2")
CTEMU_CODE(int, "i4")
CTEMU_CODE(unsigned int, "u4")
CTEMU_CODE(long, "i8")
CTEMU_CODE(unsigned long, "u8")
CTEMU_CODE(long long, "i8")
CTEMU_CODE(unsigned long long, "u8")
CTEMU_CODE(float, "f4")
CTEMU_CODE(double, "f8")
CTEMU_CODE(void, "v")
CTEMU_CODE(float2, "f4x2")
CTEMU_CODE(float4, "f4x4")
CTEMU_CODE(double2, "f8x2")
CTEMU_CODE(int2, "i4x2")
CTEMU_CODE(int4, "i4x4")
CTEMU_CODE(uint2, "u4x2")
CTEMU_CODE(uint4, "u4x4")

template <typename T>
static std::string param_code() {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_pointer_v<U>) {
    using P = std::remove_cv_t<std::remove_pointer_t<U>>;
    // 'P' a pointer the kernel may write through, 'C' a pointer to const (never copied back)
    const char* kind = std::is_const_v<std::remove_pointer_t<U>> ? "C" : "P";
    if constexpr (std::is_pointer_v<P>) return kind + std::string("u8");   // a table of pointers
    else return kind + Code<P>::get();
  } else {
    return "S" + Code<U>::get();
  }
}

template <typename... A>
static std::string signature(void (*)(A...)) {
  std::string s;
  ((s += param_code<A>() + ","), ...);
  return s;
}

}  // namespace ctemu

#define threadIdx (::ctemu::rt.cur->tid)
#define blockIdx (::ctemu::rt.block_idx)
#define blockDim (::ctemu::rt.block_dim)
#define gridDim (::ctemu::rt.grid_dim)
#define warpSize 32

// ---------------------------------------------------------------------------------------------
// Synchronisation and warp intrinsics
static inline void __syncthreads() { ::ctemu::block_barrier(0); }
static inline int __syncthreads_count(int p) { return ::ctemu::block_barrier(p); }
static inline int __syncthreads_or(int p) { return ::ctemu::block_barrier(p) != 0; }
static inline int __syncthreads_and(int p) {
  int yes = ::ctemu::block_barrier(p);
  return yes == ::ctemu::rt.bar_total;        // every thread that took part, not those left now
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::ctemu::warp_collective(::ctemu::kSync, mask, 0, 0);
}
// Fences and __nanosleep let the other threads run: a thread spinning on a flag that another one
// sets needs them to (any interleaving is one a GPU may produce).
static inline void __threadfence() { ::ctemu::yield(); }
static inline void __threadfence_block() { ::ctemu::yield(); }
static inline void __threadfence_system() { ::ctemu::yield(); }
static inline void __nanosleep(unsigned) { ::ctemu::yield(); }
static inline unsigned __activemask() { return ::ctemu::my_warp().live; }
static inline unsigned __ballot_sync(unsigned mask, int p) { return ::ctemu::vote(mask, p); }
static inline int __any_sync(unsigned mask, int p) { return ::ctemu::vote(mask, p) != 0; }
static inline int __all_sync(unsigned mask, int p) {
  unsigned voters;
  unsigned yes = ::ctemu::vote(mask, p, &voters);
  return yes == voters;
}

// Source lanes as PTX's shfl.sync computes them (the lane operand is its low 5 bits); a source
// outside the lane's group of `width` gives the lane its own value.
template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::rt.cur->lane;
  return ::ctemu::exchange(mask, v, (lane & ~(width - 1)) | (src & (width - 1)));
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::rt.cur->lane, d = (int)(delta & 31u);
  return ::ctemu::exchange(mask, v, (lane & (width - 1)) + d < width ? lane + d : -1);
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::rt.cur->lane, d = (int)(delta & 31u);
  return ::ctemu::exchange(mask, v, (lane & (width - 1)) >= d ? lane - d : -1);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  ::ctemu::check_width(width);
  int lane = (int)::ctemu::rt.cur->lane;
  int src = lane ^ (lane_mask & 31);
  int seg_end = (lane & ~(width - 1)) + width;     // earlier groups may be read, later ones not
  return ::ctemu::exchange(mask, v, src < seg_end ? src : -1);
}

[[noreturn]] static inline void __trap() { ::ctemu::fail_here("__trap() called"); }
#undef assert
#define assert(e) ((e) ? (void)0 : ::ctemu::fail_here("assertion failed: " #e " (" __FILE__ ")"))

// ---------------------------------------------------------------------------------------------
// Atomics (no two fibers run at once, so a plain read-modify-write is atomic)
#define CTEMU_ATOMIC(NAME, T, EXPR) \
  static inline T NAME(T* a, T v) { T o = *a; *a = (EXPR); return o; }
CTEMU_ATOMIC(atomicAdd, int, o + v)
CTEMU_ATOMIC(atomicAdd, unsigned int, o + v)
CTEMU_ATOMIC(atomicAdd, unsigned long long, o + v)
CTEMU_ATOMIC(atomicAdd, float, o + v)
CTEMU_ATOMIC(atomicAdd, double, o + v)
CTEMU_ATOMIC(atomicSub, int, o - v)
CTEMU_ATOMIC(atomicSub, unsigned int, o - v)
CTEMU_ATOMIC(atomicExch, int, v)
CTEMU_ATOMIC(atomicExch, unsigned int, v)
CTEMU_ATOMIC(atomicExch, unsigned long long, v)
CTEMU_ATOMIC(atomicExch, float, v)
CTEMU_ATOMIC(atomicMax, int, o > v ? o : v)
CTEMU_ATOMIC(atomicMax, unsigned int, o > v ? o : v)
CTEMU_ATOMIC(atomicMax, unsigned long long, o > v ? o : v)
CTEMU_ATOMIC(atomicMax, long long, o > v ? o : v)
CTEMU_ATOMIC(atomicMin, int, o < v ? o : v)
CTEMU_ATOMIC(atomicMin, unsigned int, o < v ? o : v)
CTEMU_ATOMIC(atomicMin, unsigned long long, o < v ? o : v)
CTEMU_ATOMIC(atomicMin, long long, o < v ? o : v)
CTEMU_ATOMIC(atomicOr, int, o | v)
CTEMU_ATOMIC(atomicOr, unsigned int, o | v)
CTEMU_ATOMIC(atomicOr, unsigned long long, o | v)
CTEMU_ATOMIC(atomicAnd, int, o & v)
CTEMU_ATOMIC(atomicAnd, unsigned int, o & v)
CTEMU_ATOMIC(atomicAnd, unsigned long long, o & v)
CTEMU_ATOMIC(atomicXor, int, o ^ v)
CTEMU_ATOMIC(atomicXor, unsigned int, o ^ v)
CTEMU_ATOMIC(atomicXor, unsigned long long, o ^ v)
CTEMU_ATOMIC(atomicInc, unsigned int, o >= v ? 0u : o + 1u)
CTEMU_ATOMIC(atomicDec, unsigned int, (o == 0u || o > v) ? v : o - 1u)
#undef CTEMU_ATOMIC
#define CTEMU_CAS(T) \
  static inline T atomicCAS(T* a, T cmp, T v) { T o = *a; if (o == cmp) *a = v; return o; }
CTEMU_CAS(int)
CTEMU_CAS(unsigned int)
CTEMU_CAS(unsigned long long)
CTEMU_CAS(unsigned short)
#undef CTEMU_CAS

// ---------------------------------------------------------------------------------------------
// Math and bit intrinsics
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// __expf, __logf and __powf come from glibc (same names, full precision).
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float __fdividef(float x, float y) { return x / y; }
// The _rn intrinsics: IEEE operations rounded to nearest even (the CPU's own; never contracted).
static inline float __fadd_rn(float x, float y) { return x + y; }
static inline float __fsub_rn(float x, float y) { return x - y; }
static inline float __fmul_rn(float x, float y) { return x * y; }
static inline float __fdiv_rn(float x, float y) { return x / y; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __frsqrt_rn(float x) { return (float)(1.0 / sqrt((double)x)); }
static inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
static inline double __dadd_rn(double x, double y) { return x + y; }
static inline double __dsub_rn(double x, double y) { return x - y; }
static inline double __dmul_rn(double x, double y) { return x * y; }
static inline double __ddiv_rn(double x, double y) { return x / y; }
static inline double __drcp_rn(double x) { return 1.0 / x; }
static inline double __dsqrt_rn(double x) { return sqrt(x); }
static inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
// float -> integer as CUDA converts: nan gives 0, out of range saturates
template <typename I>
static inline I ctemu_f2i(double f) {
  if (f != f) return 0;
  if (f <= (double)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
  if (f >= (double)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
  return (I)f;
}
static inline int __float2int_rn(float x) { return ctemu_f2i<int>(nearbyintf(x)); }
static inline int __float2int_rz(float x) { return ctemu_f2i<int>(truncf(x)); }
static inline int __float2int_rd(float x) { return ctemu_f2i<int>(floorf(x)); }
static inline int __float2int_ru(float x) { return ctemu_f2i<int>(ceilf(x)); }
static inline unsigned __float2uint_rn(float x) { return ctemu_f2i<unsigned>(nearbyintf(x)); }
static inline unsigned __float2uint_rz(float x) { return ctemu_f2i<unsigned>(truncf(x)); }
static inline long long __float2ll_rn(float x) { return ctemu_f2i<long long>(nearbyintf(x)); }
static inline long long __float2ll_rz(float x) { return ctemu_f2i<long long>(truncf(x)); }
static inline int __double2int_rn(double x) { return ctemu_f2i<int>(nearbyint(x)); }
static inline int __double2int_rz(double x) { return ctemu_f2i<int>(trunc(x)); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }
static inline float __double2float_rn(double x) { return (float)x; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
static inline int __float_as_int(float x) { int r; memcpy(&r, &x, 4); return r; }
static inline unsigned __float_as_uint(float x) { unsigned r; memcpy(&r, &x, 4); return r; }
static inline float __int_as_float(int x) { float r; memcpy(&r, &x, 4); return r; }
static inline float __uint_as_float(unsigned x) { float r; memcpy(&r, &x, 4); return r; }
static inline long long __double_as_longlong(double x) { long long r; memcpy(&r, &x, 8); return r; }
static inline double __longlong_as_double(long long x) { double r; memcpy(&r, &x, 8); return r; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
static inline int __mul24(int x, int y) { return x * y; }
static inline unsigned __umul24(unsigned x, unsigned y) { return x * y; }
static inline int __mulhi(int x, int y) { return (int)(((long long)x * y) >> 32); }
static inline unsigned __umulhi(unsigned x, unsigned y) { return (unsigned)(((unsigned long long)x * y) >> 32); }
static inline long long __mul64hi(long long x, long long y) { return (long long)(((__int128)x * y) >> 64); }
static inline unsigned long long __umul64hi(unsigned long long x, unsigned long long y) {
  return (unsigned long long)(((unsigned __int128)x * y) >> 64);
}
// Loads and stores with cache hints: plain accesses here.
template <typename T> static inline T __ldg(const T* p) { return *p; }
template <typename T> static inline T __ldca(const T* p) { return *p; }
template <typename T> static inline T __ldcg(const T* p) { return *p; }
template <typename T> static inline T __ldcs(const T* p) { return *p; }
template <typename T> static inline T __ldlu(const T* p) { return *p; }
template <typename T> static inline T __ldcv(const T* p) { return *p; }
template <typename T> static inline void __stwb(T* p, T v) { *p = v; }
template <typename T> static inline void __stcg(T* p, T v) { *p = v; }
template <typename T> static inline void __stcs(T* p, T v) { *p = v; }
template <typename T> static inline void __stwt(T* p, T v) { *p = v; }
// min/max: the overloads of CUDA's math_functions.hpp, mixed signedness included (an int and an
// unsigned compare as unsigned), so that every call nvcc accepts resolves the same way here.
#define CTEMU_MINMAX(R, A, B) \
  static inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
  static inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
CTEMU_MINMAX(int, int, int)
CTEMU_MINMAX(unsigned int, unsigned int, unsigned int)
CTEMU_MINMAX(unsigned int, int, unsigned int)
CTEMU_MINMAX(unsigned int, unsigned int, int)
CTEMU_MINMAX(long, long, long)
CTEMU_MINMAX(unsigned long, unsigned long, unsigned long)
CTEMU_MINMAX(unsigned long, long, unsigned long)
CTEMU_MINMAX(unsigned long, unsigned long, long)
CTEMU_MINMAX(long long, long long, long long)
CTEMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CTEMU_MINMAX(unsigned long long, long long, unsigned long long)
CTEMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef CTEMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(float a, double b) { return fmin(a, b); }
static inline double max(float a, double b) { return fmax(a, b); }
static inline double min(double a, float b) { return fmin(a, b); }
static inline double max(double a, float b) { return fmax(a, b); }
static inline unsigned umin(unsigned a, unsigned b) { return min(a, b); }
static inline unsigned umax(unsigned a, unsigned b) { return max(a, b); }
static inline long long llmin(long long a, long long b) { return min(a, b); }
static inline long long llmax(long long a, long long b) { return max(a, b); }
static inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return min(a, b); }
static inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return max(a, b); }
using std::isfinite;
using std::isinf;
using std::isnan;

#include "chainer_tc_emu_fp16.h"
