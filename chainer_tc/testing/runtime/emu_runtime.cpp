// chainer_tc CUDA emulator: the runtime linked into every emulated module (with hidden visibility,
// so each module has its own state). The kernel's translation unit is compiled with GCC's
// ThreadSanitizer instrumentation (-fsanitize=thread) and with -fsanitize=bounds,alignment,
// integer-divide-by-zero, and linked WITHOUT the sanitizer libraries: the callbacks that
// instrumentation calls (__tsan_read4, __ubsan_handle_out_of_bounds, ...) are defined here. This
// file itself is not instrumented.
//
// Execution model
// - The threads of a block are cooperative fibers on the launching OS thread. A fiber runs until it
//   reaches a barrier, a warp collective, a fence or __nanosleep (and, in the random schedule, an
//   atomic), then the scheduler resumes another one. No two fibers ever run at once.
// - A schedule decides the order: 'forward' runs blocks one after another and, between barriers,
//   threads 0, 1, 2, ...; 'reverse' runs blocks and threads in the opposite order; 'random:<seed>'
//   keeps up to four blocks live at once and picks the next thread to resume at random among them,
//   so blocks interleave at barriers, fences and atomics. Running a launch under several schedules
//   and comparing the results shows order-dependent kernels even where the race detector is silent.
// - Memory: every array argument, every allocation a pointer table points into, every __shared__
//   variable (per block) and dynamic shared memory is copied into its own page-aligned region of a
//   per-launch arena (256-byte alignment, as cudaMalloc gives, and more; an argument that is a view
//   starts as far past it as the view starts in its array, mod 256, so it is as misaligned as on a
//   GPU), each in its own 32 GiB slot of address space with an empty slot between two (see "the
//   arena"). Every instrumented access is checked against its region exactly (memcheck); one
//   outside any region is an error naming the region it belongs to, the offset and the thread.
//   The far check runs the first schedule again over an arena laid out anew and compares where
//   each access landed (see "far accesses").
// - Race detector (on request): a shadow cell per byte of every region records the last write and
//   two reads (block, thread, barrier generation, warp-sync count, atomic or not); a byte that more
//   than two threads read with no order between them keeps each reading thread's latest read in a
//   read set (per block, by barrier generation, lanes as bits), so no read is forgotten. Two
//   accesses by different threads, at least one a write, not both atomic (volatile counts as
//   atomic), conflict unless ordered: in one block by a __syncthreads (or a __syncwarp whose
//   mask names both) between them; across blocks by release/acquire through an atomic: a
//   thread's __threadfence then atomic on X releases what the thread did before the fence, what
//   its block did before the barrier preceding it (fences are cumulative) and what both had
//   acquired by then; an atomic on X then a __threadfence acquires what was released on X. A
//   volatile access of global memory is a relaxed atomic one: it releases after a fence, a
//   volatile read acquires, and a volatile read needs no fence after the atomic that saw the
//   release. Volatile accesses never race with each other, but a volatile read of another
//   block's volatile write that the writer announced afterwards (an atomic or a volatile write
//   the reader has read since) without a fence between is a stale read (Seen).
#include "chainer_tc_emu_abi.h"

#include <dlfcn.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace ctemu {

Thread* cur;
dim3 grid_dim, block_dim;

namespace {

enum { kMaxWarps = 32, kMaxSlots = 4, kMaxStaticShared = 48 * 1024,
       kMaxDynamicOptIn = 227 * 1024 };
enum : unsigned char { kCanary = 0xA5, kUninit = 0xff };
enum { kRead = 0, kWrite = 1, kAtomic = 2, kVolatile = 4 };
enum { kExchange = 8 };    // an atomic that does not read the old value (atomicExch): checks only
enum { kNC = 16 };         // a load through the read-only non-coherent cache (__ldg): checks only
// Per byte of an array whose accesses are tracked (Region::track): which argument of its group
// (the parameters given this one array) read or wrote it, and whether it was loaded through the
// non-coherent cache (by __ldg, or through a const __restrict__ parameter) or written at all.
enum : uint16_t { kTrackRead = 1, kTrackWrite = 1 << 4, kTrackLdg = 1 << 8, kTrackConst = 1 << 9,
                  kTrackWritten = 1 << 10 };
enum { kGroup = 4 };       // the arguments of one group told apart (a fifth counts as the fourth)
// Access counts per region, as the ABI's LaunchArgs::counts lays them out: for reads, writes and
// atomics in turn, the accesses of 1, 2, 4, 8 and 16 bytes and of any other size, then the bytes.
enum { kSizeClasses = 6, kCountsPerKind = kSizeClasses + 1, kCounts = 3 * kCountsPerKind };
static_assert(kCounts == ctemu::kCountsPerRegion, "the ABI's count layout");

// ---- race detector state ------------------------------------------------------------------------
// What a release covers of one block's accesses: those of any thread at barrier generation
// < all; those of any thread made before its fence number `sealed` (its fence count then
// < sealed); and those thread `tid` made before its fence number `self`.
struct Cover { uint32_t all, sealed, self, tid; };

struct VC {              // one Cover per block of the launch
  Cover* c;
};

struct Acc {             // one access, as the shadow records it
  uint32_t blk;          // block sequence number + 1 (0: no access)
  uint32_t gen;          // the block's barrier generation
  uint32_t wgen;         // the warp's __syncwarp count
  uint32_t fences;       // the thread's __threadfence() count
  uint32_t pc;           // code address, as an offset in the module + 1 (0: unknown)
  uint16_t tid;          // linear thread index in the block
  uint8_t flags;         // kWrite | kAtomic | kVolatile
  uint8_t pad;
};
static_assert(sizeof(Acc) == 24, "three accesses a byte");
struct Cell { Acc w, r0, r1; };   // r0.blk == kReadSet: the reads are in the ReadSet r1 points to
enum : uint32_t { kReadSet = 0xffffffffu };

// The exact reads of a byte that more than two threads read with no order between them (a cell
// holds two): per block, each reading thread's latest read, in levels by the block's barrier
// generation. A thread's latest read stands for its earlier ones (whatever is ordered after it is
// ordered after them: program order), so a write is checked against every read since the last
// write without keeping one entry per access. A level holds, per warp, the lanes whose latest read
// is in it; the newest level also the lanes that read at the warp's latest __syncwarp count; and
// the lanes' fence counts and code addresses (for the report): one value while the warp's lanes
// agree, one per lane once they differ.
struct LaneReads {
  uint32_t lanes;          // lanes whose latest read is in this level
  uint32_t wgen;           // newest level: the warp's __syncwarp count at its latest read here
  uint32_t at_wgen;        //   and the lanes that read at that count
  uint32_t pc;             // the lanes' code address at their reads, unless pc_mixed
  uint32_t fences;         // the lanes' __threadfence() count at their reads, unless mixed
  uint8_t pc_mixed;        // the addresses differ: each lane's is in Level::lane_pcs
  uint8_t mixed;           // the counts differ: each lane's is in Level::lane_fences
};
struct Level {
  uint32_t gen;            // the block's barrier generation
  uint32_t count;          // threads in this level
  std::vector<LaneReads> warps;
  std::vector<uint32_t> lane_fences;   // per thread, for warps whose lanes' counts differ
  std::vector<uint32_t> lane_pcs;      // per thread, for warps whose lanes' addresses differ
};

// Entries past the counts in use keep their memory for the next use: a set in steady state
// allocates nothing.
struct BlockReads {
  uint32_t blk;
  uint32_t nlevels;        // levels[0, nlevels), ascending generations
  uint32_t releases;       // the block's releases made before its first read here (kUnknown:
                           //   the entry was made after its reads, from a cell's)
  std::vector<Level> levels;
};
enum : uint32_t { kUnknown = 0xffffffffu };
enum { kPlainReads, kVolatileReads, kAtomicReads, kReadKinds };   // an atomic also reads
// A block that finished without releasing anything after its first read of a byte can never have
// those reads ordered before another block's write (an order between blocks needs a release after
// the read): its entry folds into `unordered`, one such read kept for the report. So a byte that
// every block reads (a weight, a broadcast input) holds the live blocks' entries and those of
// blocks that released, not one entry per block of the launch.
struct ReadSet {
  uint32_t nblocks[kReadKinds];                 // blocks[v][0, nblocks[v]) in use
  std::vector<BlockReads> blocks[kReadKinds];
  uint32_t settled[kReadKinds];                 // blocks[v][0, settled[v]): finished, not folded
  Acc unordered[kReadKinds];                    // a folded read (blk 0: none)
  uint32_t slot_blk[kReadKinds][kMaxSlots];     // per live block slot: the block it held at its
  uint32_t slot_entry[kReadKinds][kMaxSlots];   //   last read, and that block's entry
};
struct ReadSets { std::vector<ReadSet*> all, spare; };  // a region's sets; those free for reuse

// Relaxed observation, for the stale-read check: an atomic on global address x made at atomic
// clock t (one count per launch) has read the value every earlier atomic on x left, so its thread
// has seen each of those atomics happen, whether or not they released anything. A volatile read
// of a byte whose last write another block made, announced by such an atomic of that block
// (made after the write) but not released by it (no __threadfence() between the write and the
// atomic), may return the value from before the write on a GPU: volatile is a relaxed access,
// which orders nothing. The emulator returns the written value, so the read is reported.
struct Seen { uintptr_t x; u64 clock; };
struct SeenAt {          // the latest atomic on x of one block
  uint32_t gen, fences;  //   its barrier generation and its thread's fence count
  uint16_t tid;
  u64 clock;
};
struct SeenKey {
  uintptr_t x;
  uint32_t blk;
  bool operator==(const SeenKey& o) const { return x == o.x && blk == o.blk; }
};
struct SeenHash {
  size_t operator()(const SeenKey& k) const { return std::hash<uintptr_t>()(k.x * 0x9e3779b97f4a7c15ull ^ k.blk); }
};
enum { kSeenPerThread = 16 };
enum { kCallDepth = 32 };        // frames a barrier's identity takes in (the innermost ones)    // the distinct atomic addresses a thread or block remembers

struct Warp {
  unsigned live;           // lanes that exist and have not returned
  unsigned arrived;        // lanes waiting in a warp collective (cleared when it completes)
  unsigned lanes;          // lanes that exist in this warp
  unsigned sync_count;     // __syncwarp collectives completed
  uint32_t met[32][32];    // race detector: sync_count after the last __syncwarp lanes a and b
                           // both took part in (a partial mask orders only the lanes it names)
  unsigned mask[32];
  unsigned char op[32];
  int src[32];
  u64 slot[32];
  u64 result[32];
};

struct Block;

struct Fiber : Thread {
  ucontext_t ctx;
  jmp_buf jb;
  bool started, done, at_bar;
  unsigned bar_gen;
  unsigned linear;
  Block* blk;
  // race detector
  int last_fence;          // barrier generation of its last __threadfence, or -1
  int sealed_fence;        // the same for fences before the block's last barrier
  uint32_t sealed_fences;  //   and its fence count then
  uint32_t fences;         // __threadfence() calls made
  VC* known;               // releases this thread acquired (atomic then fence)
  bool known_grew;         //   since the block's last barrier
  VC* fence_known;         // the block's `known` at this thread's last fence (never changed after)
  VC* pending;             // releases seen by its atomics, not yet fenced
  // at a barrier: the return addresses of its frames, the __syncthreads() call's first (a
  // barrier is its call's address and those of the calls it is in, not only its source line)
  uintptr_t calls[kCallDepth];
  unsigned depth;
  std::vector<Seen> seen;  // atomics it made on global memory (relaxed observations, see Seen)
};

enum RegionKind { kArg, kTarget, kShared, kDyn };

struct Region {
  char* pages;             // first mapped page
  size_t span;             // mapped bytes
  char* data;              // first byte: pages + the array's offset in its allocation (mod 256)
  size_t nbytes, itemsize;
  int kind, index, slot;   // argument / target / variable index; block slot for shared memory
  u64 host;                // host address (arguments and targets)
  bool output;             // compared between schedules and copied back
  Cell* shadow;            // race detector: one cell per byte of `span`
  size_t shadow_len;
  ReadSets* read_sets;      // race detector: the read sets its cells point to
  unsigned char* written;  // shared memory: 1 per byte some thread of the block wrote
  // Arguments given one array twice or more, one of them __restrict__: each later parameter has
  // its own region mapping the first one's memory (`mirror`: that region), so that an access
  // tells which parameter it went through; the first region keeps the shadow and the counts.
  int mirror;              // the region whose memory this one maps, or -1
  int member;              // this parameter's place in its array's group (0: the first)
  int members[kGroup];     // first region: the group's parameters by place (-1: none)
  uint16_t* track;         // kTrack* bits per byte (first region), or null
  bool shared_map;         // its pages are a shared mapping (a group with mirrors)
  int mirror_fd;           //   of this memory file
  u64 count[kCounts];      // accesses counted (emulator.recording): see count_access
};

struct Block {
  bool active;
  uint3 idx;
  uint32_t seq;
  Fiber* fibers;
  char* stacks;
  size_t stacks_len;
  unsigned cap;
  unsigned live;
  unsigned bar_arrived, bar_gen;
  int bar_acc, bar_count, bar_total;
  const char* bar_file;            // where the first thread of this barrier called it
  unsigned bar_line, bar_tid;
  Warp warps[kMaxWarps];
  int dyn;                         // region of dynamic shared memory, or -1
  std::vector<int> svar;           // region per static __shared__ variable, or -1
  std::vector<unsigned> order;     // random schedule: this round's order
  unsigned cursor;
  bool ran;
  // race detector
  int sealed_gen;           // least barrier generation of the threads' sealed fences (-1: a thread has none)
  uint32_t sealed_fences;   // least fence count of the threads at their sealed fences
  VC* known;
  VC* pending;
  std::vector<Seen> seen;   // its threads' atomics before its last barrier (see Seen)
};

struct SharedVar {
  usize size, itemsize;
  const char* name;
  char type[96];                   // its C++ type, as g++ spells it
  u64 launch;                      // the launch that last allocated it
};

struct Slot {                      // a pointer-table word
  int arg;
  u64 offset;
  int target;
  u64 original, translated;
};

struct Schedule {
  enum { kForward, kReverse, kRandom } kind;
  u64 seed;
  char name[32];
};

struct Runtime {
  const char* kernel_name;
  char err[kErrLen];
  sigjmp_buf jmp;
  volatile sig_atomic_t in_launch;
  pthread_t launch_thread;
  u64 launch_id;
  // launch shape
  unsigned nthreads;
  u64 nblocks;
  // fibers
  Block slots[kMaxSlots];
  size_t stack_bytes;
  jmp_buf sched;
  Fiber* running;
  void (*body)(void*);
  void* body_ctx;
  // memory
  char* arena;
  size_t arena_size;
  unsigned slot_shift;             // log2 of the slot size: region k in slot 2k + 1
  // the far check (see "far accesses"): where the first run's accesses landed, for the second
  int far_mode;                    // kFarOff, kFarRecord (the first run), kFarCompare (the second)
  std::vector<u64> far_log;        // per access: its region + 2 (1: outside every region), offset
  u64 far_tail[2];                 // accesses past the log's cap, hashed: first run, second run
  size_t far_count[2];             // accesses noted: first run, second run
  unsigned far_shift[2];           // slot shift of each layout
  // the original bytes of the module's own variables (__device__) the kernel wrote in this
  // launch: every run after the first (another schedule, the far check's) starts from them
  std::unordered_map<uintptr_t, unsigned char> module_bytes;
  bool counting;                   // count accesses per region (the first schedule, on request)
  unsigned long fp_caller, fp_kernel;   // the floating-point control register outside and inside
  std::vector<Region> regions;
  std::vector<int> arg_region;     // per parameter, or -1
  std::vector<int> target_region;
  std::vector<Slot> slots_;
  std::vector<SharedVar> vars;
  unsigned kslots;                 // blocks live at once (4 with a random schedule, else 1)
  size_t static_shared;            // bytes of static __shared__ used by this launch
  u64 dyn_shared, max_dyn_shared;
  const LaunchArgs* la;
  // checks
  bool race;
  bool yield_atomics;
  const Schedule* schedule;
  std::unordered_map<uintptr_t, VC*> sync;       // releases per atomic address
  std::unordered_map<SeenKey, SeenAt, SeenHash> seen_at;   // per atomic address and block
  u64 atomic_clock;                              // atomics on global memory so far
  std::vector<uint32_t> releases;                // per block: releases made (fence, then atomic)
  std::vector<VC*> vcs;                          // every VC of this schedule, freed after it
  // fault handling
  struct sigaction old_segv, old_bus, old_fpe;
  stack_t old_altstack;
  char* altstack;
  uintptr_t module_base;
  size_t page;
};

Runtime rt;

// ---- errors ----------------------------------------------------------------------------------
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rt.err, kErrLen, fmt, ap);
  va_end(ap);
  siglongjmp(rt.jmp, 1);
}

