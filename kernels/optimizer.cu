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
//   divisors double[parameters]: each parameter's own divisor (0: the device loss scale), read
//           only when sp.grad_divisor < 0 (a step whose gradients carry different loss scales)
// Gradients are wherever Chainer's backward put them: their addresses come with every launch in
// StepParams.grad (a null address means "no gradient": zero, as Chainer reallocates it), in the
// parameter's dtype and C-contiguous. Bit 0 of an address (free: every gradient is at least
// 2-byte aligned) says whether that gradient is divided before use: set for a gradient computed
// with a loss scale (Chainer's param._loss_scale, read by the optimizer), which is then
// sp.grad_divisor, or the device loss scale (scaler[SCALER_SCALE]) when sp.grad_divisor is 0,
// or divisors[parameter] when sp.grad_divisor < 0. Bit 1 (free in float32 and float64
// gradients, which are 4-byte aligned; never set for a float16 one) says that the update writes
// the divided gradient back over it, as Chainer's update rule divides a float32 or float64
// param.grad in place (a float16 parameter's stays as it is: Chainer divides a float32 copy).
// The host sets it only on a gradient whose memory no other gradient of the step shares (see
// chainer_tc/optimizers/_grads.py): a block must not read what another one writes back.
//
// Per element, each operation rounded once (the _rn intrinsics forbid fma contraction), in
// float32 for float32 and float16 parameters (hyperparameters rounded to float32 first) and in
// float64 for float64 ones. For float32 and float64 parameters this is bit for bit what NumPy
// computes for chainer.optimizers.MomentumSGD with the WeightDecay hook; for float16 ones the
// decay uses the float32 master (Chainer's use_fp32_update adds it in float16, before the cast):
//   g = grad / divisor                     (gradients marked by bit 0 of their address;
//                                           bit 1 as well: grad = g, written back)
//   g = g + weight_decay * p               (if weight_decay != 0)
//   v = v * momentum - lr * g
//   p = p + v                              (nesterov: p = p + (v * momentum - lr * g))
//   float16 parameters: master = p, p16 = half(p) rounded to nearest even. Before the update, a
//   float16 parameter that no longer equals half(master) was written from outside the optimizer
//   (serializers.load_npz, copyparams, by hand): its value becomes the new master.
// A divisor that is a power of two with a normal reciprocal (every dynamic loss scale, unless it
// started at another number) is applied as grad * (1 / divisor), which is the same bits as the
// division for every grad (see GRAD_MUL below); any other divisor is divided by. Per chunk, all
// of it decided once: the gradient's mode, the hyperparameters, the offsets; the elements are
// walked in pairs (__half2/float2/double2 accesses) where the chunk's arrays allow it, one at a
// time otherwise, with the same roundings in the same order either way.
//
// Entry points (launch: grid = number of chunks handled by the launch, block = OPT_BLOCK):
//   momentum_sgd_check(sp, chunks, divisors, scaler)
//     Dynamic loss scaling only, before the update: sets scaler[SCALER_FOUND_INF] if any unscaled
//     gradient element is inf or nan (of every parameter, frozen ones too, as Chainer checks
//     them all). Reads gradients; writes only that flag.
//   momentum_sgd_update(sp, chunks, divisors, p32, p16, master, mom32, mom16, p64, mom64, hyper,
//                       scaler)
//     Applies the update unless scaler[SCALER_FOUND_INF] is set, in which case it writes nothing
//     at all to parameters, masters, momenta or gradients. With dynamic scaling, the last block of the step
//     (sp.total_blocks blocks over all update launches) then updates the scale: halve on overflow
//     (not below sp.min_scale), double after sp.interval clean steps in a row (not above
//     sp.max_scale), counts skipped steps, and clears the flag and its own block counter.
//   momentum_sgd_set_globals(g, hyper)   (grid 1, block 1)
//     Writes the optimizer's lr, momentum and weight_decay into row 0 of hyper: how a new
//     learning rate reaches the device without a host synchronisation.
#include <cuda_fp16.h>

