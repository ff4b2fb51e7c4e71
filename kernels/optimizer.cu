// kernels/optimizer.cu: momentum SGD for every parameter of a model in one launch, with fp32
// master weights, per-parameter hyperparameters read from device memory, weight decay,
// loss-scale unscaling and dynamic loss scaling decided on the device.
//
// Memory the optimizer owns (chainer_tc/optimizers/_flat.py builds it once, at setup):
//   p32     float32 parameters, all in one flat buffer (each Parameter's array is a view of it)
//   p16     float16 parameters, likewise; master holds their float32 master copies, same offsets
//   p64     float64 parameters, likewise
//   mom32   momentum of the float32 parameters, mom16 of the float16 ones (float32, same
//           offsets), mom64 of the float64 ones (float64)
//   chunks  the work list: 4 int64 per chunk of at most 2048 elements of one parameter:
//             [0] offset of the chunk in its flat buffer
//             [1] offset of the chunk inside the parameter (and so inside its gradient)
//             [2] number of elements (1..2048)
//             [3] bits 0-15:  index of the parameter's gradient in StepParams.grad
//                 bits 16-17: GROUP_F32, GROUP_F16 or GROUP_F64
//                 bits 32-62: index of the parameter (its row in hyper, minus one)
//   hyper   double[(1 + parameters) * 4], the hyperparameters (chainer_tc/optimizers/_hyper.py):
//             row 0: the optimizer's lr, momentum, weight_decay (and 0)
//             row 1 + i: parameter i's lr, momentum, weight_decay and flags (HYPER_*): a value
//             is used only if its OWN flag is set, else row 0's; a parameter without
//             HYPER_ENABLED (a frozen link) is not touched at all.
//           In device memory, so that a captured CUDA graph reads the values of each replay.
//   scaler  uint32[8], the loss-scale state (SCALER_* below)
// Gradients are wherever Chainer's backward put them: their addresses come with every launch in
// StepParams.grad (a null address means "no gradient": zero, as Chainer reallocates it), in the
// parameter's dtype and C-contiguous. Bit 0 of an address (free: every gradient is at least
// 2-byte aligned) says whether that gradient is divided before use: set for a gradient computed
// with a loss scale (Chainer's param._loss_scale, read by the optimizer), which is then
// sp.grad_divisor, or the device loss scale (scaler[SCALER_SCALE]) when sp.grad_divisor is 0.
//
// Per element, each operation rounded once (the _rn intrinsics forbid fma contraction), in
// float32 for float32 and float16 parameters (hyperparameters rounded to float32 first) and in
// float64 for float64 ones. For float32 and float64 parameters this is bit for bit what NumPy
// computes for chainer.optimizers.MomentumSGD with the WeightDecay hook; for float16 ones the
// decay uses the float32 master (Chainer's use_fp32_update adds it in float16, before the cast):
//   g = grad / divisor                     (gradients marked by bit 0 of their address)
//   g = g + weight_decay * p               (if weight_decay != 0)
//   v = v * momentum - lr * g
//   p = p + v                              (nesterov: p = p + (v * momentum - lr * g))
//   float16 parameters: master = p, p16 = half(p) rounded to nearest even. Before the update, a
//   float16 parameter that no longer equals half(master) was written from outside the optimizer
//   (serializers.load_npz, copyparams, by hand): its value becomes the new master.
//
// Entry points (launch: grid = number of chunks handled by the launch, block = OPT_BLOCK):
//   momentum_sgd_check(sp, chunks, scaler)
//     Dynamic loss scaling only, before the update: sets scaler[SCALER_FOUND_INF] if any unscaled
//     gradient element is inf or nan (of every parameter, frozen ones too, as Chainer checks
//     them all). Reads gradients; writes only that flag.
//   momentum_sgd_update(sp, chunks, p32, p16, master, mom32, mom16, p64, mom64, hyper, scaler)
//     Applies the update unless scaler[SCALER_FOUND_INF] is set, in which case it writes nothing
//     at all to parameters, masters or momenta. With dynamic scaling, the last block of the step
//     (sp.total_blocks blocks over all update launches) then updates the scale: halve on overflow
//     (not below sp.min_scale), double after sp.interval clean steps in a row (not above
//     sp.max_scale), counts skipped steps, and clears the flag and its own block counter.
//   momentum_sgd_set_globals(g, hyper)   (grid 1, block 1)
//     Writes the optimizer's lr, momentum and weight_decay into row 0 of hyper: how a new
//     learning rate reaches the device without a host synchronisation.
#include <cuda_fp16.h>

#ifndef OPT_BLOCK
#define OPT_BLOCK 256
#endif
// Occupancy target for ptxas: with the block size alone, NVRTC 12.9's ptxas aims at 2048 threads
// per SM (32 registers) and spills on sm_80/sm_90; 4 blocks of 256 allow 64 registers.
#define OPT_MIN_BLOCKS 4
#ifndef OPT_GRAD_TABLE
#define OPT_GRAD_TABLE 480
#endif