uintptr_t module_base() {
  if (!rt.module_base) {
    Dl_info info;
    if (dladdr((void*)&module_base, &info) && info.dli_fbase) rt.module_base = (uintptr_t)info.dli_fbase;
  }
  return rt.module_base;
}

// "{pc:0x...}": the emulator's Python side turns the code address into "(file:line)".
void pc_tag(char* buf, size_t n, uint64_t pc) {
  if (!pc || pc < module_base()) { if (n) buf[0] = 0; return; }
  snprintf(buf, n, "{pc:0x%llx}", (unsigned long long)(pc - module_base()));
}

// A code address as the race detector's shadow keeps it: an offset in this module, + 1.
uint32_t pc_offset(uint64_t pc) {
  uintptr_t base = module_base();
  return pc >= base && pc - base < 0xffffffffu ? (uint32_t)(pc - base + 1) : 0;
}
uint64_t pc_address(uint32_t off) { return off ? module_base() + off - 1 : 0; }

void thread_of(char* buf, size_t n, uint32_t seq, unsigned tid) {
  unsigned bx = block_dim.x, by = block_dim.y;
  unsigned gx = grid_dim.x, gy = grid_dim.y;
  snprintf(buf, n, "thread (%u,%u,%u) of block (%u,%u,%u)", tid % bx, (tid / bx) % by,
           tid / (bx * by), (unsigned)(seq % gx), (unsigned)((seq / gx) % gy),
           (unsigned)(seq / ((u64)gx * gy)));
}

void where(char* buf, size_t n) {
  Fiber* f = rt.running;
  if (f) thread_of(buf, n, f->blk->seq, f->linear);
  else snprintf(buf, n, "the launcher");
}

void describe_region(char* buf, size_t n, const Region& r) {
  if (r.kind == kArg) snprintf(buf, n, "argument %d (%zu bytes)", r.index, r.nbytes);
  else if (r.kind == kTarget) snprintf(buf, n, "table target %d (%zu bytes)", r.index, r.nbytes);
  else if (r.kind == kDyn) snprintf(buf, n, "dynamic shared memory (%zu bytes)", r.nbytes);
  else snprintf(buf, n, "__shared__ variable '%s' (%s, %zu bytes)", rt.vars[r.index].name,
                rt.vars[r.index].type, r.nbytes);
}

}  // namespace

[[noreturn]] void fail_here(const char* what) {
  char w[128];
  where(w, sizeof w);
  fail("kernel '%s': %s in %s", rt.kernel_name, what, w);
}