#include "dtype.cuh"

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
  double grad_divisor;      // divides the marked gradients; 0: the device loss scale;
                            // < 0: each parameter's divisors[] entry
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

__device__ __forceinline__ float read_scale(const unsigned* scaler) {
  return __uint_as_float(scaler[SCALER_SCALE]);
}

// One gradient of the step, as StepParams.grad holds it: its address, whether it is divided
// (bit 0) and, for a float32 or float64 gradient, whether the quotient is written back (bit 1).
// The address is masked with a constant per gradient type (Half: a float16 gradient, whose bit
// 1 is part of its address): a mask chosen at run time kept NVVM from seeing that the address
// is global, and every access became a generic LD/ST instead of LDG/STG.
struct GradRef {
  unsigned long long bits;
  bool present, divide;
  template <bool Half>
  __device__ __forceinline__ void* address() const {
    return reinterpret_cast<void*>(bits & (Half ? ~1ULL : ~3ULL));
  }
  template <bool Half>
  __device__ __forceinline__ bool write() const { return !Half && (bits & 2ULL) != 0; }
};

__device__ __forceinline__ GradRef load_grad(const StepParams& sp, const Chunk& k) {
  GradRef r;
  r.bits = sp.grad[k.grad_index];
  r.present = (r.bits & ~3ULL) != 0;      // a null address ("no gradient") has no flag set
  r.divide = (r.bits & 1ULL) != 0;
  return r;
}

// What divides a marked gradient, in the arithmetic type T: the device loss scale, the host
// value of a backward pass's loss_scale, or (a step mixing them) the parameter's own.
template <typename T>
__device__ __forceinline__ T grad_divisor(const StepParams& sp, const double* divisors,
                                          long long entry, const unsigned* scaler) {
  const double d = sp.grad_divisor < 0.0 ? divisors[entry] : sp.grad_divisor;
  return d == 0.0 ? (T)read_scale(scaler) : (T)d;
}

// How a chunk's gradient becomes g, decided once per chunk (a template argument of the element
// loops, so no element tests it):
//   GRAD_ZERO   no gradient (a null address): g = 0
//   GRAD_PLAIN  unmarked: g = grad
//   GRAD_MUL    marked, divisor d a power of two whose reciprocal r is a normal number:
//               g = grad * r, which is grad / d bit for bit (below)
//   GRAD_DIV    marked, any other divisor (an odd initial scale, a backward's loss_scale=10):
//               g = grad / d, IEEE division (a multi-instruction sequence with a slow path)
// Why grad * r == grad / d for every grad when d = 2^k and r = 2^-k are both normal: r is then
// exactly 1/d, so the exact product grad * r and the exact quotient grad / d are the same real
// number, and an IEEE operation is that exact result rounded once, to the same format in the same
// mode: the same bits, whatever the result is (a subnormal, an overflow to inf, a signed zero,
// inf * r = inf / d = inf, nan; the sign of d is that of r). So isfinite() agrees too, including
// a d < 1 whose quotient overflows: the product overflows for exactly the same grad. Both
// normal, because CuPy compiles with -ftz=true: a subnormal divisor or reciprocal would be
// flushed to zero on a GPU (x / 2^-127 would be x / 0, and 2^127's reciprocal 2^-127 would
// multiply as 0), so the range is d in [2^-126, 2^126] (float) or [2^-1022, 2^1022] (double) and
// anything else keeps the division. Under -ftz both operations also flush a subnormal grad and a
// subnormal result the same way (the float32 subnormal range where docs/optimizer.md already says
// a GPU differs from NumPy). Dynamic loss scaling only halves and doubles, so its scale stays a
// power of two unless the user starts it at another number.
enum { GRAD_ZERO = 0, GRAD_PLAIN = 1, GRAD_MUL = 2, GRAD_DIV = 3 };