enum { SCALE_NONE = 0, SCALE_STATIC = 1, SCALE_DYNAMIC = 2 };
enum { GROUP_F32 = 0, GROUP_F16 = 1, GROUP_F64 = 2 };
enum { HYPER_ENABLED = 1, HYPER_OWN_LR = 2, HYPER_OWN_MOMENTUM = 4, HYPER_OWN_WD = 8 };
enum {
  SCALER_SCALE = 0,       // float32 bits of the loss scale
  SCALER_CLEAN = 1,       // clean steps since the scale last changed
  SCALER_FOUND_INF = 2,   // set by momentum_sgd_check, cleared at the end of the step
  SCALER_SKIPPED = 3,     // steps skipped so far
  SCALER_DONE = 4,        // update blocks finished in this step
  SCALER_SCALE_F16 = 5,   // float16 bits of the loss scale (seed for a float16 loss)
};

// Passed by value (it is the kernel's parameter block): the loss-scaling configuration and the
// gradient addresses. Nothing here changes between steps except the addresses, which a
// captured graph keeps fixed.
struct StepParams {
  int nesterov;
  int scaling;              // SCALE_NONE, SCALE_STATIC or SCALE_DYNAMIC
  unsigned interval;        // dynamic: clean steps before the scale doubles
  float min_scale, max_scale;
  unsigned total_blocks;    // dynamic: update blocks of this step, over all launches
  double grad_divisor;      // divides the marked gradients; 0: the device loss scale
  unsigned long long grad[OPT_GRAD_TABLE];   // addresses; bit 0: divide this gradient
};
static_assert(sizeof(StepParams) == 32 + 8 * OPT_GRAD_TABLE, "StepParams layout is shared with Python");

struct Globals {
  double lr, momentum, weight_decay;
};

namespace opt {

struct Chunk {
  long long flat, inner, count, entry;
  unsigned grad_index, group;
};

__device__ __forceinline__ Chunk load_chunk(const long long* chunks) {
  const long long* c = chunks + 4 * (long long)blockIdx.x;
  Chunk k;
  k.flat = c[0];
  k.inner = c[1];
  k.count = c[2];
  k.grad_index = (unsigned)(c[3] & 0xffffLL);
  k.group = (unsigned)((c[3] >> 16) & 3);
  k.entry = c[3] >> 32;
  return k;
}

struct Hyper {
  double lr, momentum, weight_decay;
  bool enabled;
};

__device__ __forceinline__ Hyper load_hyper(const double* hyper, long long entry) {
  const double* own = hyper + 4 * (entry + 1);
  const unsigned flags = (unsigned)own[3];
  Hyper h;
  h.lr = (flags & HYPER_OWN_LR) ? own[0] : hyper[0];
  h.momentum = (flags & HYPER_OWN_MOMENTUM) ? own[1] : hyper[1];
  h.weight_decay = (flags & HYPER_OWN_WD) ? own[2] : hyper[2];
  h.enabled = flags & HYPER_ENABLED;
  return h;
}

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

__device__ __forceinline__ float load(const float* g, long long i) { return g[i]; }
__device__ __forceinline__ float load(const __half* g, long long i) { return __half2float(g[i]); }
__device__ __forceinline__ double load(const double* g, long long i) { return g[i]; }

__device__ __forceinline__ float read_scale(const unsigned* scaler) {
  return __uint_as_float(scaler[SCALER_SCALE]);
}

// One gradient of the step: its address, and whether it is divided (bit 0 of StepParams.grad).
struct GradRef {
  const void* ptr;
  bool divide;
};

__device__ __forceinline__ GradRef load_grad(const StepParams& sp, const Chunk& k) {
  const unsigned long long a = sp.grad[k.grad_index];
  GradRef r;
  r.ptr = reinterpret_cast<const void*>(a & ~1ULL);
  r.divide = (a & 1ULL) != 0;
  return r;
}

// What divides a marked gradient, in the arithmetic type T: the device loss scale, or the
// host value of a backward pass's loss_scale.
template <typename T>
__device__ __forceinline__ T grad_divisor(const StepParams& sp, const unsigned* scaler) {
  return sp.grad_divisor == 0.0 ? (T)read_scale(scaler) : (T)sp.grad_divisor;
}

// Whether any unscaled element of one chunk's gradient (storage type G) is inf or nan.
template <typename G>
__device__ __forceinline__ bool any_nonfinite(const Chunk& k, const StepParams& sp, const G* g,
                                              bool divide, const unsigned* scaler) {
  typedef decltype(load(g, 0)) T;
  const T d = grad_divisor<T>(sp, scaler);
  bool bad = false;
  for (long long i = threadIdx.x; i < k.count; i += OPT_BLOCK) {
    const T grad = load(g, k.inner + i);
    bad |= !isfinite(divide ? div_rn(grad, d) : grad);
  }
  return bad;
}

// One chunk of the update in arithmetic type T (float, or double for float64 parameters).
// G is the gradient's storage type, P the master/parameter storage (float or double).
template <typename T, typename G>
__device__ __forceinline__ void update_chunk(const Chunk& k, const StepParams& sp, const Hyper& h,
                                             const G* g, bool divide, const unsigned* scaler,
                                             T* p, T* v, __half* p16) {
  const T lr = (T)h.lr, momentum = (T)h.momentum, wd = (T)h.weight_decay;
  const T d = grad_divisor<T>(sp, scaler);
  const bool half = p16 != nullptr;
  for (long long i = threadIdx.x; i < k.count; i += OPT_BLOCK) {
    const long long e = k.flat + i;
    T grad = g ? (T)load(g, k.inner + i) : (T)0;
    if (g && divide) grad = div_rn(grad, d);
    T pe = p[e];
    if (half) {     // a float16 parameter written from outside (load_npz, copyparams): adopt it
      const __half cur = p16[e];
      if (__half_as_ushort(cur) != __half_as_ushort(__float2half_rn((float)pe))) pe = (T)__half2float(cur);
    }
    if (wd != (T)0) grad = add_rn(grad, mul_rn(wd, pe));
    const T step = sub_rn(mul_rn(v[e], momentum), mul_rn(lr, grad));
    v[e] = step;
    pe = add_rn(pe, sp.nesterov ? sub_rn(mul_rn(step, momentum), mul_rn(lr, grad)) : step);
    p[e] = pe;
    if (half) p16[e] = __float2half_rn((float)pe);
  }
}

// The last update block of a dynamic step: move the scale, clear the flag and the counter.
__device__ void finish_step(const StepParams& sp, unsigned* scaler) {
  float scale = read_scale(scaler);
  if (scaler[SCALER_FOUND_INF]) {
    scale = fmaxf(scale * 0.5f, sp.min_scale);
    scaler[SCALER_CLEAN] = 0;
    scaler[SCALER_SKIPPED] += 1;
  } else if (++scaler[SCALER_CLEAN] >= sp.interval) {
    scale = fminf(scale * 2.0f, sp.max_scale);
    scaler[SCALER_CLEAN] = 0;
  }
  scaler[SCALER_SCALE] = __float_as_uint(scale);
  scaler[SCALER_SCALE_F16] = __half_as_ushort(__float2half_rn(scale));
  scaler[SCALER_FOUND_INF] = 0;
  scaler[SCALER_DONE] = 0;
}

}  // namespace opt