namespace {

// ---- the arena -------------------------------------------------------------------------------
size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The arena is a row of slots of S = 2^slot_shift bytes: region k (in creation order) lies in slot
// 2k + 1, k pages after its start (plus its lead), and the even slots, the first and the last among
// them, are never mapped. S is 32 GiB (2^35 bytes) unless an array needs more (it is then at least
// twice the largest region). So the data of two regions are more than 2S apart, and every address
// from S before a region's data to S after it is in that region's own slot or in an empty one:
// an access at any offset in [-2^35, 2^35) from an array (every 32-bit element index of elements
// up to 16 bytes) is caught, never taken for an access to another region or to memory outside the
// launch, and is named against that array (owner_of). Which region an address is in takes a shift,
// not a page table. The arena is reserved (PROT_NONE, no memory behind it) for one launch and
// given back after it; where the address space for 32 GiB slots cannot be had, the slots are
// halved until they fit and once more (reserve_arena; the launch reports the size it got, and the
// emulator warns).
enum : size_t { kSlotShift = 35, kMinSlotShift = 24 };
enum { kSharedVarsPerBlock = 64 };     // static __shared__ variables a launch may reach, per block

size_t region_span(size_t bytes, size_t lead) { return round_up(lead + (bytes ? bytes : 1), rt.page); }

// Reserves 2 * regions + 1 slots (region k in slot 2k + 1, the even ones empty, the last of them
// after the last region), each at least twice `largest` bytes. Where 32 GiB slots do not fit, the
// first size that does is halved once more, so that as much address space is left for what the
// launch maps after the arena (the threads' stacks, the race detector's shadows).
void reserve_arena(size_t regions, size_t largest) {
  unsigned shift = kSlotShift;
  while (shift < 62 && ((size_t)1 << shift) < 2 * largest) ++shift;
  size_t slots = 2 * regions + 1;
  bool refused = false;
  for (;;) {
    size_t bytes = slots << shift;
    if ((bytes >> shift) == slots) {
      void* m = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      bool smaller = refused && shift > kMinSlotShift && ((size_t)1 << (shift - 1)) >= 2 * largest;
      if (m != MAP_FAILED && smaller) {
        munmap(m, bytes);
        m = mmap(nullptr, bytes / 2, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        --shift;
        bytes /= 2;
      }
      if (m != MAP_FAILED) {
        rt.arena = (char*)m;
        rt.arena_size = bytes;
        rt.slot_shift = shift;
        return;
      }
    }
    refused = true;
    if (shift <= kMinSlotShift || ((size_t)1 << (shift - 1)) < 2 * largest)
      fail("emulator: cannot reserve %zu slots of %zu bytes of address space for the launch", slots,
           (size_t)1 << shift);
    --shift;
  }
}

// After a launch: the regions' memory and the reservation are given back.
void release_arena() {
  for (Region& r : rt.regions) {
    if (r.shadow) munmap(r.shadow, r.shadow_len);
    free(r.written);
    free(r.track);
    if (r.shared_map) close(r.mirror_fd);
    if (r.read_sets)
      for (ReadSet* x : r.read_sets->all) delete x;
    delete r.read_sets;
  }
  rt.regions.clear();
  if (rt.arena) munmap(rt.arena, rt.arena_size);
  rt.arena = nullptr;
  rt.arena_size = 0;
}

// The far check's second layout: an arena of slots half (or, where the arrays need it, twice)
// the size of the current one's, reserved while the current one is still held; then the current
// one is given back and the new one takes its place. False (nothing changed) where neither size
// can be had (an address-space limit): the check is skipped.
bool reserve_relaid(size_t regions, size_t largest) {
  unsigned avoid = rt.slot_shift;
  size_t slots = 2 * regions + 1;
  unsigned tries[2] = {avoid - 1, avoid + 1};
  for (unsigned t : tries) {
    if (t < kMinSlotShift || t >= 62 || ((size_t)1 << t) < 2 * largest) continue;
    size_t bytes = slots << t;
    if ((bytes >> t) != slots) continue;
    void* m = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) continue;
    release_arena();
    rt.arena = (char*)m;
    rt.arena_size = bytes;
    rt.slot_shift = t;
    return true;
  }
  return false;
}

// The region an arena address is in (its slot's), or -1 in an empty slot.
inline int region_at(const char* a) {
  size_t slot = (size_t)(a - rt.arena) >> rt.slot_shift;
  if (!(slot & 1) || (slot >> 1) >= rt.regions.size()) return -1;
  return (int)(slot >> 1);
}

void alloc_shadow(Region& r) {
  r.shadow_len = round_up(r.span * sizeof(Cell), rt.page);
  void* s = mmap(nullptr, r.shadow_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (s == MAP_FAILED) fail("emulator: cannot map %zu bytes of race-detector shadow", r.shadow_len);
  r.shadow = (Cell*)s;
}

// The canary in a region's bytes outside its data: before it (a view's lead) and after it.
void fill_slack(Region& r) {
  memset(r.pages, kCanary, r.data - r.pages);
  memset(r.data + r.nbytes, kCanary, r.pages + r.span - (r.data + r.nbytes));
}

// A new region of `nbytes` after a PROT_NONE gap, its data `lead` bytes into its first page (an
// array argument's offset in its allocation: a view misaligned on the host is misaligned here);
// the slack before and after the data is filled with the canary. Returns its index.
int new_region(size_t nbytes, size_t itemsize, int kind, int index, int slot, size_t lead = 0) {
  size_t span = region_span(nbytes, lead);
  size_t k = rt.regions.size(), bytes = (size_t)1 << rt.slot_shift;
  size_t start = (2 * k + 1) * bytes + k * rt.page;
  if ((2 * k + 2) * bytes >= rt.arena_size)
    fail("emulator: the launch has more regions than it reserved slots for (%zu): more than %d static "
         "__shared__ variables per block?", (rt.arena_size >> rt.slot_shift) / 2, (int)kSharedVarsPerBlock);
  if (k * rt.page + span > bytes)
    fail("emulator: a %zu-byte region does not fit the launch's %zu-byte slots", span, bytes);
  char* p = rt.arena + start;
  if (mprotect(p, span, PROT_READ | PROT_WRITE) != 0) fail("emulator: cannot map %zu bytes", span);
  Region r;
  memset(&r, 0, sizeof r);
  r.mirror = -1;
  for (int m = 0; m < kGroup; ++m) r.members[m] = -1;
  r.pages = p;
  r.data = p + lead;
  r.span = span;
  r.nbytes = nbytes;
  r.itemsize = itemsize ? itemsize : 1;
  r.kind = kind;
  r.index = index;
  r.slot = slot;
  fill_slack(r);
  if (rt.race) alloc_shadow(r);
  if (kind == kShared || kind == kDyn) {
    r.written = (unsigned char*)calloc(nbytes ? nbytes : 1, 1);
    if (!r.written) fail("emulator: cannot allocate %zu bytes for shared memory's written map", nbytes);
  }
  rt.regions.push_back(r);
  return (int)rt.regions.size() - 1;
}

void reset_shadow(Region& r) {
  if (r.shadow) madvise(r.shadow, r.shadow_len, MADV_DONTNEED);
  if (r.read_sets) r.read_sets->spare = r.read_sets->all;     // kept for their memory
}

// Bytes after the data, in its last page, that no longer hold the canary (writes no check saw).
size_t slack_damage(const Region& r) {
  size_t n = 0;
  for (const char* p = r.pages; p < r.data; ++p) n += (unsigned char)*p != kCanary;
  for (const char* p = r.data + r.nbytes; p < r.pages + r.span; ++p) n += (unsigned char)*p != kCanary;
  return n;
}

// The region an arena address outside every region's data belongs to (for the error message):
// the last region whose data starts at or below it, if the address is less than a slot after that
// start, else the first one above it. Region data are more than two slots apart, so an address
// from a slot before a region's data to a slot after it belongs to that region.
int owner_of(const char* a) {
  int below = -1, above = -1;
  for (size_t i = 0; i < rt.regions.size(); ++i) {
    if (rt.regions[i].data <= a) below = (int)i;
    else if (above < 0) above = (int)i;
  }
  if (below >= 0 && (size_t)(a - rt.regions[below].data) < ((size_t)1 << rt.slot_shift)) return below;
  return above >= 0 ? above : below;
}

// ---- far accesses ----------------------------------------------------------------------------
// An access more than a slot off its array (a 64-bit index) lands in an empty slot (caught), in no
// mapping (caught) or in another region's data, where it would pass as an access to that region.
// The far check (emulator.checking(far=True); on with the race check) finds the last kind: the
// launch runs once more, the same schedule with race detection off, over an arena laid out anew
// with slots of another size, so that the distance between any two regions changes by a slot or
// more. Every access of the first run is logged (its region and offset; an access outside every
// region, to a local or a module variable, as such); each access of the second must land where
// its turn in the first did. The two runs execute the same code in the same order, so an access
// whose landing place depends on where the arrays lie is the first to differ, and is named with
// both landing places. Past kFarLogCap accesses only a hash of them is compared.
enum { kFarOff, kFarRecord, kFarCompare };
enum : size_t { kFarLogCap = (size_t)1 << 25 };       // 256 MiB of log

inline u64 far_entry(int id, size_t off) {
  return ((u64)(id + 2) << 48) | ((u64)off & ((1ull << 48) - 1));
}

inline u64 far_mix(u64 h, u64 e) {
  h = (h ^ e) * 0x9e3779b97f4a7c15ull;
  return h ^ (h >> 31);
}

void far_place(char* buf, size_t n, u64 e) {
  int id = (int)(e >> 48) - 2;
  if (id == -2) snprintf(buf, n, "outside every array the launch was given");
  else if (id < 0) snprintf(buf, n, "in memory outside the arrays (a local or a module variable)");
  else {
    char what[192];
    describe_region(what, sizeof what, rt.regions[id]);
    unsigned long long off = e & ((1ull << 48) - 1);
    snprintf(buf, n, "in %s at byte offset %llu", what, off);
  }
}

// The second run's access number rt.far_count[1] landed at `now` (far_entry; 0: in no region):
// not where the first run's did.
[[noreturn]] void far_diverged(u64 now, size_t n, int flags, uint64_t pc) {
  char w[128], tag[48], first[256], second[256];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  size_t i = rt.far_count[1];
  if (i < rt.far_log.size()) far_place(first, sizeof first, rt.far_log[i]);
  else snprintf(first, sizeof first, "nowhere (the first run made only %zu accesses)", i);
  far_place(second, sizeof second, now);
  fail("kernel '%s': %s of %zu bytes in %s%s lands in different places depending on where the "
       "launch's arrays lie: %s with them about 2^%u bytes apart, %s with them about 2^%u bytes "
       "apart. Its "
       "address was computed far out of its own array (more than 2^%u bytes off: a 64-bit index) "
       "or from the distance between two arrays (the emulator's far check)", rt.kernel_name,
       flags & kAtomic ? "an atomic access" : flags & kWrite ? "a write" : "a read", n, w, tag,
       first, rt.far_shift[0] + 1, second, rt.far_shift[1] + 1, rt.far_shift[0]);
}

void far_note(int id, size_t off, size_t n, int flags, uint64_t pc) {
  if (!rt.running) return;
  u64 e = far_entry(id, off);
  if (rt.far_mode == kFarRecord) {
    if (rt.far_count[0]++ < kFarLogCap) rt.far_log.push_back(e);
    else rt.far_tail[0] = far_mix(rt.far_tail[0], e);
    return;
  }
  size_t i = rt.far_count[1];
  if (i < kFarLogCap) {
    if (i >= rt.far_log.size() || rt.far_log[i] != e) far_diverged(e, n, flags, pc);
  } else {
    rt.far_tail[1] = far_mix(rt.far_tail[1], e);
  }
  rt.far_count[1]++;
}

// After the second run: it made as many accesses as the first, those past the log alike.
void far_finish() {
  if (rt.far_count[0] == rt.far_count[1] && rt.far_tail[0] == rt.far_tail[1]) return;
  fail("kernel '%s': what the launch does depends on where its arrays lie: %zu accesses with them "
       "about 2^%u bytes apart, %zu%s with them about 2^%u bytes apart, as after an access "
       "computed far out of its own array (more than 2^%u bytes off) or from the distance between "
       "two arrays (the emulator's far check)", rt.kernel_name, rt.far_count[0],
       rt.far_shift[0] + 1, rt.far_count[1],
       rt.far_count[0] == rt.far_count[1] ? ", not all to the same places," : "",
       rt.far_shift[1] + 1, rt.far_shift[0]);
}

[[noreturn]] void out_of_bounds(char* a, size_t n, int flags, uint64_t pc, const char* cause) {
  if (rt.far_mode == kFarCompare && rt.running) far_diverged(0, n, flags, pc);
  char w[128], what[192], tag[48];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  int id = rt.arena && (size_t)(a - rt.arena) < rt.arena_size ? owner_of(a) : -1;
  if (id < 0)
    fail("kernel '%s': invalid memory access (%s) at address %p in %s%s: not inside any argument "
         "(a wild pointer, or a host address)", rt.kernel_name, cause, (void*)a, w, tag);
  const Region& r = rt.regions[id];
  describe_region(what, sizeof what, r);
  long long off = (long long)(a - r.data), is = (long long)r.itemsize;
  const char* kind = !n ? "access to" : flags & kAtomic ? "atomic access to" : flags & kWrite ? "write to" : "read of";
  char element[64] = "";
  if (r.kind != kTarget)        // an allocation behind a table: its element type is unknown
    snprintf(element, sizeof element, " (element %lld of %zu)",
             off >= 0 ? off / is : -((-off + is - 1) / is), r.nbytes / r.itemsize);
  fail("kernel '%s': out-of-bounds %s %s at byte offset %lld%s in %s%s", rt.kernel_name, kind, what,
       off, element, w, tag);
}

// ---- the race detector ---------------------------------------------------------------------------
VC* new_vc() {
  VC* v = new VC;
  v->c = (Cover*)calloc(rt.nblocks ? rt.nblocks : 1, sizeof(Cover));
  if (!v->c) fail("emulator: out of memory for the race detector (%llu blocks)", (unsigned long long)rt.nblocks);
  rt.vcs.push_back(v);
  return v;
}

void join_cover(Cover& d, const Cover& s) {
  if (s.all > d.all) d.all = s.all;
  if (s.sealed > d.sealed) d.sealed = s.sealed;
  if (!s.self) return;
  if (!d.self || d.tid == s.tid) {
    if (s.self > d.self) d.self = s.self;
    d.tid = s.tid;
  } else if (s.self > d.self) {     // two threads' own coverage: keep the later one (conservative)
    d.self = s.self;
    d.tid = s.tid;
  }
}

void join(VC*& dst, const VC* src) {
  if (!src) return;
  if (!dst) dst = new_vc();
  for (u64 i = 0; i < rt.nblocks; ++i)
    if (src->c[i].all || src->c[i].sealed || src->c[i].self) join_cover(dst->c[i], src->c[i]);
}

bool covered(const VC* v, const Acc& a) {
  if (!v) return false;
  const Cover& c = v->c[a.blk - 1];
  return a.gen < c.all || a.fences < c.sealed || (c.self && a.tid == c.tid && a.fences < c.self);
}

// Across blocks, a release reaches a plain read through an acquire (the atomic, then a fence: a
// GPU's L1 may hold a stale line until the fence). A volatile read goes to L2 (ld.volatile is not
// cached in L1), so an atomic that observed the release orders it already, as the programming
// guide's last-block sum reads its volatile partial sums with no fence after its ticket.
bool ordered(const Acc& prev, const Acc& me, const Fiber* f) {
  if (prev.blk == me.blk)
    return prev.tid == me.tid || prev.gen < me.gen ||
           (prev.tid / 32 == me.tid / 32 &&
            f->blk->warps[me.tid / 32].met[prev.tid % 32][me.tid % 32] > prev.wgen);
  if (covered(f->known, prev) || covered(f->blk->known, prev)) return true;
  return (me.flags & (kVolatile | kWrite | kAtomic)) == kVolatile &&
         (covered(f->pending, prev) || covered(f->blk->pending, prev));
}

const char* access_name(uint8_t flags) {
  if (flags & kAtomic) return "atomic";
  if (flags & kVolatile) return flags & kWrite ? "volatile write" : "volatile read";
  return flags & kWrite ? "write" : "read";
}

[[noreturn]] void report_race(const Region& r, size_t byte, const Acc& prev, const Acc& me) {
  char what[192], a[128], b[128], ta[48], tb[48];
  describe_region(what, sizeof what, r);
  thread_of(a, sizeof a, me.blk - 1, me.tid);
  thread_of(b, sizeof b, prev.blk - 1, prev.tid);
  pc_tag(ta, sizeof ta, pc_address(me.pc));
  pc_tag(tb, sizeof tb, pc_address(prev.pc));
  const char* why = prev.blk == me.blk
      ? (prev.tid / 32 == me.tid / 32 ? "in one warp, with no __syncthreads() or __syncwarp() of both between them"
                                      : "in one block, with no __syncthreads() between them")
      : "in different blocks, not ordered by a __threadfence() and an atomic on both sides "
        "(release: fence, then the atomic; acquire: the atomic, then a fence)";
  long long off = (long long)(r.pages + byte - r.data);
  fail("kernel '%s': data race on %s at byte offset %lld (element %lld of %zu): a %s by %s%s and an "
       "earlier %s by %s%s, %s (schedule %s)", rt.kernel_name, what, off, off / (long long)r.itemsize,
       r.nbytes / r.itemsize, access_name(me.flags), a, ta, access_name(prev.flags), b, tb, why,
       rt.schedule->name);
}

bool conflict(const Acc& prev, const Acc& me, const Fiber* f) {
  if (!prev.blk) return false;
  if (!((prev.flags | me.flags) & kWrite)) return false;
  if ((prev.flags & (kAtomic | kVolatile)) && (me.flags & (kAtomic | kVolatile))) return false;
  return !ordered(prev, me, f);
}

// A per-lane value of a warp in a level, one number while the lanes agree (`value`, `mixed`
// clear), one per lane in `per_thread` once they differ. `others`: the warp's other lanes here.
void set_lane_value(uint32_t& value, uint8_t& mixed, std::vector<uint32_t>& per_thread,
                    uint32_t others, unsigned w, unsigned tid, uint32_t v) {
  if (!others) {
    value = v;
    mixed = 0;
  } else if (mixed) {
    per_thread[tid] = v;
  } else if (v != value) {
    if (per_thread.size() < rt.nthreads) per_thread.resize(rt.nthreads);
    for (unsigned l = 0; l < 32; ++l)
      if (others >> l & 1u) per_thread[w * 32 + l] = value;
    per_thread[tid] = v;
    mixed = 1;
  }
}

// The block slot a block runs in, or -1 once it finished (it reads nothing more).
int slot_of(uint32_t blk) {
  for (int i = 0; i < kMaxSlots; ++i)
    if (rt.slots[i].active && rt.slots[i].seq + 1 == blk) return i;
  return -1;
}

// Whether a read `me` may stand for an earlier read: ordered after it, and racing with whatever
// it races with (a volatile or atomic read does not stand for a plain one: a volatile write races
// with the plain read only).
bool replaces(const Acc& old, const Acc& me, const Fiber* f) {
  bool strong_old = old.flags & (kAtomic | kVolatile), strong_me = me.flags & (kAtomic | kVolatile);
  return (strong_old || !strong_me) && ordered(old, me, f);
}

// One read of a set's entry, as an access: the first of `lanes` (in warp `w` of level `l`).
Acc entry_read(const BlockReads& br, const Level& l, unsigned w, uint32_t lanes, int v) {
  const LaneReads& lr = l.warps[w];
  Acc a;
  memset(&a, 0, sizeof a);
  a.blk = br.blk;
  a.gen = l.gen;
  a.wgen = lr.wgen;
  a.tid = (uint16_t)(w * 32 + __builtin_ctz(lanes));
  a.flags = v == kAtomicReads ? kAtomic | kWrite : v == kVolatileReads ? kVolatile : kRead;
  a.pc = lr.pc_mixed ? l.lane_pcs[a.tid] : lr.pc;
  a.fences = lr.mixed ? l.lane_fences[a.tid] : lr.fences;
  return a;
}

// Fold the entries of kind `v` whose blocks finished without a release since their first read
// here (see ReadSet). A finished block's entry that does not fold never will (its count no longer
// changes): it joins the settled prefix, which is not looked at again, so a set whose blocks all
// release costs no rescan per new block. Live blocks' slots follow their entries.
void fold_finished(ReadSet& s, int v) {
  std::vector<BlockReads>& b = s.blocks[v];
  uint32_t settled = s.settled[v], keep = settled;
  auto follow = [&](uint32_t at, int slot) {        // a live block's entry moved to `at`
    if (slot >= 0 && s.slot_blk[v][slot] == b[at].blk) s.slot_entry[v][slot] = at;
  };
  // [0, settled): settled; [settled, keep): live; [keep, e): folded (memory kept for reuse)
  for (uint32_t e = settled; e < s.nblocks[v]; ++e) {
    int slot = slot_of(b[e].blk);
    if (slot < 0 && b[e].releases != kUnknown && rt.releases[b[e].blk - 1] == b[e].releases) {
      if (!s.unordered[v].blk) {
        const Level& l = b[e].levels[0];
        unsigned w = 0;
        while (!l.warps[w].lanes) ++w;
        s.unordered[v] = entry_read(b[e], l, w, l.warps[w].lanes, v);
      }
      continue;
    }
    if (keep != e) std::swap(b[keep], b[e]);
    uint32_t at = keep++;
    if (slot >= 0) {
      follow(at, slot);
    } else {
      if (at != settled) {
        std::swap(b[settled], b[at]);                // a live entry moves from settled to at
        follow(at, slot_of(b[at].blk));
      }
      settled++;
    }
  }
  s.nblocks[v] = keep;
  s.settled[v] = settled;
}

// A read joins a byte's read set: it replaces its thread's earlier read. A block's entry is found
// through the slot it runs in: a block whose slot holds another block has not read yet.
// `releases`: the block's release count, for a read made now (kUnknown: an earlier read).
void set_add(ReadSet& s, const Acc& a, int slot, uint32_t releases) {
  int v = a.flags & kAtomic ? kAtomicReads : a.flags & kVolatile ? kVolatileReads : kPlainReads;
  BlockReads* brp;
  if (slot >= 0 && s.slot_blk[v][slot] == a.blk) {
    brp = &s.blocks[v][s.slot_entry[v][slot]];
  } else {
    fold_finished(s, v);
    uint32_t e = s.nblocks[v]++;
    if (e == s.blocks[v].size()) s.blocks[v].emplace_back();
    brp = &s.blocks[v][e];
    brp->blk = a.blk;
    brp->nlevels = 0;
    brp->releases = releases;
    if (slot >= 0) {
      s.slot_blk[v][slot] = a.blk;
      s.slot_entry[v][slot] = e;
    }
  }
  BlockReads& br = *brp;
  unsigned w = a.tid / 32;
  uint32_t bit = 1u << (a.tid % 32);
  for (uint32_t i = 0; i < br.nlevels;) {
    Level& l = br.levels[i];
    if (l.gen != a.gen && (l.warps[w].lanes & bit)) {
      l.warps[w].lanes &= ~bit;
      if (!--l.count) {                    // an empty level goes to the end, with its memory
        std::rotate(br.levels.begin() + i, br.levels.begin() + i + 1, br.levels.begin() + br.nlevels);
        br.nlevels--;
        continue;
      }
    }
    ++i;
  }
  if (!br.nlevels || br.levels[br.nlevels - 1].gen != a.gen) {
    if (br.nlevels == br.levels.size()) br.levels.emplace_back();
    Level& l = br.levels[br.nlevels++];
    l.gen = a.gen;
    l.count = 0;
    l.warps.assign((rt.nthreads + 31) / 32, LaneReads());
  }
  Level& top = br.levels[br.nlevels - 1];
  LaneReads& lr = top.warps[w];
  set_lane_value(lr.fences, lr.mixed, top.lane_fences, lr.lanes & ~bit, w, a.tid, a.fences);
  set_lane_value(lr.pc, lr.pc_mixed, top.lane_pcs, lr.lanes & ~bit, w, a.tid, a.pc);
  if (!(lr.lanes & bit)) {
    lr.lanes |= bit;
    top.count++;
  }
  if (lr.at_wgen && lr.wgen == a.wgen) lr.at_wgen |= bit;
  else { lr.wgen = a.wgen; lr.at_wgen = bit; }
}

// Whether a release covers the read of lane `l` of warp `w` in level `lv` (as covered() does).
bool lane_covered(const Cover* c, const Level& lv, const LaneReads& lr, unsigned w, unsigned l) {
  if (!c) return false;
  uint32_t fences = lr.mixed ? lv.lane_fences[w * 32 + l] : lr.fences;
  return fences < c->sealed || (c->self && c->tid == w * 32 + l && fences < c->self);
}

// Whether a write `me` is unordered with a read of the set; if so, `prev` is one such read.
bool set_conflict(const ReadSet& s, const Acc& me, const Fiber* f, Acc& prev) {
  unsigned mw = me.tid / 32;
  uint32_t mbit = 1u << (me.tid % 32);
  for (int v = 0; v < kReadKinds; ++v) {
    if (v != kPlainReads && (me.flags & (kAtomic | kVolatile))) continue;   // only plain writes race
    if (s.unordered[v].blk) {                   // a finished block's, which nothing orders
      prev = s.unordered[v];
      return true;
    }
    for (uint32_t e = 0; e < s.nblocks[v]; ++e) {
      const BlockReads& br = s.blocks[v][e];
      uint32_t blk = br.blk;
      const Cover* cover[2] = {f->known ? &f->known->c[blk - 1] : nullptr,
                               f->blk->known ? &f->blk->known->c[blk - 1] : nullptr};
      for (uint32_t li = 0; li < br.nlevels; ++li) {
        const Level& l = br.levels[li];
        bool same = blk == me.blk;
        if (same && l.gen != me.gen) continue;                  // a __syncthreads() between
        if (!same && ((cover[0] && l.gen < cover[0]->all) || (cover[1] && l.gen < cover[1]->all))) continue;
        for (unsigned w = 0; w < l.warps.size(); ++w) {
          const LaneReads& lr = l.warps[w];
          uint32_t open = lr.lanes;
          if (same && w == mw) {                    // a __syncwarp of both lanes after the read?
            const uint32_t* met = f->blk->warps[mw].met[me.tid % 32];
            open = 0;
            for (unsigned k = 0; k < 32; ++k) {       // lanes not at the latest count read before it
              if (!(lr.lanes >> k & 1u) || (1u << k) == mbit) continue;
              uint64_t read_at = (lr.at_wgen >> k & 1u) ? lr.wgen : (uint64_t)lr.wgen - 1;
              if (met[k] <= read_at) open |= 1u << k;
            }
          }
          if (!same)
            for (unsigned k = 0; k < 32; ++k)         // before its sealed fence, or a releasing
              if ((open >> k & 1u) && (lane_covered(cover[0], l, lr, w, k) ||
                                       lane_covered(cover[1], l, lr, w, k)))
                open &= ~(1u << k);                   // thread's own read before its fence
          if (!open) continue;
          prev = entry_read(br, l, w, open, v);
          return true;
        }
      }
    }
  }
  return false;
}

ReadSet* set_of(const Cell& c) {
  ReadSet* s;
  memcpy(&s, &c.r1.gen, sizeof s);
  return s;
}

// A third read that neither of a cell's reads is ordered before: the cell's reads move to a set.
void to_read_set(Region& r, Cell& c, const Acc& me) {
  if (!r.read_sets) r.read_sets = new ReadSets;
  ReadSet* x;
  if (r.read_sets->spare.empty()) {
    x = new ReadSet;
    r.read_sets->all.push_back(x);
  } else {
    x = r.read_sets->spare.back();
    r.read_sets->spare.pop_back();
  }
  for (int v = 0; v < kReadKinds; ++v) {
    x->nblocks[v] = x->settled[v] = 0;
    x->unordered[v].blk = 0;
  }
  memset(x->slot_blk, 0, sizeof x->slot_blk);
  ReadSet& s = *x;
  Acc a[3] = {c.r0, c.r1, me};
  std::sort(a, a + 3, [](const Acc& x, const Acc& y) {        // a block's reads in its own order
    return x.blk != y.blk ? x.blk < y.blk : x.gen != y.gen ? x.gen < y.gen : x.wgen < y.wgen;
  });
  for (const Acc& e : a) set_add(s, e, slot_of(e.blk), kUnknown);
  c.r0.blk = kReadSet;
  c.r1.blk = 0;
  memcpy(&c.r1.gen, &x, sizeof x);         // gen and wgen: 8 bytes
}

// The cell's reads are over (a write): its set is emptied for reuse.
void drop_read_set(Region& r, Cell& c) {
  r.read_sets->spare.push_back(set_of(c));
  c.r0.blk = c.r1.blk = 0;
}

// ---- stale volatile reads (see Seen) ----
void note_seen(std::vector<Seen>& v, uintptr_t x, u64 clock) {
  for (Seen& s : v)
    if (s.x == x) { if (clock > s.clock) s.clock = clock; return; }
  if (v.size() >= kSeenPerThread) v.erase(v.begin());          // the oldest address
  v.push_back({x, clock});
}

// An atomic of the block of write `w`, made after it (by its thread, or by any thread after a
// __syncthreads() that followed it) and before an atomic of this thread or block on the same
// address: the write was announced to the reader. Returns that atomic's address, or 0.
uintptr_t announced(const Acc& w, const Fiber* f) {
  for (int k = 0; k < 2; ++k) {
    const std::vector<Seen>& v = k ? f->blk->seen : f->seen;
    for (const Seen& s : v) {
      auto it = rt.seen_at.find(SeenKey{s.x, w.blk});
      if (it == rt.seen_at.end()) continue;
      const SeenAt& e = it->second;
      if (e.clock >= s.clock) continue;
      if (w.gen < e.gen || (e.tid == w.tid && e.gen == w.gen && e.fences >= w.fences)) return s.x;
    }
  }
  return 0;
}

[[noreturn]] void report_stale(const Region& r, size_t byte, const Acc& w, const Acc& me, uintptr_t x) {
  char what[192], via[192], a[128], b[128], ta[48], tb[48];
  describe_region(what, sizeof what, r);
  int xr = region_at((const char*)x);
  if (xr >= 0) {
    const Region& q = rt.regions[xr];
    char d[160];
    describe_region(d, sizeof d, q);
    snprintf(via, sizeof via, "%s at byte offset %lld", d, (long long)((const char*)x - q.data));
  } else {
    snprintf(via, sizeof via, "address %p", (void*)x);
  }
  thread_of(a, sizeof a, me.blk - 1, me.tid);
  thread_of(b, sizeof b, w.blk - 1, w.tid);
  pc_tag(ta, sizeof ta, pc_address(me.pc));
  pc_tag(tb, sizeof tb, pc_address(w.pc));
  long long off = (long long)(r.pages + byte - r.data);
  fail("kernel '%s': stale read: a volatile read of %s at byte offset %lld (element %lld of %zu) by "
       "%s%s may return the value from before the %s by %s%s: that block announced the write "
       "afterwards through %s (an atomic, or a volatile write), which this block has read since "
       "(an atomic or a volatile read), but nothing released it: no __threadfence() between the "
       "write and that announcement. volatile accesses do not race with each other, but they "
       "order nothing (PTX treats them as relaxed): put a __threadfence() between the write and "
       "the atomic, as the programming guide's last-block sum does (schedule %s)", rt.kernel_name, what, off, off / (long long)r.itemsize,
       r.nbytes / r.itemsize, a, ta, access_name(w.flags), b, tb, via, rt.schedule->name);
}

void race_access(Region& r, char* a, size_t n, int flags, uint64_t pc) {
  Fiber* f = rt.running;
  Block* b = f->blk;
  Acc me;
  me.blk = b->seq + 1;
  me.gen = b->bar_gen;
  me.wgen = b->warps[f->warp].sync_count;
  me.fences = f->fences;
  me.pc = pc_offset(pc);
  me.tid = (uint16_t)f->linear;
  me.flags = (uint8_t)flags;
  me.pad = 0;
  size_t first = (size_t)(a - r.pages);
  bool write = flags & (kWrite | kAtomic);
  for (size_t i = 0; i < n; ++i) {
    size_t byte = first + i;
    Cell& c = r.shadow[byte];
    if (conflict(c.w, me, f)) report_race(r, byte, c.w, me);
    if (flags == kVolatile && c.w.blk && c.w.blk != me.blk && (c.w.flags & (kAtomic | kVolatile)) &&
        (r.kind == kArg || r.kind == kTarget) && !ordered(c.w, me, f)) {
      uintptr_t x = announced(c.w, f);
      if (x) report_stale(r, byte, c.w, me, x);
    }
    if (c.r0.blk == kReadSet) {
      if (!write) {
        set_add(*set_of(c), me, (int)(b - rt.slots), rt.releases[b->seq]);
        continue;
      }
      Acc prev;
      if (set_conflict(*set_of(c), me, f, prev)) report_race(r, byte, prev, me);
      drop_read_set(r, c);
      c.w = me;
      if (flags & kAtomic) c.r0 = me;
      continue;
    }
    if (write) {
      if (conflict(c.r0, me, f)) report_race(r, byte, c.r0, me);
      if (conflict(c.r1, me, f)) report_race(r, byte, c.r1, me);
      c.w = me;
      c.r0.blk = c.r1.blk = 0;
      if (flags & kAtomic) c.r0 = me;          // an atomic also reads
    } else if (!c.r0.blk || replaces(c.r0, me, f)) {
      c.r0 = me;
    } else if (!c.r1.blk || replaces(c.r1, me, f)) {
      c.r1 = me;
    } else {
      to_read_set(r, c, me);
    }
  }
}

// An atomic on X in global memory: acquire what was released on X, then release (if this thread
// fenced before) what its block did before its fences, and what it knew then.
// A volatile access to global memory is a relaxed one (PTX): a volatile write after a
// __threadfence() releases as an atomic does, and a volatile read acquires what was released on
// its address by then (a spin on a volatile flag, then a fence); both take part in the stale-read
// check (Seen) as atomics do. `reads`: it reads the location; `writes`: it writes it.
void sync_atomic(uintptr_t x, bool reads = true, bool writes = true) {
  Fiber* f = rt.running;
  Block* b = f->blk;
  u64 clock = ++rt.atomic_clock;
  if (reads) note_seen(f->seen, x, clock);
  if (writes) {
    SeenAt& at = rt.seen_at[SeenKey{x, b->seq + 1}];
    at.gen = b->bar_gen;
    at.fences = f->fences;
    at.tid = (uint16_t)f->linear;
    at.clock = clock;
  }
  if (reads) {
    auto it = rt.sync.find(x);
    if (it != rt.sync.end()) join(f->pending, it->second);
  }
  if (!writes || f->last_fence < 0) return;
  rt.releases[b->seq]++;
  VC*& s = rt.sync[x];
  if (!s) s = new_vc();
  Cover c;
  // A __syncthreads() orders the block's earlier accesses before this thread's fence (CUDA's
  // fences are cumulative: cooperative groups' grid sync relies on it); when every thread fenced
  // before a barrier, each thread's fence orders its own earlier accesses, which are then before
  // the barrier and so before this atomic.
  c.all = std::max((uint32_t)f->last_fence, b->sealed_gen >= 0 ? (uint32_t)b->sealed_gen : 0u);
  c.sealed = b->sealed_fences;
  c.self = f->fences;
  c.tid = f->linear;
  join_cover(s->c[b->seq], c);
  join(s, f->known);            // what the thread acquired, all of it at or before its last fence
  join(s, f->fence_known);      // what its block had acquired by then (not what came later)
}

// ---- checked accesses ----------------------------------------------------------------------------
inline void count_access(Region& r, size_t n, int flags) {
  int kind = flags & kAtomic ? 2 : flags & kWrite ? 1 : 0;
  int size = n == 1 ? 0 : n == 2 ? 1 : n == 4 ? 2 : n == 8 ? 3 : n == 16 ? 4 : 5;
  r.count[kind * kCountsPerKind + size] += 1;
  r.count[kind * kCountsPerKind + kSizeClasses] += n;
}

// The counts of the first schedule's run, per argument (an alias's row stays 0: its array is
// counted once, under its first argument), per table target, and for shared memory as a whole.
void report_counts(const LaunchArgs* la) {
  u64* out = la->counts;
  if (!out) return;
  memset(out, 0, sizeof(u64) * kCounts * (la->nargs + la->ntargets + 1));
  auto add = [](u64* row, const Region& r) { for (int c = 0; c < kCounts; ++c) row[c] += r.count[c]; };
  for (int i = 0; i < la->nargs; ++i)
    if (rt.arg_region[i] >= 0 && la->alias[i] < 0) add(out + (size_t)i * kCounts, rt.regions[rt.arg_region[i]]);
  for (int t = 0; t < la->ntargets; ++t)
    if (la->target_arg[t] < 0) add(out + (size_t)(la->nargs + t) * kCounts, rt.regions[rt.target_region[t]]);
  for (const Region& r : rt.regions)
    if (r.kind == kShared || r.kind == kDyn) add(out + (size_t)(la->nargs + la->ntargets) * kCounts, r);
}

// A read of shared memory that no thread of the block wrote: on a GPU it holds what the SM's
// previous block left there (here 0xff bytes, which a max or min can hide). Reported even where
// the value is then discarded: read under the condition that makes it valid instead.
__attribute__((noinline)) void unwritten_shared(const Region& r, char* a, size_t n, int flags, uint64_t pc) {
  char w[128], tag[48], what[160];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  describe_region(what, sizeof what, r);
  size_t off = (size_t)(a - r.data);
  fail("kernel '%s': %s of %zu bytes at offset %zu of %s in %s%s reads bytes no thread of this "
       "block wrote (shared memory starts with whatever the previous block left there; another "
       "thread's write counts once it has happened in this schedule, and the race detector "
       "reports one with no __syncthreads() before the read)",
       rt.kernel_name, flags & kAtomic ? "an atomic access" : "a read", n, off, what, w, tag);
}

// A read (or an atomic, which reads first, except an exchange) of which no byte was written.
// One that is partly written passes: a struct copied whole reads its padding and the fields
// nobody set, a float4 its unused .w.
inline void track_shared_write(const Region& r, char* a, size_t n, int flags, uint64_t pc) {
  unsigned char* m = r.written + (a - r.data);
  if (!(flags & kWrite) || (flags & (kAtomic | kExchange)) == kAtomic) {
    size_t k = 0;
    while (k < n && !m[k]) ++k;
    if (k == n) unwritten_shared(r, a, n, flags & ~kExchange, pc);
  }
  if (flags & kWrite) memset(m, 1, n);
}

// ---- __restrict__ arguments that alias, non-coherent loads of bytes the launch writes ----------
int restrict_of(int param) { return param >= 0 && rt.la->restrict_ ? rt.la->restrict_[param] : 0; }

void track_alloc(Region& r) {
  r.track = (uint16_t*)calloc(r.nbytes ? r.nbytes : 1, sizeof(uint16_t));
  if (!r.track) fail("emulator: cannot allocate %zu bytes to track an array's accesses", r.nbytes * 2);
}

[[noreturn]] void report_alias(const Region& p, size_t off, uint16_t t, int x, int y, int flags,
                               uint64_t pc) {
  char w[128], tag[48], ax[64], ay[64];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  int px = p.members[x], py = p.members[y];
  int rx = restrict_of(px), ry = restrict_of(py);
  snprintf(ax, sizeof ax, "argument %d (%zu bytes)", px, p.nbytes);
  snprintf(ay, sizeof ay, "argument %d (%zu bytes)", py, p.nbytes);
  const char* decl = rx && ry ? "both are declared __restrict__" :
                     rx ? "the first is declared __restrict__" : "the second is declared __restrict__";
  fail("kernel '%s': %s and %s are the same array, but %s (the compiler may assume they do not "
       "alias: keep a value it wrote through one in a register, or load it through the read-only "
       "non-coherent cache): byte offset %zu (element %zu of %zu) is %s through argument %d and "
       "%s through argument %d (this access: a %s in %s%s). Undefined behaviour on a GPU: pass "
       "distinct arrays, or drop __restrict__", rt.kernel_name, ax, ay, decl, off,
       off / p.itemsize, p.nbytes / p.itemsize, t & (kTrackWrite << x) ? "written" : "read", px,
       t & (kTrackWrite << y) ? "written" : "read", py,
       flags & kAtomic ? "atomic access" : flags & kWrite ? "write" : "read", w, tag);
}

[[noreturn]] void report_nc(const Region& p, size_t off, uint16_t t, int flags, uint64_t pc) {
  char w[128], tag[48], what[192], how[160];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  describe_region(what, sizeof what, p);
  if (t & kTrackLdg) {
    snprintf(how, sizeof how, "loaded through __ldg");
  } else {
    int param = -1;
    for (int m = 0; m < kGroup; ++m)
      if (p.members[m] >= 0 && restrict_of(p.members[m]) == 2 && (t & (kTrackRead << m))) param = p.members[m];
    if (param < 0 && restrict_of(p.index) == 2) param = p.index;
    snprintf(how, sizeof how, "read through argument %d, a const __restrict__ parameter (which a "
             "GPU may load as __ldg does)", param);
  }
  fail("kernel '%s': byte offset %zu (element %zu of %zu) of %s is %s and also written in this "
       "launch (this access: a %s in %s%s): the read-only non-coherent cache may return the value "
       "from before the write, as data loaded through it must not change during the kernel",
       rt.kernel_name, off, off / p.itemsize, p.nbytes / p.itemsize, what, how,
       flags & kAtomic ? "atomic access" : flags & kWrite ? "write" : flags & kNC ? "__ldg read" : "read",
       w, tag);
}

// An access to an array whose accesses are tracked, or through a mirror: returns the region that
// holds the memory (the group's first), `a` moved into it.
__attribute__((noinline)) Region* tracked_access(Region* r, char*& a, size_t n, int flags, uint64_t pc) {
  int member = r->member;
  int param = r->kind == kArg ? r->index : -1;
  if (r->mirror >= 0) {
    Region* p = &rt.regions[r->mirror];
    a = p->data + (a - r->data);
    r = p;
  }
  bool write = flags & (kWrite | kAtomic);
  uint16_t add = (uint16_t)(kTrackRead << member);
  if (write) add |= (uint16_t)((kTrackWrite << member) | kTrackWritten);
  else if (flags & kNC) add |= kTrackLdg;
  else if (restrict_of(param) == 2) add |= kTrackConst;
  if (!r->track) {
    if (!(add & kTrackLdg) || (r->kind != kArg && r->kind != kTarget)) return r;
    track_alloc(*r);          // an __ldg the source did not show: writes before it were not seen
  }
  uint16_t* t = r->track + (a - r->data);
  for (size_t k = 0; k < n; ++k) {
    uint16_t old = t[k], now = old | add;
    if (now == old) continue;
    t[k] = now;
    size_t off = (size_t)(a - r->data) + k;
    for (int x = 0; x < kGroup && r->members[1] >= 0; ++x) {
      if (!(now & (kTrackRead << x))) continue;
      for (int y = x + 1; y < kGroup; ++y) {
        if (!(now & (kTrackRead << y)) || !(now & ((kTrackWrite << x) | (kTrackWrite << y)))) continue;
        if (restrict_of(r->members[x]) || restrict_of(r->members[y])) report_alias(*r, off, now, x, y, flags, pc);
      }
    }
    if ((now & kTrackWritten) && (now & (kTrackLdg | kTrackConst))) report_nc(*r, off, now, flags, pc);
  }
  return r;
}

__attribute__((noinline)) void checked_access(char* a, size_t n, int flags, uint64_t pc) {
  int id = region_at(a);
  if (id < 0) out_of_bounds(a, n, flags, pc, "SIGSEGV");
  Region* rp = &rt.regions[id];
  if (a < rp->data || a + n > rp->data + rp->nbytes) out_of_bounds(a, n, flags, pc, "SIGSEGV");
  if (rt.far_mode) far_note(id, (size_t)(a - rp->data), n, flags, pc);
  if (rp->track || rp->mirror >= 0 || (flags & kNC)) rp = tracked_access(rp, a, n, flags, pc);
  Region& r = *rp;
  if (r.written && rt.running) track_shared_write(r, a, n, flags, pc);
  flags &= ~(kExchange | kNC);
  if (rt.counting) count_access(r, n, flags);
  if (rt.race && rt.running) {
    race_access(r, a, n, flags, pc);
    if ((flags & (kVolatile | kAtomic)) == kVolatile && (r.kind == kArg || r.kind == kTarget))
      sync_atomic((uintptr_t)a, !(flags & kWrite), flags & kWrite);
  }
}

// Memory outside the arena that instrumented code may touch: the module's own image (its
// __device__/__constant__ variables, the emulation header's globals), the blocks' fiber stacks
// (locals, by-value arguments) and their threads (threadIdx, blockIdx). Anything else is memory a GPU kernel would not have
// been given: a host address passed as an integer, or a pointer-table word the emulator did not
// translate (an allocation it does not know).
struct Span { uintptr_t lo, hi; };
std::vector<Span> image_spans;

int add_image_span(struct dl_phdr_info* info, size_t, void*) {
  if (info->dlpi_addr != module_base()) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD || ph.p_type == PT_TLS)
      image_spans.push_back({info->dlpi_addr + ph.p_vaddr, info->dlpi_addr + ph.p_vaddr + ph.p_memsz});
  }
  return 1;
}

