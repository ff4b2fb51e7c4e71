// chainer_tc emulator: a NumPy data-memory handler that remembers every live allocation.
//
// On a GPU every address a kernel reads lies in some cudaMalloc allocation, and a read past the end
// of the one a pointer table names is a memcheck error. In the emulator, pointer tables (a struct
// of gradient addresses, a uint64 array of pointers) hold addresses of NumPy arrays that are not
// kernel arguments; to copy such an array into a guarded region for the launch, the emulator must
// know where its allocation starts and ends. NumPy (>= 1.22) lets a program replace the functions
// that allocate array data (PyDataMem_SetHandler, NEP 49): this handler forwards to the one it
// replaces and records (address, size) of what is live. Python (chainer_tc/testing/emulator.py)
// installs it through NumPy's C-API table with ctypes; no Python or NumPy header is needed here.
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <map>

namespace {

// NumPy's PyDataMemAllocator and PyDataMem_Handler, version 1 (numpy/ndarraytypes.h).
struct Allocator {
  void* ctx;
  void* (*malloc)(void* ctx, size_t size);
  void* (*calloc)(void* ctx, size_t nelem, size_t elsize);
  void* (*realloc)(void* ctx, void* ptr, size_t new_size);
  void (*free)(void* ctx, void* ptr, size_t size);
};

struct Handler {
  char name[127];
  uint8_t version;
  Allocator allocator;
};

Allocator inner;                          // the handler this one forwards to
// A fork while another thread holds the lock would leave the child's copy locked forever: the
// lock is taken around fork (pthread_atfork) and released on both sides.
pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
std::map<uintptr_t, size_t>* live;        // never destroyed: arrays may outlive static destructors

struct Lock {
  Lock() { pthread_mutex_lock(&mu); }
  ~Lock() { pthread_mutex_unlock(&mu); }
};

void before_fork() { pthread_mutex_lock(&mu); }
void after_fork() { pthread_mutex_unlock(&mu); }

void record(void* p, size_t n) {
  if (!p) return;
  Lock g;
  (*live)[(uintptr_t)p] = n ? n : 1;
}

void forget(void* p) {
  if (!p) return;
  Lock g;
  live->erase((uintptr_t)p);
}

void* t_malloc(void*, size_t n) {
  void* p = inner.malloc(inner.ctx, n);
  record(p, n);
  return p;
}

void* t_calloc(void*, size_t k, size_t n) {
  void* p = inner.calloc(inner.ctx, k, n);
  record(p, k * n);
  return p;
}

void* t_realloc(void*, void* old, size_t n) {
  void* p = inner.realloc(inner.ctx, old, n);
  if (p) {
    forget(old);
    record(p, n);
  }
  return p;
}

void t_free(void*, void* p, size_t n) {
  forget(p);
  inner.free(inner.ctx, p, n);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) Handler ctemu_track_handler = {
    "chainer_tc_emulator_tracking", 1, {nullptr, t_malloc, t_calloc, t_realloc, t_free}};

// Forward to `previous` (the handler being replaced). Returns 0, or -1 for an unknown version.
__attribute__((visibility("default"))) int ctemu_track_init(const Handler* previous) {
  if (!previous || previous->version != 1) return -1;
  inner = previous->allocator;
  if (!live) {
    live = new std::map<uintptr_t, size_t>;
    pthread_atfork(before_fork, after_fork, after_fork);
  }
  return 0;
}

// For each of n addresses, the live allocation containing it: start and size, or 0 and 0.
__attribute__((visibility("default"))) void ctemu_track_find(const uint64_t* addr, size_t n,
                                                              uint64_t* start, uint64_t* size) {
  Lock g;
  for (size_t i = 0; i < n; ++i) {
    start[i] = size[i] = 0;
    if (!live || live->empty()) continue;
    auto it = live->upper_bound((uintptr_t)addr[i]);
    if (it == live->begin()) continue;
    --it;
    if (addr[i] < it->first + it->second) {
      start[i] = it->first;
      size[i] = it->second;
    }
  }
}

__attribute__((visibility("default"))) size_t ctemu_track_count() {
  Lock g;
  return live ? live->size() : 0;
}

}  // extern "C"