extern "C" __global__ void __launch_bounds__(OPT_BLOCK, OPT_MIN_BLOCKS)
momentum_sgd_check(const StepParams sp, const long long* __restrict__ chunks, unsigned* scaler) {
  volatile unsigned* found = scaler + SCALER_FOUND_INF;
  __shared__ unsigned already;                          // decided once, so the block agrees
  if (threadIdx.x == 0) already = *found;
  __syncthreads();
  if (already) return;                                  // another block already found one
  const opt::Chunk k = opt::load_chunk(chunks);
  const opt::GradRef g = opt::load_grad(sp, k);
  if (!g.ptr) return;
  const bool bad =
      k.group == GROUP_F64
          ? opt::any_nonfinite(k, sp, static_cast<const double*>(g.ptr), g.divide, scaler)
      : k.group == GROUP_F16
          ? opt::any_nonfinite(k, sp, static_cast<const __half*>(g.ptr), g.divide, scaler)
          : opt::any_nonfinite(k, sp, static_cast<const float*>(g.ptr), g.divide, scaler);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1u;
}

extern "C" __global__ void __launch_bounds__(OPT_BLOCK, OPT_MIN_BLOCKS)
momentum_sgd_update(const StepParams sp, const long long* __restrict__ chunks,
                    float* __restrict__ p32, __half* __restrict__ p16, float* __restrict__ master,
                    float* __restrict__ mom32, float* __restrict__ mom16,
                    double* __restrict__ p64, double* __restrict__ mom64,
                    const double* __restrict__ hyper, unsigned* scaler) {
  const bool dynamic = sp.scaling == SCALE_DYNAMIC;
  if (!(dynamic && scaler[SCALER_FOUND_INF])) {
    const opt::Chunk k = opt::load_chunk(chunks);
    const opt::Hyper h = opt::load_hyper(hyper, k.entry);
    if (h.enabled) {
      const opt::GradRef g = opt::load_grad(sp, k);
      if (k.group == GROUP_F64)
        opt::update_chunk<double>(k, sp, h, static_cast<const double*>(g.ptr), g.divide, scaler,
                                  p64, mom64, (__half*)nullptr);
      else if (k.group == GROUP_F16)
        opt::update_chunk<float>(k, sp, h, static_cast<const __half*>(g.ptr), g.divide, scaler,
                                 master, mom16, p16);
      else
        opt::update_chunk<float>(k, sp, h, static_cast<const float*>(g.ptr), g.divide, scaler,
                                 p32, mom32, (__half*)nullptr);
    }
  }
  if (!dynamic) return;
  // Bookkeeping: the last block to finish this step updates the loss scale.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(scaler + SCALER_DONE, 1u) == sp.total_blocks - 1;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    opt::finish_step(sp, scaler);
  }
}

extern "C" __global__ void momentum_sgd_set_globals(const Globals g, double* hyper) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    hyper[0] = g.lr;
    hyper[1] = g.momentum;
    hyper[2] = g.weight_decay;
  }
}