bool in_image(uintptr_t a) {
  if (image_spans.empty()) dl_iterate_phdr(add_image_span, nullptr);
  for (const Span& sp : image_spans)
    if (a >= sp.lo && a < sp.hi) return true;
  return false;
}

enum { kNotOwn = 0, kThreadMemory = 1, kModuleMemory = 2 };

// Whose memory outside the arena `a` is: a thread's (its stack, threadIdx), the module's own
// (its variables), or none the kernel was given.
int own_memory(uintptr_t a) {
  for (unsigned s = 0; s < kMaxSlots; ++s) {
    const Block& b = rt.slots[s];
    if (b.stacks && a - (uintptr_t)b.stacks < b.stacks_len) return kThreadMemory;
    if (b.fibers && a - (uintptr_t)b.fibers < b.cap * sizeof(Fiber)) return kThreadMemory;
  }
  return in_image(a) ? kModuleMemory : kNotOwn;
}

// Before the kernel writes `n` bytes of the module's own memory at `a`: their values from
// before the launch are kept, for the runs after the first (restore_module_bytes).
void save_module_bytes(const char* a, size_t n) {
  for (size_t i = 0; i < n; ++i)
    rt.module_bytes.emplace((uintptr_t)(a + i), (unsigned char)a[i]);
}