__device__ __forceinline__ bool exact_reciprocal(float d) {
  const unsigned b = __float_as_uint(d);
  const unsigned e = (b >> 23) & 0xffu;               // biased exponent: d = 2^(e - 127)
  return (b & 0x7fffffu) == 0 && e >= 1 && e <= 253;  // 1/d = 2^(127 - e): biased 254 - e
}
__device__ __forceinline__ bool exact_reciprocal(double d) {
  const unsigned long long b = (unsigned long long)__double_as_longlong(d);
  const unsigned e = (unsigned)(b >> 52) & 0x7ffu;
  return (b & 0xfffffffffffffULL) == 0 && e >= 1 && e <= 2045;
}

// The mode of one chunk's gradient, and x: r for GRAD_MUL, d for GRAD_DIV (r = 1 / d is exact).
template <typename T>
__device__ __forceinline__ int grad_mode(const StepParams& sp, const GradRef& g,
                                         const double* divisors, long long entry,
                                         const unsigned* scaler, T& x) {
  x = (T)1;
  if (!g.present) return GRAD_ZERO;
  if (!g.divide) return GRAD_PLAIN;
  const T d = grad_divisor<T>(sp, divisors, entry, scaler);
  if (!exact_reciprocal(d)) {
    x = d;
    return GRAD_DIV;
  }
  x = div_rn((T)1, d);
  return GRAD_MUL;
}

// Whether any unscaled element of one chunk's gradient (storage type G, g at the chunk's first
// element) is inf or nan. n <= 2048 (the work list's chunks), so the index is 32-bit.
template <int Mode, typename G, typename T>
__device__ __forceinline__ bool any_nonfinite(int n, const G* g, T x) {
  bool bad = false;
  for (int i = threadIdx.x; i < n; i += OPT_BLOCK) {
    T grad = ctc::load(g, i);
    if (Mode == GRAD_MUL) grad = mul_rn(grad, x);
    if (Mode == GRAD_DIV) grad = div_rn(grad, x);
    bad |= !isfinite(grad);
  }
  return bad;
}

template <typename G, typename T>
__device__ __forceinline__ bool chunk_nonfinite(const Chunk& k, const G* g, int mode, T x) {
  const int n = (int)k.count;
  g += k.inner;
  return mode == GRAD_MUL   ? any_nonfinite<GRAD_MUL>(n, g, x)
         : mode == GRAD_DIV ? any_nonfinite<GRAD_DIV>(n, g, x)
                            : any_nonfinite<GRAD_PLAIN>(n, g, x);
}

// A chunk's hyperparameters in its arithmetic type, tested once per chunk.
template <typename T>
struct Rule {
  T lr, momentum, wd;
  bool decay, nesterov;
};

