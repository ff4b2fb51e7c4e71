// kernels/optimizer.cu: momentum SGD for every parameter of a model in one launch, with fp32
// master weights, weight decay, loss-scale unscaling and dynamic loss scaling decided on the device.
//
// Memory the optimizer owns (chainer_tc/optimizers/_flat.py builds it once, at setup):
//   p32     float32 parameters, all in one flat buffer (each Parameter's array is a view of it)
//   p16     float16 parameters, likewise; master holds their float32 master copies, same offsets
//   mom32   momentum of the float32 parameters, mom16 of the float16 ones (float32, same offsets)
//   chunks  the work list: 4 int64 per chunk of at most OPT_CHUNK elements of one parameter:
//             [0] offset of the chunk in its flat buffer
//             [1] offset of the chunk inside the parameter (and so inside its gradient)
//             [2] number of elements (1..OPT_CHUNK)
//             [3] bits 0-31: index of the parameter's gradient in StepParams.grad
//                 bit 32: float16 parameter (p16/master/mom16) rather than float32 (p32/mom32)
//                 bit 33: the parameter takes weight decay
//   scaler  uint32[8], the loss-scale state (SCALER_* below)
// Gradients are wherever Chainer's backward put them: their addresses come with every launch in
// StepParams.grad (a null address means "no gradient": zero, as Chainer reallocates it), in the
// parameter's dtype and C-contiguous.
//
// Per element, in float32, each operation rounded once (the _rn intrinsics forbid fma
// contraction). For float32 parameters this is bit for bit what NumPy computes for
// chainer.optimizers.MomentumSGD with the WeightDecay hook; for float16 ones the decay uses the
// float32 master (Chainer's use_fp32_update adds it in float16, before the conversion):
//   g = grad / scale                       (scaling != 0)
//   g = g + weight_decay * p               (if the parameter takes weight decay, and wd != 0)
//   v = v * momentum - lr * g
//   p = p + v                              (nesterov: p = p + (v * momentum - lr * g))
//   float16 parameters: master = p, p16 = half(p) rounded to nearest even. Before the update, a
//   float16 parameter that no longer equals half(master) was written from outside the optimizer
//   (serializers.load_npz, copyparams, by hand): its value becomes the new master.
//
// Entry points (launch: grid = number of chunks handled by the launch, block = OPT_BLOCK):
//   momentum_sgd_check(sp, chunks, scaler)
//     Dynamic loss scaling only, before the update: sets scaler[SCALER_FOUND_INF] if any unscaled
//     gradient element is inf or nan. Reads gradients; writes only that flag.
//   momentum_sgd_update(sp, chunks, p32, p16, master, mom32, mom16, scaler)
//     Applies the update unless scaler[SCALER_FOUND_INF] is set, in which case it writes nothing
//     at all to parameters, masters or momenta. With dynamic scaling, the last block of the step
//     (sp.total_blocks blocks over all update launches) then updates the scale: halve on overflow
//     (not below sp.min_scale), double after sp.interval clean steps in a row (not above
//     sp.max_scale), counts skipped steps, and clears the flag and its own block counter.
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
enum {
  SCALER_SCALE = 0,       // float32 bits of the loss scale
  SCALER_CLEAN = 1,       // clean steps since the scale last changed
  SCALER_FOUND_INF = 2,   // set by momentum_sgd_check, cleared at the end of the step
  SCALER_SKIPPED = 3,     // steps skipped so far
  SCALER_DONE = 4,        // update blocks finished in this step
  SCALER_SCALE_F16 = 5,   // float16 bits of the loss scale (seed for a float16 loss)
};

// Passed by value (it is the kernel's parameter block): hyperparameters and gradient addresses.
struct StepParams {
  float lr, momentum, weight_decay;
  int nesterov;
  int scaling;              // SCALE_NONE, SCALE_STATIC or SCALE_DYNAMIC
  unsigned interval;        // dynamic: clean steps before the scale doubles
  float min_scale, max_scale;
  unsigned total_blocks;    // dynamic: update blocks of this step, over all launches
  unsigned reserved;
  unsigned long long grad[OPT_GRAD_TABLE];
};
static_assert(sizeof(StepParams) == 40 + 8 * OPT_GRAD_TABLE, "StepParams layout is shared with Python");

namespace opt {

struct Chunk {
  long long flat, inner, count;
  unsigned grad_index;
  bool half, decay;
};

__device__ __forceinline__ Chunk load_chunk(const long long* chunks) {
  const long long* c = chunks + 4 * (long long)blockIdx.x;
  Chunk k;
  k.flat = c[0];
  k.inner = c[1];
  k.count = c[2];
  k.grad_index = (unsigned)(c[3] & 0xffffffffLL);
  k.half = (c[3] >> 32) & 1;
  k.decay = (c[3] >> 33) & 1;
  return k;
}

__device__ __forceinline__ float load_grad(const void* g, bool half, long long i) {
  return half ? __half2float(static_cast<const __half*>(g)[i]) : static_cast<const float*>(g)[i];
}

__device__ __forceinline__ float unscale(float g, const StepParams& sp, float scale) {
  return sp.scaling == SCALE_NONE ? g : __fdiv_rn(g, scale);
}

__device__ __forceinline__ float read_scale(const unsigned* scaler) {
  return __uint_as_float(scaler[SCALER_SCALE]);
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
  const void* g = reinterpret_cast<const void*>(sp.grad[k.grad_index]);
  if (!g) return;
  const float scale = opt::read_scale(scaler);
  bool bad = false;
  for (long long i = threadIdx.x; i < k.count; i += OPT_BLOCK)
    bad |= !isfinite(opt::unscale(opt::load_grad(g, k.half, k.inner + i), sp, scale));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1u;
}

extern "C" __global__ void __launch_bounds__(OPT_BLOCK, OPT_MIN_BLOCKS)
momentum_sgd_update(const StepParams sp, const long long* __restrict__ chunks,
                    float* __restrict__ p32, __half* __restrict__ p16, float* __restrict__ master,
                    float* __restrict__ mom32, float* __restrict__ mom16, unsigned* scaler) {
  const bool dynamic = sp.scaling == SCALE_DYNAMIC;
  if (!(dynamic && scaler[SCALER_FOUND_INF])) {
    const opt::Chunk k = opt::load_chunk(chunks);
    const void* g = reinterpret_cast<const void*>(sp.grad[k.grad_index]);
    const float scale = opt::read_scale(scaler);
    float* p = k.half ? master : p32;
    float* v = k.half ? mom16 : mom32;
    for (long long i = threadIdx.x; i < k.count; i += OPT_BLOCK) {
      const long long e = k.flat + i;
      float grad = g ? opt::unscale(opt::load_grad(g, k.half, k.inner + i), sp, scale) : 0.0f;
      float pe = p[e];
      if (k.half) {   // a float16 parameter written from outside (load_npz, copyparams): adopt it
        const __half cur = p16[e];
        if (__half_as_ushort(cur) != __half_as_ushort(__float2half_rn(pe))) pe = __half2float(cur);
      }
      if (k.decay && sp.weight_decay != 0.0f) grad = __fadd_rn(grad, __fmul_rn(sp.weight_decay, pe));
      const float step = __fsub_rn(__fmul_rn(v[e], sp.momentum), __fmul_rn(sp.lr, grad));
      v[e] = step;
      pe = __fadd_rn(pe, sp.nesterov
                             ? __fsub_rn(__fmul_rn(step, sp.momentum), __fmul_rn(sp.lr, grad))
                             : step);
      p[e] = pe;
      if (k.half) p16[e] = __float2half_rn(pe);
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