void restore_module_bytes() {
  for (const auto& kv : rt.module_bytes) *(unsigned char*)kv.first = kv.second;
}

__attribute__((noinline)) void foreign_access(char* a, size_t n, int flags, uint64_t pc) {
  if (!rt.running) return;
  if (int own = own_memory((uintptr_t)a)) {
    if (own == kModuleMemory && (flags & kWrite)) save_module_bytes(a, n);
    if (rt.far_mode) far_note(-1, 0, n, flags, pc);
    return;
  }
  if (rt.far_mode == kFarCompare) far_diverged(0, n, flags, pc);
  char w[128], tag[48];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  fail("kernel '%s': %s of %zu bytes at address %p in %s%s: memory the launch did not give the "
       "kernel (not an argument, an allocation a pointer table points into, shared memory, a "
       "local or a module variable): an address passed as an integer, a pointer computed far "
       "out of an array, or a pointer-table word the emulator did not translate (an allocation "
       "made before chainer_tc.testing.emulator was imported is not known to it)",
       rt.kernel_name, flags & kAtomic ? "an atomic access" : flags & kWrite ? "a write" : "a read",
       n, (void*)a, w, tag);
}

void yield();

inline void access(void* p, size_t n, int flags, void* pc) {
  if ((size_t)((char*)p - rt.arena) >= rt.arena_size) {          // not kernel memory
    foreign_access((char*)p, n, flags, (uint64_t)pc);
    return;
  }
  // The random schedules let other threads run before a volatile access, as before an atomic:
  // volatile orders nothing between threads, so a read-modify-write through it (a counter, a
  // flag and data without a fence) loses updates on a GPU, and here under some schedule.
  if ((flags & kVolatile) && rt.yield_atomics && rt.running) yield();
  checked_access((char*)p, n, flags, (uint64_t)pc);
}

// ---- flushing subnormals (-ftz=true) -------------------------------------------------------------
// The floating-point control register's flush bits: kernel code runs with them set when the launch
// asks for -ftz, and with them clear otherwise, whatever the caller's thread had. They flush
// float32 and float64 alike (a GPU flushes only float32); __half arithmetic is done in float on
// values that are normal there, so it keeps its subnormals, as a GPU's does.
#if defined(__x86_64__) || defined(__i386__)
const unsigned long kFlushBits = 0x8040;          // MXCSR: FTZ (bit 15), DAZ (bit 6)
unsigned long read_fp_mode() { unsigned m; __asm__ volatile("stmxcsr %0" : "=m"(m)); return m; }
void write_fp_mode(unsigned long m) { unsigned v = (unsigned)m; __asm__ volatile("ldmxcsr %0" : : "m"(v)); }
#elif defined(__aarch64__)
const unsigned long kFlushBits = 1ul << 24;       // FPCR.FZ
unsigned long read_fp_mode() { unsigned long m; __asm__ volatile("mrs %0, fpcr" : "=r"(m)); return m; }
void write_fp_mode(unsigned long m) { __asm__ volatile("msr fpcr, %0" : : "r"(m)); }
#else
const unsigned long kFlushBits = 0;
unsigned long read_fp_mode() { return 0; }
void write_fp_mode(unsigned long) {}
#endif

// ---- fibers and the scheduler ----------------------------------------------------------------
__attribute__((noinline)) void resume(Fiber* f) {
  rt.running = f;
  cur = f;
  if (_setjmp(rt.sched)) return;
  if (f->started) _longjmp(f->jb, 1);
  f->started = true;
  setcontext(&f->ctx);
}

__attribute__((noinline)) void yield() {
  Fiber* f = rt.running;
  if (!_setjmp(f->jb)) _longjmp(rt.sched, 1);
}

// Completed by the last live thread to arrive, or by the return of the last one missing.
void release_block_barrier(Block* b) {
  b->bar_count = b->bar_acc;
  b->bar_total = (int)b->bar_arrived;
  b->bar_arrived = 0;
  b->bar_acc = 0;
  if (rt.race) {                    // fences before this barrier are sealed; knowledge is shared
    int gen = 1 << 30;
    uint32_t count = 0xffffffffu;
    VC* grown = nullptr;
    for (unsigned i = 0; i < rt.nthreads; ++i) {
      Fiber& f = b->fibers[i];
      if (f.last_fence >= 0) {
        f.sealed_fence = f.last_fence;
        f.sealed_fences = f.fences;           // its count after its last fence
      }
      if (f.sealed_fence < gen) gen = f.sealed_fence;
      if (f.sealed_fences < count) count = f.sealed_fences;
      if (f.known && f.known_grew) {       // a new VC: fence_known pointers keep the old one
        if (!grown) join(grown, b->known);
        join(grown, f.known);
        f.known_grew = false;
      }
      if (f.pending) { join(b->pending, f.pending); f.pending = nullptr; }
      for (const Seen& s : f.seen) note_seen(b->seen, s.x, s.clock);
    }
    if (grown) b->known = grown;
    b->sealed_gen = gen;
    b->sealed_fences = count;
  }
  b->bar_gen++;
}

Warp& my_warp() { return rt.running->blk->warps[rt.running->warp]; }

const char* op_name(unsigned char op) {
  return op == kShfl ? "a shuffle" : op == kVote ? "a vote (__ballot/__any/__all_sync)" : "__syncwarp";
}

[[noreturn]] void bad_shuffle(Block* b, Warp& w, unsigned k, unsigned src) {
  char msg[160];
  int n = snprintf(msg, sizeof msg, "warp shuffle reads lane %u, which ", src);
  if (!(w.mask[k] >> src & 1u)) snprintf(msg + n, sizeof msg - n, "is not in mask 0x%08x", w.mask[k]);
  else if (w.lanes >> src & 1u) snprintf(msg + n, sizeof msg - n, "has exited");
  else snprintf(msg + n, sizeof msg - n, "does not exist (this warp has %d lanes: blockDim %u)",
                __builtin_popcount(w.lanes), rt.nthreads);
  rt.running = &b->fibers[(&w - b->warps) * 32 + k];
  fail_here(msg);
}

void try_complete(Block* b, Warp& w, unsigned l) {
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
      if (!(m >> src & 1u)) bad_shuffle(b, w, k, src);
      w.result[k] = w.slot[src];
    }
  } else if (w.op[l] == kVote) {
    u64 ballot = 0;
    for (unsigned k = 0; k < 32; ++k)
      if ((m >> k & 1u) && w.slot[k]) ballot |= 1u << k;
    for (unsigned k = 0; k < 32; ++k)
      if (m >> k & 1u) w.result[k] = ballot | (u64)m << 32;
  } else {
    w.sync_count++;
    if (rt.race)
      for (unsigned a = 0; a < 32; ++a)
        if (m >> a & 1u)
          for (unsigned k = 0; k < 32; ++k)
            if (m >> k & 1u) w.met[a][k] = w.sync_count;
  }
  w.arrived &= ~m;
}

void fiber_main() {
  write_fp_mode(rt.fp_kernel);       // setcontext loaded the mode getcontext saw
  rt.body(rt.body_ctx);
  Fiber* f = rt.running;
  Block* b = f->blk;
  Warp& w = b->warps[f->warp];
  f->done = true;
  b->live--;
  w.live &= ~(1u << f->lane);
  for (unsigned l = 0; l < 32; ++l)
    if (w.arrived >> l & 1u) try_complete(b, w, l);
  if (b->bar_arrived && b->bar_arrived >= b->live) release_block_barrier(b);
  _longjmp(rt.sched, 1);
}

void ensure_stacks(Block& b, unsigned n) {
  if (n <= b.cap) return;
  if (b.stacks) munmap(b.stacks, b.stacks_len);
  delete[] b.fibers;
  b.stacks = nullptr;
  b.fibers = nullptr;
  b.cap = 0;
  const char* env = getenv("CHAINER_TC_EMULATOR_STACK_KB");
  size_t kb = env ? strtoul(env, nullptr, 10) : 128;
  if (kb < 16) kb = 16;
  rt.stack_bytes = round_up(kb * 1024, rt.page);
  b.stacks_len = (size_t)n * (rt.stack_bytes + rt.page);
  void* m = mmap(nullptr, b.stacks_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) fail("emulator: cannot map %zu bytes of fiber stacks", b.stacks_len);
  b.stacks = (char*)m;
  b.fibers = new Fiber[n];
  for (unsigned i = 0; i < n; ++i) {
    mprotect(b.stacks + (size_t)i * (rt.stack_bytes + rt.page), rt.page, PROT_NONE);
    getcontext(&b.fibers[i].ctx);
  }
  b.cap = n;
}

void fill_shared(Block& b) {
  if (b.dyn >= 0) {
    Region& r = rt.regions[b.dyn];
    memset(r.data, kUninit, r.nbytes);
    memset(r.written, 0, r.nbytes);
    reset_shadow(r);
  }
  for (int id : b.svar) {
    if (id < 0) continue;
    Region& r = rt.regions[id];
    memset(r.data, kUninit, r.nbytes);
    memset(r.written, 0, r.nbytes);
    reset_shadow(r);
  }
}