// V (1 or 2) consecutive elements i, i + 1 of one chunk, each computed alone with the same
// roundings in the same order whatever V is (the pair path's bits are the scalar path's):
// V == 2 only moves them with one __half2/float2/double2 access per array. g, p, v, p16 point at
// the chunk's first element. Write: the divided gradient is stored back over g (G is T then).
template <int V, int Mode, bool Half, bool Write, typename T, typename G>
__device__ __forceinline__ void update_elements(int i, const Rule<T>& h, T x, G* g, T* p,
                                                T* v, __half* p16) {
  T grad[V], pe[V], ve[V];
  if constexpr (Mode == GRAD_ZERO) {
    for (int j = 0; j < V; ++j) grad[j] = (T)0;
  } else {
    ctc::load_v<V>(g, i, grad);
  }
  ctc::load_v<V>(p, i, pe);
  ctc::load_v<V>(v, i, ve);
  if constexpr (Half) {   // a float16 parameter written from outside (load_npz, copyparams): adopt
    if constexpr (V == 2) {   // both lanes compared in one word: half2(pe) rounds each on its own
      const unsigned cur = *reinterpret_cast<const unsigned*>(p16 + i);
      const __half2 now = __floats2half2_rn(pe[0], pe[1]);
      const unsigned diff =
          cur ^ ((unsigned)__half_as_ushort(__low2half(now)) |
                 (unsigned)__half_as_ushort(__high2half(now)) << 16);
      if (diff & 0xffffu) pe[0] = __half2float(__ushort_as_half((unsigned short)cur));
      if (diff >> 16) pe[1] = __half2float(__ushort_as_half((unsigned short)(cur >> 16)));
    } else {
      const __half cur = p16[i];
      if (__half_as_ushort(cur) != __half_as_ushort(__float2half_rn(pe[0])))
        pe[0] = __half2float(cur);
    }
  }
  for (int j = 0; j < V; ++j) {
    T gj = grad[j];
    if (Mode == GRAD_MUL) gj = mul_rn(gj, x);
    if (Mode == GRAD_DIV) gj = div_rn(gj, x);
    if constexpr (Write) grad[j] = gj;
    if (h.decay) gj = add_rn(gj, mul_rn(h.wd, pe[j]));
    const T step = sub_rn(mul_rn(ve[j], h.momentum), mul_rn(h.lr, gj));
    ve[j] = step;
    pe[j] = add_rn(pe[j], h.nesterov ? sub_rn(mul_rn(step, h.momentum), mul_rn(h.lr, gj)) : step);
  }
  ctc::store_v<V>(v, i, ve);
  ctc::store_v<V>(p, i, pe);
  if constexpr (Half) ctc::store_v<V>(p16, i, pe);
  if constexpr (Write) ctc::store_v<V>(g, i, grad);
}

// One chunk's elements in one gradient mode. Pairs where every array the chunk touches starts
// at an address aligned to two of its elements (the optimizer's flat buffers start every
// parameter 256-byte aligned and chunks at multiples of 2048 elements, and Chainer's gradients
// are fresh allocations, so that is the usual case): half the loads, stores and index steps per
// element, thread t taking pairs t, t + OPT_BLOCK, ... and one thread an odd count's last
// element. Otherwise (a gradient that is a view at an odd element, a work list with odd offsets)
// one element at a time. The zero and division modes are rare and stay scalar.
template <int Mode, bool Half, bool Write, typename T, typename G>
__device__ __forceinline__ void update_mode(int n, const Rule<T>& h, T x, G* g, T* p, T* v,
                                            __half* p16) {
  bool pairs = Mode == GRAD_PLAIN || Mode == GRAD_MUL;
  if (pairs) {
    const unsigned long long wide = sizeof(T) * 2, narrow = sizeof(G) * 2;
    pairs = ((reinterpret_cast<unsigned long long>(p) | reinterpret_cast<unsigned long long>(v)) &
             (wide - 1)) == 0 &&
            (reinterpret_cast<unsigned long long>(g) & (narrow - 1)) == 0 &&
            (!Half || (reinterpret_cast<unsigned long long>(p16) & 3) == 0);
  }
  if (pairs) {
    // The thread's own pointers, stepped by adds: indexing the chunk's pointers with 2 * j made
    // NVVM fold the chunk offset back into a 64-bit index and rebuild every address from it.
    const int half_n = n >> 1, t = threadIdx.x;
    G* gt = g + 2 * t;
    T* pt = p + 2 * t;
    T* vt = v + 2 * t;
    __half* ht = Half ? p16 + 2 * t : nullptr;
    for (int j = t; j < half_n; j += OPT_BLOCK) {
      update_elements<2, Mode, Half, Write>(0, h, x, gt, pt, vt, ht);
      gt += 2 * OPT_BLOCK;
      pt += 2 * OPT_BLOCK;
      vt += 2 * OPT_BLOCK;
      if constexpr (Half) ht += 2 * OPT_BLOCK;
    }
    if ((n & 1) && threadIdx.x == OPT_BLOCK - 1)
      update_elements<1, Mode, Half, Write>(n - 1, h, x, g, p, v, p16);
  } else {
    for (int i = threadIdx.x; i < n; i += OPT_BLOCK)
      update_elements<1, Mode, Half, Write>(i, h, x, g, p, v, p16);
  }
}