void start_block(Block& b, u64 seq) {
  unsigned bx = block_dim.x, by = block_dim.y;
  b.active = true;
  b.seq = (uint32_t)seq;
  b.idx.x = (unsigned)(seq % grid_dim.x);
  b.idx.y = (unsigned)((seq / grid_dim.x) % grid_dim.y);
  b.idx.z = (unsigned)(seq / ((u64)grid_dim.x * grid_dim.y));
  b.live = rt.nthreads;
  b.bar_arrived = 0;
  b.bar_acc = 0;
  b.bar_gen = 0;
  b.cursor = 0;
  b.ran = false;
  b.order.clear();
  b.sealed_gen = -1;
  b.sealed_fences = 0;
  b.known = b.pending = nullptr;
  b.seen.clear();
  for (unsigned w = 0; w < kMaxWarps; ++w) {
    b.warps[w].live = b.warps[w].arrived = 0;
    b.warps[w].sync_count = 0;
    if (rt.race && w * 32 < rt.nthreads) memset(b.warps[w].met, 0, sizeof b.warps[w].met);
  }
  for (unsigned i = 0; i < rt.nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.tid.x = i % bx;
    f.tid.y = (i / bx) % by;
    f.tid.z = i / (bx * by);
    f.bid = b.idx;
    f.lane = i % 32;
    f.warp = i / 32;
    f.linear = i;
    f.blk = &b;
    f.done = false;
    f.at_bar = false;
    f.last_fence = f.sealed_fence = -1;
    f.fences = f.sealed_fences = 0;
    f.known = f.pending = f.fence_known = nullptr;
    f.seen.clear();
    f.depth = 0;
    f.known_grew = false;
    b.warps[f.warp].live |= 1u << f.lane;
    f.ctx.uc_stack.ss_sp = b.stacks + (size_t)i * (rt.stack_bytes + rt.page) + rt.page;
    f.ctx.uc_stack.ss_size = rt.stack_bytes;
    f.ctx.uc_link = nullptr;
    f.started = false;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (unsigned w = 0; w < kMaxWarps; ++w) b.warps[w].lanes = b.warps[w].live;
  fill_shared(b);
}

bool runnable(const Fiber& f) {
  if (f.done) return false;
  if (f.at_bar && f.bar_gen == f.blk->bar_gen) return false;
  if (f.blk->warps[f.warp].arrived >> f.lane & 1u) return false;
  return true;
}

[[noreturn]] void deadlock(Block& b) {
  unsigned at_warp = 0;
  for (unsigned w = 0; w < kMaxWarps; ++w) at_warp += __builtin_popcount(b.warps[w].arrived);
  rt.running = nullptr;
  cur = nullptr;
  fail("kernel '%s': deadlock in block (%u,%u,%u): %u live threads, %u waiting at __syncthreads, "
       "%u in warp collectives (a barrier not reached by every thread of the block, or a warp "
       "collective whose mask names lanes that never arrive)",
       rt.kernel_name, b.idx.x, b.idx.y, b.idx.z, b.live, b.bar_arrived, at_warp);
}

uint64_t next_random(uint64_t& s) {           // splitmix64
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void free_vcs() {
  for (VC* v : rt.vcs) {
    free(v->c);
    delete v;
  }
  rt.vcs.clear();
  rt.sync.clear();
  rt.seen_at.clear();
  rt.atomic_clock = 0;
}

// One full round of a block in thread order (forward) or reverse order: resume every thread that
// can run. Returns whether any ran.
bool round_in_order(Block& b, bool reverse) {
  bool ran = false;
  for (unsigned k = 0; k < rt.nthreads; ++k) {
    Fiber& f = b.fibers[reverse ? rt.nthreads - 1 - k : k];
    if (!runnable(f)) continue;
    ran = true;
    resume(&f);
  }
  rt.running = nullptr;
  cur = nullptr;
  return ran;
}

void run_grid(const Schedule& s) {
  rt.schedule = &s;
  if (rt.race) rt.releases.assign(rt.nblocks, 0);
  rt.yield_atomics = s.kind == Schedule::kRandom;
  u64 n = rt.nblocks;
  if (s.kind != Schedule::kRandom) {
    Block& b = rt.slots[0];
    for (u64 i = 0; i < n; ++i) {
      start_block(b, s.kind == Schedule::kReverse ? n - 1 - i : i);
      while (b.live) {
        if (!round_in_order(b, s.kind == Schedule::kReverse)) deadlock(b);
      }
      b.active = false;
    }
    return;
  }
  uint64_t rng = s.seed;
  std::vector<uint32_t> perm;
  bool permute = n <= (1u << 24);
  if (permute) {
    perm.resize(n);
    for (u64 i = 0; i < n; ++i) perm[i] = (uint32_t)i;
    for (u64 i = n; i > 1; --i) std::swap(perm[i - 1], perm[next_random(rng) % i]);
  }
  unsigned k = n < kMaxSlots ? (unsigned)n : kMaxSlots;
  u64 next = 0;
  unsigned active = 0;
  for (;;) {
    for (unsigned i = 0; i < k; ++i) {
      Block& b = rt.slots[i];
      if (!b.active && next < n) {
        start_block(b, permute ? perm[next] : next);
        next++;
        active++;
      }
    }
    if (!active) return;
    unsigned pick = (unsigned)(next_random(rng) % active);
    Block* b = nullptr;
    for (unsigned i = 0; i < k; ++i)
      if (rt.slots[i].active && pick-- == 0) { b = &rt.slots[i]; break; }
    if (b->cursor == 0) {                   // a new round: a new order
      b->order.resize(rt.nthreads);
      for (unsigned i = 0; i < rt.nthreads; ++i) b->order[i] = i;
      for (unsigned i = rt.nthreads; i > 1; --i) std::swap(b->order[i - 1], b->order[next_random(rng) % i]);
      b->ran = false;
    }
    // resume the next thread of this round that can run
    while (b->cursor < rt.nthreads) {
      Fiber& f = b->fibers[b->order[b->cursor++]];
      if (!runnable(f)) continue;
      b->ran = true;
      resume(&f);
      rt.running = nullptr;
      cur = nullptr;
      break;
    }
    if (b->cursor == rt.nthreads) {
      b->cursor = 0;
      if (!b->live) {
        b->active = false;
        active--;
      } else if (!b->ran) {
        deadlock(*b);
      }
    }
  }
}

// ---- fault handling ------------------------------------------------------------------------------
uint64_t fault_pc(void* uctx) {
#if defined(__x86_64__)
  return (uint64_t)((ucontext_t*)uctx)->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
  return (uint64_t)((ucontext_t*)uctx)->uc_mcontext.pc;
#else
  (void)uctx;
  return 0;
#endif
}

void on_fault(int sig, siginfo_t* info, void* uctx) {
  if (!rt.in_launch || !pthread_equal(pthread_self(), rt.launch_thread)) {
    struct sigaction* old = sig == SIGSEGV ? &rt.old_segv : sig == SIGBUS ? &rt.old_bus : &rt.old_fpe;
    sigaction(sig, old, nullptr);
    return;   // the faulting instruction runs again and reaches the old handler
  }
  uint64_t pc = fault_pc(uctx);
  char w[128], tag[48];
  where(w, sizeof w);
  pc_tag(tag, sizeof tag, pc);
  if (sig == SIGFPE) {
    (void)info;     // x86 reports INT_MIN / -1 as FPE_INTDIV too
    snprintf(rt.err, kErrLen, "kernel '%s': integer division by zero or overflow (INT_MIN / -1): "
             "SIGFPE in %s%s", rt.kernel_name, w, tag);
    siglongjmp(rt.jmp, 1);
  }
  char* a = (char*)info->si_addr;
  for (unsigned s = 0; s < kMaxSlots; ++s) {
    Block& b = rt.slots[s];
    if (b.stacks && a >= b.stacks && a < b.stacks + b.stacks_len) {
      snprintf(rt.err, kErrLen,
               "kernel '%s': stack overflow of an emulated thread in %s%s (raise "
               "CHAINER_TC_EMULATOR_STACK_KB, now %zu)", rt.kernel_name, w, tag, rt.stack_bytes / 1024);
      siglongjmp(rt.jmp, 1);
    }
  }
  out_of_bounds(a, 0, 0, pc, sig == SIGSEGV ? "SIGSEGV" : "SIGBUS");
}

void install_fault_handler() {
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
  sigaction(SIGFPE, &sa, &rt.old_fpe);
}

void restore_fault_handler() {
  sigaction(SIGSEGV, &rt.old_segv, nullptr);
  sigaction(SIGBUS, &rt.old_bus, nullptr);
  sigaction(SIGFPE, &rt.old_fpe, nullptr);
  sigaltstack(&rt.old_altstack, nullptr);
}

// ---- launching -----------------------------------------------------------------------------------
int parse_schedules(const char* text, Schedule* out, int max) {
  int n = 0;
  const char* p = text && *text ? text : "forward";
  while (*p && n < max) {
    const char* e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    Schedule& s = out[n];
    snprintf(s.name, sizeof s.name, "%.*s", (int)(len < 31 ? len : 31), p);
    s.seed = 0;
    if (!strcmp(s.name, "forward")) s.kind = Schedule::kForward;
    else if (!strcmp(s.name, "reverse")) s.kind = Schedule::kReverse;
    else if (!strncmp(s.name, "random", 6)) {
      s.kind = Schedule::kRandom;
      s.seed = s.name[6] == ':' ? strtoull(s.name + 7, nullptr, 10) : 0;
    } else {
      fail("emulator: unknown schedule '%s' (forward, reverse, random:<seed>)", s.name);
    }
    n++;
    p += len;
    if (*p == ',') ++p;
  }
  return n;
}

void copy_inputs(const LaunchArgs* la) {
  for (int i = 0; i < la->nargs; ++i) {
    int id = rt.arg_region[i];
    if (id < 0 || la->alias[i] >= 0) continue;
    Region& r = rt.regions[id];
    if (r.nbytes) memcpy(r.data, (const void*)r.host, r.nbytes);
  }
  for (int t = 0; t < la->ntargets; ++t) {
    if (la->target_arg[t] >= 0) continue;
    Region& r = rt.regions[rt.target_region[t]];
    if (r.nbytes) memcpy(r.data, (const void*)r.host, r.nbytes);
  }
  for (Slot& s : rt.slots_) {      // words inside array arguments point into the copies
    int id = rt.arg_region[s.arg];
    if (id >= 0) memcpy(rt.regions[id].data + s.offset, &s.translated, 8);
  }
}

// Words of pointer tables: the address of the target's copy instead of the host array.
void map_tables(const LaunchArgs* la, void** vals) {
  rt.target_region.assign(la->ntargets, -1);
  for (int t = 0; t < la->ntargets; ++t) {
    if (la->target_arg[t] >= 0) {
      rt.target_region[t] = rt.arg_region[la->target_arg[t]];
      continue;
    }
    int id = new_region(la->target_nbytes[t], 1, kTarget, t, -1);
    rt.regions[id].host = la->target_host[t];
    rt.regions[id].output = true;
    rt.target_region[t] = id;
  }
  rt.slots_.clear();
  for (int k = 0; k < la->nslots; ++k) {
    Slot s;
    s.arg = la->slot_arg[k];
    s.offset = la->slot_offset[k];
    s.target = la->slot_target[k];
    int aid = rt.arg_region[s.arg];
    const char* holder = aid >= 0 ? (const char*)rt.regions[aid].host : (const char*)vals[s.arg];
    memcpy(&s.original, holder + s.offset, 8);
    const Region& t = rt.regions[rt.target_region[s.target]];
    s.translated = (u64)(uintptr_t)t.data + (s.original - la->target_host[s.target]);
    if (aid < 0) memcpy((char*)vals[s.arg] + s.offset, &s.translated, 8);   // a value: patch it
    rt.slots_.push_back(s);
  }
}

struct Snapshot {
  int region;
  std::vector<char> bytes;
};

// Table words inside array arguments get their host values back (those the kernel left as
// translated): before results are compared between runs, and before the copy back.
// A word the kernel moved (a double buffer's two addresses swapped) goes back to the host
// address of the allocation it now points into.
void untranslate_tables() {
  for (const Slot& s : rt.slots_) {
    int id = rt.arg_region[s.arg];
    if (id < 0) continue;
    u64 now;
    memcpy(&now, rt.regions[id].data + s.offset, 8);
    if (now == s.translated) {
      memcpy(rt.regions[id].data + s.offset, &s.original, 8);
      continue;
    }
    for (size_t t = 0; t < rt.target_region.size(); ++t) {
      const Region& r = rt.regions[rt.target_region[t]];
      u64 lo = (u64)(uintptr_t)r.data;
      if (now >= lo && now - lo <= r.nbytes) {           // (one past the end too)
        u64 host = rt.la->target_host[t] + (now - lo);
        memcpy(rt.regions[id].data + s.offset, &host, 8);
        break;
      }
    }
  }
}

// The results of a run against the first run's (`snaps`): under another schedule, or (`relaid`)
// the same one over an arena laid out anew (the far check).
void compare(const std::vector<Snapshot>& snaps, const Schedule& first, const Schedule& now,
             bool relaid = false) {
  for (const Snapshot& s : snaps) {
    const Region& r = rt.regions[s.region];
    if (!memcmp(r.data, s.bytes.data(), r.nbytes)) continue;
    size_t i = 0;
    while (r.data[i] == s.bytes[i]) ++i;
    size_t e = i / r.itemsize, is = r.itemsize > 16 ? 16 : r.itemsize;
    char what[192], ha[40], hb[40];
    describe_region(what, sizeof what, r);
    for (size_t k = 0; k < is; ++k) {
      snprintf(ha + 2 * k, 3, "%02x", (unsigned char)s.bytes[e * r.itemsize + k]);
      snprintf(hb + 2 * k, 3, "%02x", (unsigned char)r.data[e * r.itemsize + k]);
    }
    int key = r.kind == kArg ? r.index : -1;
    if (relaid)
      fail("kernel '%s': the result depends on where the launch's arrays lie: %s differs at byte "
           "offset %zu (element %zu of %zu): {hex:%d:%s} with them about 2^%u bytes apart, "
           "{hex:%d:%s} with them about 2^%u bytes apart, under schedule %s (an address used as "
           "a value, or computed from the distance between two arrays: the emulator's far "
           "check)", rt.kernel_name, what, e * r.itemsize, e,
           r.nbytes / r.itemsize, key, ha, rt.far_shift[0] + 1, key, hb, rt.far_shift[1] + 1,
           now.name);
    fail("kernel '%s': the result depends on the order in which threads run: %s differs at byte "
         "offset %zu (element %zu of %zu): {hex:%d:%s} under schedule %s, {hex:%d:%s} under schedule "
         "%s (a missing __syncthreads() or __threadfence(), a race, or an atomic whose order "
         "matters, such as a float atomicAdd)", rt.kernel_name, what, e * r.itemsize, e,
         r.nbytes / r.itemsize, key, ha, first.name, key, hb, now.name);
  }
}

void check_canaries() {
  for (const Region& r : rt.regions) {
    size_t bad = slack_damage(r);
    if (!bad) continue;
    char what[192];
    describe_region(what, sizeof what, r);
    fail("kernel '%s': out-of-bounds write to %s: %zu bytes changed before its start or after its "
         "end (seen after the launch: an access the checks did not see, such as a memcpy)",
         rt.kernel_name, what, bad);
  }
}

void reset_for_schedule(const LaunchArgs* la) {
  copy_inputs(la);
  restore_module_bytes();
  for (Region& r : rt.regions) {
    fill_slack(r);
    reset_shadow(r);
    if (r.track) memset(r.track, 0, (r.nbytes ? r.nbytes : 1) * sizeof(uint16_t));
  }
  free_vcs();
}

// Whether the arguments given the array of parameter `first` (its first) include a __restrict__ one.
bool restrict_group(const LaunchArgs* la, int first) {
  if (!la->restrict_) return false;
  for (int k = first; k < la->nargs; ++k)
    if ((k == first || la->alias[k] == first) && la->restrict_[k]) return true;
  return false;
}

// A region for parameter `param` that maps the memory of region `first` (the array's first
// parameter) at another address, so that an access says which parameter it went through.
int new_mirror(int first, int param, const LaunchArgs* la) {
  if (!rt.regions[first].shared_map) {
    Region& p = rt.regions[first];
    int fd = memfd_create("chainer_tc_emulator_alias", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)p.span) != 0)
      fail("emulator: cannot create shared memory for an argument passed twice");
    if (mmap(p.pages, p.span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED)
      fail("emulator: cannot map shared memory for an argument passed twice");
    p.shared_map = true;
    p.mirror_fd = fd;
    fill_slack(p);
  }
  const Region& p0 = rt.regions[first];
  int id = new_region(p0.nbytes, p0.itemsize, kArg, param, -1, (size_t)(p0.data - p0.pages));
  Region& m = rt.regions[id];
  Region& p = rt.regions[first];
  if (mmap(m.pages, m.span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p.mirror_fd, 0) == MAP_FAILED)
    fail("emulator: cannot map shared memory for an argument passed twice");
  m.mirror = first;
  m.host = p.host;
  int k = 1;
  while (k < kGroup - 1 && p.members[k] >= 0) ++k;
  m.member = k;
  if (p.members[k] < 0) p.members[k] = param;
  if (!p.track) track_alloc(p);
  (void)la;
  return id;
}

}  // namespace

void* dyn_smem() {
  Block* b = rt.running->blk;
  if (b->dyn < 0) fail_here("extern __shared__ memory used but the launch asked for shared_mem=0");
  return rt.regions[b->dyn].data;
}

void* shared_var(int* slot, usize size, usize itemsize, const char* name, const char* signature) {
  if (*slot < 0) {
    *slot = (int)rt.vars.size();
    SharedVar v;
    v.size = size;
    v.itemsize = itemsize ? itemsize : 1;
    v.name = name;
    v.launch = 0;
    // "... [with T = double [8][32]; int ID = 3000]" -> "double [8][32]"
    const char* t = strstr(signature, "[with T = ");
    const char* e = t ? strstr(t, "; int ID") : nullptr;
    if (t && e) snprintf(v.type, sizeof v.type, "%.*s", (int)(e - t - 10), t + 10);
    else snprintf(v.type, sizeof v.type, "?");
    rt.vars.push_back(v);
  }
  SharedVar& v = rt.vars[*slot];
  if (v.launch != rt.launch_id) {
    v.launch = rt.launch_id;
    rt.static_shared += size;
    for (unsigned s = 0; s < rt.kslots; ++s) {
      Block& b = rt.slots[s];
      if (b.svar.size() < rt.vars.size()) b.svar.resize(rt.vars.size(), -1);
      int id = new_region(size, v.itemsize, kShared, *slot, (int)s);
      memset(rt.regions[id].data, kUninit, size);
      b.svar[*slot] = id;
    }
    char list[512];
    size_t n = 0;
    list[0] = 0;
    for (const SharedVar& u : rt.vars)
      if (u.launch == rt.launch_id && n < sizeof list - 80)
        n += snprintf(list + n, sizeof list - n, "%s'%s' (%s, %zu bytes)", n ? ", " : "", u.name, u.type, (size_t)u.size);
    if (rt.static_shared > kMaxStaticShared)
      fail("kernel '%s': %zu bytes of static __shared__ memory (%s); a block may have at most 48 KiB "
           "(49152 bytes) of it", rt.kernel_name, rt.static_shared, list);
    u64 total = rt.static_shared + rt.dyn_shared;
    if (rt.max_dyn_shared <= kMaxStaticShared ? total > kMaxStaticShared : total > kMaxDynamicOptIn)
      fail("kernel '%s': %zu bytes of static __shared__ memory (%s) plus shared_mem=%llu bytes of "
           "dynamic shared memory exceed the %d bytes a block may use (%s)", rt.kernel_name,
           rt.static_shared, list, (unsigned long long)rt.dyn_shared,
           rt.max_dyn_shared <= kMaxStaticShared ? kMaxStaticShared : kMaxDynamicOptIn,
           rt.max_dyn_shared <= kMaxStaticShared
               ? "48 KiB unless the kernel opts in through max_dynamic_shared_size_bytes"
               : "227 KiB, the most any GPU gives a block");
  }
  Block* b = rt.running->blk;
  return rt.regions[b->svar[*slot]].data;
}

void yield_now() {
  if (rt.running) yield();
}

void fence(int device_scope) {
  Fiber* f = rt.running;
  if (f && rt.race && device_scope) {
    f->last_fence = (int)f->blk->bar_gen;
    f->fences++;
    join(f->known, f->pending);
    join(f->known, f->blk->pending);
    f->pending = nullptr;
    f->known_grew = f->known != nullptr;
    f->fence_known = f->blk->known;
  }
  yield_now();
}

void nc_read(const void* p, usize size, const void* caller) {
  access(const_cast<void*>(p), size, kRead | kNC, const_cast<void*>(caller));
}

void atomic_access(void* p, usize size, const void* caller, int exchange) {
  if (rt.yield_atomics) yield_now();
  char* a = (char*)p;
  uint64_t pc = (uint64_t)caller;
  if ((size_t)(a - rt.arena) >= rt.arena_size) {     // a local or a module variable, or no memory
    foreign_access(a, size, kAtomic | kWrite, pc);
    return;
  }
  checked_access(a, size, kAtomic | kWrite | (exchange ? kExchange : 0), pc);
  if (rt.race && rt.running) {
    const Region& r = rt.regions[region_at(a)];
    if (r.kind == kArg || r.kind == kTarget) sync_atomic((uintptr_t)a);
  }
}

// Threads of one block at two different __syncthreads() (by source line): the condition around a
// barrier differed between them, which CUDA leaves undefined (a GPU may let them pass each other
// or hang); here the barrier would simply have matched them up.
// `via`: the calls that differ, when the line is the same (a helper called from two places).
[[noreturn]] void divergent_barrier(const Block* b, const char* file, unsigned line,
                                    uintptr_t mine = 0, uintptr_t theirs = 0) {
  char first[128], msg[1024], tm[48] = "", tt[48] = "";
  thread_of(first, sizeof first, b->seq, b->bar_tid);
  if (mine || theirs) {        // return addresses: the call is the byte before
    pc_tag(tm, sizeof tm, mine ? mine - 1 : 0);
    pc_tag(tt, sizeof tt, theirs ? theirs - 1 : 0);
    snprintf(msg, sizeof msg, "threads of one block wait at two different __syncthreads(): this "
             "thread at %s:%u reached through the call%s, %s at %s:%u reached through the call%s "
             "(one __syncthreads() in a function called from two places, or two on one line, "
             "in divergent code: every thread of the block must reach the same call, or none)", file, line, tm,
             first, b->bar_file, b->bar_line, tt);
  } else {
    snprintf(msg, sizeof msg, "threads of one block wait at two different __syncthreads(): this "
             "thread at %s:%u, %s at %s:%u (a barrier in divergent code: every thread of the block "
             "must reach the same one, or none)", file, line, first, b->bar_file, b->bar_line);
  }
  fail_here(msg);
}

// The return addresses of a thread's frames from the __syncthreads() function's up, as far as
// they are on its stack (the fiber's entry, in the runtime, keeps no frame pointer).
void walk_frames(Fiber* f, const void* frame) {
  uintptr_t lo = (uintptr_t)f->ctx.uc_stack.ss_sp, hi = lo + f->ctx.uc_stack.ss_size;
  const uintptr_t* fp = (const uintptr_t*)frame;
  unsigned d = 0;
  while (d < kCallDepth && (uintptr_t)fp >= lo && (uintptr_t)fp + 16 <= hi && !((uintptr_t)fp & 7)) {
    f->calls[d++] = fp[1];
    const uintptr_t* up = (const uintptr_t*)fp[0];
    if (up <= fp) break;
    fp = up;
  }
  f->depth = d;
}

// The same source line: the same call of it, through the same calls? Compared from the outermost
// frame in; the first thread to arrive still waits there, its frames as they were.
void same_call(const Block* b, const Fiber* f, const char* file, unsigned line) {
  const Fiber& g = b->fibers[b->bar_tid];
  unsigned n = std::min(f->depth, g.depth);
  for (unsigned k = 1; k <= n; ++k) {
    uintptr_t mine = f->calls[f->depth - k], theirs = g.calls[g.depth - k];
    if (mine != theirs) divergent_barrier(b, file, line, mine, theirs);
  }
  if (f->depth != g.depth)
    divergent_barrier(b, file, line, f->depth > n ? f->calls[f->depth - n - 1] : f->calls[0],
                      g.depth > n ? g.calls[g.depth - n - 1] : g.calls[0]);
}

int block_barrier(int pred, const char* file, unsigned line, const void* frame) {
  Fiber* f = rt.running;
  Block* b = f->blk;
  walk_frames(f, frame);
  if (!b->bar_arrived) {
    b->bar_file = file;
    b->bar_line = line;
    b->bar_tid = f->linear;
  } else if (line != b->bar_line || (file != b->bar_file && strcmp(file, b->bar_file) != 0)) {
    divergent_barrier(b, file, line);
  } else {
    same_call(b, f, file, line);
  }
  b->bar_acc += pred ? 1 : 0;
  if (++b->bar_arrived >= b->live) {
    release_block_barrier(b);
  } else {
    f->at_bar = true;
    f->bar_gen = b->bar_gen;
    while (f->bar_gen == b->bar_gen) yield();
    f->at_bar = false;
  }
  return b->bar_count;      // not overwritten before this thread reaches the next barrier
}

int barrier_total() { return rt.running->blk->bar_total; }

u64 warp_collective(unsigned char op, unsigned mask, u64 value, int src) {
  Fiber* f = rt.running;
  Block* b = f->blk;
  Warp& w = b->warps[f->warp];
  unsigned lane = f->lane, bit = 1u << lane;
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
  try_complete(b, w, lane);
  while (w.arrived & bit) yield();
  return w.result[lane];
}

unsigned active_mask() { return my_warp().live; }

void check_width(int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail_here("warp shuffle width must be a power of 2 in [1, 32]");
}

namespace {
// Lays the launch's memory out in a fresh arena: a region for each array argument (and a mirror
// for each __restrict__ alias), each pointer-table target and each live block's dynamic shared
// memory (static __shared__ variables get theirs as they are reached), and points the kernel's
// parameters (`vals`) and the table words at them. `reserved`: the arena is (the far check's
// second layout), else it is reserved here.
void arena_needs(const LaunchArgs* la, unsigned k, size_t* nregions, size_t* largest) {
  // a slot for every array and table target, the dynamic shared memory and the static
  // __shared__ variables (registered as they are reached) of each live block
  *nregions = (size_t)k * (1 + kSharedVarsPerBlock);
  *largest = region_span(kMaxDynamicOptIn, 0);
  for (int i = 0; i < la->nargs; ++i)
    if (la->nbytes[i] != ~0ull) {        // an alias may get a region of its own (a mirror)
      ++*nregions;
      *largest = std::max(*largest, region_span(la->nbytes[i], 256));
    }
  for (int t = 0; t < la->ntargets; ++t)
    if (la->target_arg[t] < 0) {
      ++*nregions;
      *largest = std::max(*largest, region_span(la->target_nbytes[t], 0));
    }
}

void lay_out(const LaunchArgs* la, const usize* aligns, void** vals, unsigned k, bool reserved) {
  rt.regions.clear();
  rt.arg_region.assign(la->nargs > 0 ? la->nargs : 0, -1);
  for (unsigned s = 0; s < kMaxSlots; ++s) {
    rt.slots[s].svar.clear();
    rt.slots[s].dyn = -1;
    rt.slots[s].active = false;
  }
  if (!reserved) {
    size_t nregions, largest;
    arena_needs(la, k, &nregions, &largest);
    reserve_arena(nregions, largest);
  }
  for (int i = 0; i < la->nargs; ++i) {
    if (la->nbytes[i] == ~0ull) {              // by value: read in place, so it must be aligned
      if ((uintptr_t)la->args[i] % aligns[i])
        fail("emulator: the value of argument %d is at %p, not aligned to the %zu bytes of its type",
             i, la->args[i], (size_t)aligns[i]);
      vals[i] = la->args[i];
      continue;
    }
    if (la->alias[i] >= 0) {                   // the same array passed twice: one copy
      rt.arg_region[i] = rt.arg_region[la->alias[i]];
      if (restrict_group(la, la->alias[i])) rt.arg_region[i] = new_mirror(rt.arg_region[i], i, la);
      continue;
    }
    int id = new_region(la->nbytes[i], la->itemsize[i], kArg, i, -1, la->misalign[i] % 256);
    rt.regions[id].host = (u64)(uintptr_t)*(void* const*)la->args[i];
    rt.regions[id].output = la->writeback[i] != 0;
    rt.arg_region[i] = id;
    // tracked: a const __restrict__ parameter's array (loaded through the non-coherent cache),
    // every array when the module uses __ldg, a group of arguments with a __restrict__ one
    if (restrict_of(i) == 2 || la->nc_all || restrict_group(la, i)) track_alloc(rt.regions[id]);
    rt.regions[id].members[0] = i;
  }
  for (int i = 0; i < la->nargs; ++i) {     // a pointer to const written through as well
    int id = rt.arg_region[i];
    if (id >= 0 && rt.regions[id].mirror >= 0) id = rt.regions[id].mirror;
    if (la->alias[i] >= 0 && la->writeback[i]) rt.regions[id].output = true;
  }
  map_tables(la, vals);
  if (la->nc_all)
    for (int t = 0; t < la->ntargets; ++t)
      if (la->target_arg[t] < 0) track_alloc(rt.regions[rt.target_region[t]]);
  // the slot holding each array's device pointer (shared by aliases)
  static void* slots[kMaxParams];
  for (int i = 0; i < la->nargs; ++i) {
    if (rt.arg_region[i] < 0) continue;
    slots[i] = rt.regions[rt.arg_region[i]].data;
    vals[i] = &slots[i];
  }
  for (unsigned s = 0; s < k; ++s) {
    ensure_stacks(rt.slots[s], rt.nthreads);
    if (la->shared_mem) rt.slots[s].dyn = new_region(la->shared_mem, 1, kDyn, 0, (int)s);
  }
}

// The far check's second run (see "far accesses"): the schedule `s` again, without the race
// detector, over an arena laid out anew; its accesses must land where the first run's did, and
// its results (`snaps`: the first run's) must be the same. False where the address space for
// the second arena cannot be had: nothing ran, the first arena is as it was.
bool run_relaid(const LaunchArgs* la, const usize* aligns, void** vals, const Schedule& s,
                const std::vector<Snapshot>& snaps) {
  size_t nregions, largest;
  arena_needs(la, rt.kslots, &nregions, &largest);
  rt.far_shift[0] = rt.slot_shift;
  if (!reserve_relaid(nregions, largest)) return false;      // (the first arena given back)
  for (const Slot& t : rt.slots_)             // table words in by-value arguments: as given
    if (rt.arg_region[t.arg] < 0) memcpy((char*)vals[t.arg] + t.offset, &t.original, 8);
  rt.race = false;
  rt.launch_id++;                             // static __shared__ variables: new regions
  rt.static_shared = 0;
  lay_out(la, aligns, vals, rt.kslots, true);
  rt.far_shift[1] = rt.slot_shift;
  copy_inputs(la);
  restore_module_bytes();
  rt.far_mode = kFarCompare;
  run_grid(s);
  rt.far_mode = kFarOff;
  rt.running = nullptr;
  cur = nullptr;
  far_finish();
  check_canaries();
  untranslate_tables();
  compare(snaps, s, s, true);
  return true;
}
}  // namespace