// One chunk of the update in arithmetic type T (float, or double for float64 parameters).
// G is the gradient's storage type, p/v the master (or parameter) and momentum buffers, p16 the
// float16 parameters when Half. Everything per chunk (offsets, hyperparameters, the gradient's
// mode) is settled here; n <= 2048, so the element loops index in 32 bits.
template <typename T, typename G, bool Half>
__device__ __forceinline__ void update_chunk(const Chunk& k, const StepParams& sp, const Hyper& hy,
                                             const GradRef& gr, const double* divisors,
                                             const unsigned* scaler, T* p, T* v, __half* p16) {
  Rule<T> h;
  h.lr = (T)hy.lr;
  h.momentum = (T)hy.momentum;
  h.wd = (T)hy.weight_decay;
  h.decay = h.wd != (T)0;
  h.nesterov = sp.nesterov != 0;
  T x;
  const int mode = grad_mode<T>(sp, gr, divisors, k.entry, scaler, x);
  const int n = (int)k.count;
  G* g = gr.present ? static_cast<G*>(gr.address<Half>()) + k.inner : nullptr;
  p += k.flat;
  v += k.flat;
  if constexpr (Half) p16 += k.flat;
  const bool write = gr.write<Half>();
  if (mode == GRAD_MUL) {
    if (write) update_mode<GRAD_MUL, Half, !Half>(n, h, x, g, p, v, p16);
    else update_mode<GRAD_MUL, Half, false>(n, h, x, g, p, v, p16);
  } else if (mode == GRAD_PLAIN) {
    update_mode<GRAD_PLAIN, Half, false>(n, h, x, g, p, v, p16);
  } else if (mode == GRAD_DIV) {
    if (write) update_mode<GRAD_DIV, Half, !Half>(n, h, x, g, p, v, p16);
    else update_mode<GRAD_DIV, Half, false>(n, h, x, g, p, v, p16);
  } else {
    update_mode<GRAD_ZERO, Half, false>(n, h, x, g, p, v, p16);
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
momentum_sgd_check(const StepParams sp, const long long* __restrict__ chunks,
                   const double* __restrict__ divisors, unsigned* scaler) {
  volatile unsigned* found = scaler + SCALER_FOUND_INF;
  __shared__ unsigned already;                          // decided once, so the block agrees
  if (threadIdx.x == 0) already = *found;
  __syncthreads();
  if (already) return;                                  // another block already found one
  const opt::Chunk k = opt::load_chunk(chunks);
  const opt::GradRef g = opt::load_grad(sp, k);
  if (!g.present) return;
  bool bad;
  if (k.group == GROUP_F64) {
    double x;
    const int mode = opt::grad_mode<double>(sp, g, divisors, k.entry, scaler, x);
    bad = opt::chunk_nonfinite(k, static_cast<const double*>(g.address<false>()), mode, x);
  } else {
    float x;
    const int mode = opt::grad_mode<float>(sp, g, divisors, k.entry, scaler, x);
    bad = k.group == GROUP_F16
              ? opt::chunk_nonfinite(k, static_cast<const __half*>(g.address<true>()), mode, x)
              : opt::chunk_nonfinite(k, static_cast<const float*>(g.address<false>()), mode, x);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1u;
}

extern "C" __global__ void __launch_bounds__(OPT_BLOCK, OPT_MIN_BLOCKS)
momentum_sgd_update(const StepParams sp, const long long* __restrict__ chunks,
                    const double* __restrict__ divisors, float* __restrict__ p32, __half* __restrict__ p16, float* __restrict__ master,
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
        opt::update_chunk<double, double, false>(k, sp, h, g, divisors, scaler, p64, mom64,
                                                 nullptr);
      else if (k.group == GROUP_F16)
        opt::update_chunk<float, __half, true>(k, sp, h, g, divisors, scaler, master, mom16, p16);
      else
        opt::update_chunk<float, float, false>(k, sp, h, g, divisors, scaler, p32, mom32, nullptr);
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