int run_launch(const char* name, const LaunchArgs* la, int nparams, const usize* aligns,
               void** vals, void (*body)(void*), void* ctx) {
  rt.page = (size_t)sysconf(_SC_PAGESIZE);
  rt.kernel_name = name;
  rt.err[0] = 0;
  rt.running = nullptr;
  cur = nullptr;
  rt.la = la;
  rt.launch_id++;
  rt.static_shared = 0;
  rt.dyn_shared = la->shared_mem;
  rt.max_dyn_shared = la->max_dyn_shared;
  rt.race = la->race != 0;
  rt.yield_atomics = false;
  rt.far_mode = kFarOff;
  rt.far_log.clear();
  rt.far_tail[0] = rt.far_tail[1] = 0;
  rt.far_count[0] = rt.far_count[1] = 0;
  rt.module_bytes.clear();
  int rc = 0;
  rt.launch_thread = pthread_self();
  module_base();
  install_fault_handler();
  rt.fp_caller = read_fp_mode();
  rt.fp_kernel = la->ftz ? rt.fp_caller | kFlushBits : rt.fp_caller & ~kFlushBits;
  rt.in_launch = 1;
  if (sigsetjmp(rt.jmp, 1) == 0) {
    if (la->nargs != nparams)
      fail("kernel '%s' takes %d arguments, launcher passed %d", name, nparams, la->nargs);
    if (la->ftz && !kFlushBits)
      fail("emulator: flushing subnormals (ftz) is not supported on this CPU");
    Schedule schedules[16];
    int nsched = parse_schedules(la->schedules, schedules, 16);
    grid_dim = dim3(la->grid[0], la->grid[1], la->grid[2]);
    block_dim = dim3(la->block[0], la->block[1], la->block[2]);
    rt.nthreads = la->block[0] * la->block[1] * la->block[2];
    rt.nblocks = (u64)la->grid[0] * la->grid[1] * la->grid[2];
    if (rt.race && rt.nblocks > (1u << 20))
      fail("emulator: the race detector handles at most 2^20 blocks per launch; this one has %llu",
           (unsigned long long)rt.nblocks);
    bool random = false;
    for (int s = 0; s < nsched; ++s) random |= schedules[s].kind == Schedule::kRandom;
    unsigned k = random ? (unsigned)(rt.nblocks < kMaxSlots ? rt.nblocks : kMaxSlots) : 1;
    rt.kslots = k;
    lay_out(la, aligns, vals, k, false);
    if (la->slot_bytes) *la->slot_bytes = (u64)1 << rt.slot_shift;
    rt.body = body;
    rt.body_ctx = ctx;
    std::vector<Snapshot> snaps;
    for (int si = 0; si < nsched; ++si) {
      if (si) reset_for_schedule(la);
      else copy_inputs(la);
      rt.counting = si == 0 && la->counts;
      rt.far_mode = si == 0 && la->far ? kFarRecord : kFarOff;
      run_grid(schedules[si]);
      rt.far_mode = kFarOff;
      rt.counting = false;
      if (si == 0) report_counts(la);
      rt.running = nullptr;
      cur = nullptr;
      check_canaries();
      untranslate_tables();
      if (nsched > 1 || la->far) {
        if (si == 0) {
          for (size_t id = 0; id < rt.regions.size(); ++id) {
            const Region& r = rt.regions[id];
            if (!r.output || !r.nbytes) continue;
            Snapshot s;
            s.region = (int)id;
            s.bytes.assign(r.data, r.data + r.nbytes);
            snaps.push_back(std::move(s));
          }
        } else {
          compare(snaps, schedules[0], schedules[si]);
        }
      }
      free_vcs();
    }
    if (la->far && !run_relaid(la, aligns, vals, schedules[0], snaps) && la->far_skipped)
      *la->far_skipped = 1;
    for (int i = 0; i < la->nargs; ++i) {
      int id = rt.arg_region[i];
      if (id < 0 || la->alias[i] >= 0 || !rt.regions[id].output || !la->nbytes[i]) continue;
      memcpy((void*)rt.regions[id].host, rt.regions[id].data, la->nbytes[i]);
    }
    for (int t = 0; t < la->ntargets; ++t) {     // allocations behind tables: only if changed
      if (la->target_arg[t] >= 0) continue;
      const Region& r = rt.regions[rt.target_region[t]];
      if (r.nbytes && memcmp((const void*)r.host, r.data, r.nbytes))
        memcpy((void*)r.host, r.data, r.nbytes);
    }
  } else {
    rc = 1;
    snprintf(la->err, kErrLen, "%s", rt.err);
  }
  rt.in_launch = 0;
  rt.counting = false;               // a launch that failed mid-run left it on
  write_fp_mode(rt.fp_caller);
  rt.running = nullptr;
  cur = nullptr;
  restore_fault_handler();
  free_vcs();
  release_arena();
  std::vector<u64>().swap(rt.far_log);        // (up to 256 MiB: not kept between launches)
  rt.module_bytes.clear();
  return rc;
}

}  // namespace ctemu

// ---- the callbacks of GCC's instrumentation ------------------------------------------------------
using ctemu::access;
#define CTEMU_EXPORT extern "C" __attribute__((visibility("hidden")))
#define RA __builtin_return_address(0)

CTEMU_EXPORT void __tsan_init() {}
CTEMU_EXPORT void __tsan_func_entry(void*) {}
CTEMU_EXPORT void __tsan_func_exit() {}
CTEMU_EXPORT void __tsan_vptr_update(void**, void*) {}
CTEMU_EXPORT void __tsan_vptr_read(void**) {}
CTEMU_EXPORT void __tsan_read_range(void* p, unsigned long n) { if (n) access(p, n, ctemu::kRead, RA); }
CTEMU_EXPORT void __tsan_write_range(void* p, unsigned long n) { if (n) access(p, n, ctemu::kWrite, RA); }

#define CTEMU_TSAN_SIZE(N)                                                                        \
  CTEMU_EXPORT void __tsan_read##N(void* p) { access(p, N, ctemu::kRead, RA); }                   \
  CTEMU_EXPORT void __tsan_write##N(void* p) { access(p, N, ctemu::kWrite, RA); }                 \
  CTEMU_EXPORT void __tsan_unaligned_read##N(void* p) { access(p, N, ctemu::kRead, RA); }         \
  CTEMU_EXPORT void __tsan_unaligned_write##N(void* p) { access(p, N, ctemu::kWrite, RA); }       \
  CTEMU_EXPORT void __tsan_volatile_read##N(void* p) { access(p, N, ctemu::kVolatile, RA); }      \
  CTEMU_EXPORT void __tsan_volatile_write##N(void* p) {                                           \
    access(p, N, ctemu::kVolatile | ctemu::kWrite, RA);                                           \
  }                                                                                              \
  CTEMU_EXPORT void __tsan_unaligned_volatile_read##N(void* p) { access(p, N, ctemu::kVolatile, RA); } \
  CTEMU_EXPORT void __tsan_unaligned_volatile_write##N(void* p) {                                 \
    access(p, N, ctemu::kVolatile | ctemu::kWrite, RA);                                           \
  }
CTEMU_TSAN_SIZE(1)
CTEMU_TSAN_SIZE(2)
CTEMU_TSAN_SIZE(4)
CTEMU_TSAN_SIZE(8)
CTEMU_TSAN_SIZE(16)
#undef CTEMU_TSAN_SIZE

// C++ atomics in kernel code (a guard variable, std::atomic): plain here, checked as atomics.
#define CTEMU_TSAN_ATOMIC(N, T)                                                                   \
  CTEMU_EXPORT T __tsan_atomic##N##_load(const volatile T* a, int) {                              \
    access((void*)a, sizeof(T), ctemu::kVolatile, RA);                                            \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                  \
  }                                                                                              \
  CTEMU_EXPORT void __tsan_atomic##N##_store(volatile T* a, T v, int) {                           \
    access((void*)a, sizeof(T), ctemu::kVolatile | ctemu::kWrite, RA);                            \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                     \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                           \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) {                          \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) {                          \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) {                          \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) {                           \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) {                          \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) {                         \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                              \
  CTEMU_EXPORT int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) { \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                              \
  CTEMU_EXPORT int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) { \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                              \
  CTEMU_EXPORT T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {     \
    ctemu::atomic_access((void*)a, sizeof(T), RA, 0);                                              \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
    return c;                                                                                    \
  }
CTEMU_TSAN_ATOMIC(8, unsigned char)
CTEMU_TSAN_ATOMIC(16, unsigned short)
CTEMU_TSAN_ATOMIC(32, unsigned int)
CTEMU_TSAN_ATOMIC(64, unsigned long long)
#undef CTEMU_TSAN_ATOMIC
CTEMU_EXPORT void __tsan_atomic_thread_fence(int) { ctemu::fence(1); }
CTEMU_EXPORT void __tsan_atomic_signal_fence(int) {}

// ---- UndefinedBehaviorSanitizer callbacks ---------------------------------------------------------
// bounds, alignment, object size, integer division by zero, signed overflow, shifts, float to
// integer conversions out of range.
namespace {
struct SourceLocation { const char* file; uint32_t line, column; };
struct TypeDescriptor { uint16_t kind, info; char name[1]; };
struct OutOfBoundsData { SourceLocation loc; const TypeDescriptor* array; const TypeDescriptor* index; };
struct OverflowData { SourceLocation loc; const TypeDescriptor* type; };
struct TypeMismatchData { SourceLocation loc; const TypeDescriptor* type; unsigned char log_alignment, kind; };
struct ShiftData { SourceLocation loc; const TypeDescriptor* lhs; const TypeDescriptor* rhs; };
struct FloatCastData { SourceLocation loc; const TypeDescriptor* from; const TypeDescriptor* to; };
enum { kTypeInteger = 0, kTypeFloat = 1 };

// An integer value as UBSan passes it (inline when it fits a pointer).
void int_value(char* buf, size_t n, const TypeDescriptor* t, uintptr_t v) {
  unsigned bits = 1u << (t->info >> 1);
  bool is_signed = t->info & 1;
  if (bits > 64) {                                       // __int128: passed by address, in hex
    const uint64_t* w = (const uint64_t*)v;
    snprintf(buf, n, "0x%016llx%016llx", (unsigned long long)w[1], (unsigned long long)w[0]);
    return;
  }
  if (is_signed) {
    long long s = bits >= 64 ? (long long)v : (long long)(v << (64 - bits)) >> (64 - bits);
    snprintf(buf, n, "%lld", s);
  } else {
    snprintf(buf, n, "%llu", bits >= 64 ? (unsigned long long)v : (unsigned long long)(v & ((1ull << bits) - 1)));
  }
}

// A floating-point value as UBSan passes it: inline when it fits a pointer (info: its bit width).
double float_value(const TypeDescriptor* t, uintptr_t v) {
  if (t->info == 32) { float f; uint32_t b = (uint32_t)v; memcpy(&f, &b, 4); return f; }
  if (t->info == 64) { double d; memcpy(&d, &v, 8); return d; }
  if (t->info == 16) {                                   // binary16 (_Float16)
    unsigned h = (unsigned)v & 0xffffu, e = h >> 10 & 31u, m = h & 1023u;
    double x = e == 31 ? (m ? NAN : INFINITY) : e ? ldexp(1024.0 + m, (int)e - 25) : ldexp(m, -24);
    return h >> 15 ? -x : x;
  }
  return (double)*(const long double*)v;
}

[[noreturn]] void ubsan_overflow(OverflowData* d, const char* op, uintptr_t l, uintptr_t r) {
  char a[48], b[48], msg[384];
  int_value(a, sizeof a, d->type, l);
  int_value(b, sizeof b, d->type, r);
  snprintf(msg, sizeof msg, "signed integer overflow: %s %s %s does not fit type %s at %s:%u (a "
           "GPU's compiler may assume it cannot happen: widen the index to 64 bits or use unsigned)",
           a, op, b, d->type->name, d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}

[[noreturn]] void ubsan_negate(OverflowData* d, uintptr_t v) {
  char a[48], msg[256];
  int_value(a, sizeof a, d->type, v);
  snprintf(msg, sizeof msg, "signed integer overflow: -(%s) does not fit type %s at %s:%u", a,
           d->type->name, d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}

[[noreturn]] void ubsan_shift(ShiftData* d, uintptr_t, uintptr_t r) {
  char b[48], msg[384];                   // -fsanitize=shift-exponent: only the count is checked
  int_value(b, sizeof b, d->rhs, r);
  snprintf(msg, sizeof msg, "shift exponent %s is out of range for the %u-bit type %s at %s:%u "
           "(a GPU clamps the shift; C++ leaves it undefined)", b, 1u << (d->lhs->info >> 1),
           d->lhs->name, d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}

[[noreturn]] void ubsan_float_cast(FloatCastData* d, uintptr_t v) {
  char msg[384];
  double x = d->from->kind == kTypeFloat ? float_value(d->from, v) : 0.0;
  snprintf(msg, sizeof msg, "%g is outside the range of %s, converted from %s at %s:%u (a GPU "
           "saturates and turns NaN into 0, a CPU does not: clamp first, or use __float2int_rz "
           "and its kin)", x, d->to->name, d->from->name, d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}

[[noreturn]] void ubsan_out_of_bounds(OutOfBoundsData* d, uintptr_t index) {
  char idx[32], msg[384];
  int_value(idx, sizeof idx, d->index, index);
  snprintf(msg, sizeof msg, "index %s out of range for an array of type %s (a static __shared__, "
           "local or member array) at %s:%u", idx, d->array->name, d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}

[[noreturn]] void ubsan_divrem(OverflowData* d, uintptr_t, uintptr_t rhs) {
  char msg[256], r[32];
  int_value(r, sizeof r, d->type, rhs);
  snprintf(msg, sizeof msg, "integer %s of type %s at %s:%u",
           strcmp(r, "0") ? "division overflow (INT_MIN / -1)" : "division by zero", d->type->name,
           d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}

const char* const kCheckKinds[] = {"load of", "store to", "reference binding to", "member access within",
                                   "member call on", "constructor call on", "downcast of",
                                   "downcast of", "upcast of", "cast to virtual base of",
                                   "assignment to", "dynamic operation on"};

[[noreturn]] void ubsan_mismatch(TypeMismatchData* d, uintptr_t p) {
  char msg[384];
  const char* kind = d->kind < sizeof kCheckKinds / sizeof *kCheckKinds ? kCheckKinds[d->kind] : "access to";
  if (!p)
    snprintf(msg, sizeof msg, "%s a null pointer of type %s at %s:%u", kind, d->type->name,
             d->loc.file, d->loc.line);
  else if (p & ((1u << d->log_alignment) - 1))
    snprintf(msg, sizeof msg, "misaligned %s address %p for type %s, which needs %u-byte alignment "
             "(a GPU faults: misaligned address) at %s:%u", kind, (void*)p, d->type->name,
             1u << d->log_alignment, d->loc.file, d->loc.line);
  else                          // -fsanitize=object-size
    snprintf(msg, sizeof msg, "%s address %p past the end of its object (a local or static array "
             "reached through a pointer) for type %s (a GPU reads or overwrites another variable) "
             "at %s:%u", kind, (void*)p, d->type->name, d->loc.file, d->loc.line);
  ctemu::fail_here(msg);
}
}  // namespace

CTEMU_EXPORT void __ubsan_handle_out_of_bounds(OutOfBoundsData* d, uintptr_t i) { ubsan_out_of_bounds(d, i); }
CTEMU_EXPORT void __ubsan_handle_out_of_bounds_abort(OutOfBoundsData* d, uintptr_t i) { ubsan_out_of_bounds(d, i); }
CTEMU_EXPORT void __ubsan_handle_divrem_overflow(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_divrem(d, l, r); }
CTEMU_EXPORT void __ubsan_handle_divrem_overflow_abort(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_divrem(d, l, r); }
CTEMU_EXPORT void __ubsan_handle_add_overflow(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_overflow(d, "+", l, r); }
CTEMU_EXPORT void __ubsan_handle_add_overflow_abort(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_overflow(d, "+", l, r); }
CTEMU_EXPORT void __ubsan_handle_sub_overflow(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_overflow(d, "-", l, r); }
CTEMU_EXPORT void __ubsan_handle_sub_overflow_abort(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_overflow(d, "-", l, r); }
CTEMU_EXPORT void __ubsan_handle_mul_overflow(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_overflow(d, "*", l, r); }
CTEMU_EXPORT void __ubsan_handle_mul_overflow_abort(OverflowData* d, uintptr_t l, uintptr_t r) { ubsan_overflow(d, "*", l, r); }
CTEMU_EXPORT void __ubsan_handle_negate_overflow(OverflowData* d, uintptr_t v) { ubsan_negate(d, v); }
CTEMU_EXPORT void __ubsan_handle_negate_overflow_abort(OverflowData* d, uintptr_t v) { ubsan_negate(d, v); }
CTEMU_EXPORT void __ubsan_handle_shift_out_of_bounds(ShiftData* d, uintptr_t l, uintptr_t r) { ubsan_shift(d, l, r); }
CTEMU_EXPORT void __ubsan_handle_shift_out_of_bounds_abort(ShiftData* d, uintptr_t l, uintptr_t r) { ubsan_shift(d, l, r); }
CTEMU_EXPORT void __ubsan_handle_float_cast_overflow(FloatCastData* d, uintptr_t v) { ubsan_float_cast(d, v); }
CTEMU_EXPORT void __ubsan_handle_float_cast_overflow_abort(FloatCastData* d, uintptr_t v) { ubsan_float_cast(d, v); }
CTEMU_EXPORT void __ubsan_handle_type_mismatch_v1(TypeMismatchData* d, uintptr_t p) { ubsan_mismatch(d, p); }
CTEMU_EXPORT void __ubsan_handle_type_mismatch_v1_abort(TypeMismatchData* d, uintptr_t p) { ubsan_mismatch(d, p); }
