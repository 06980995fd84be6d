// AdamW over many tensors at once: Adam (Kingma & Ba 2015, arXiv:1412.6980) with decoupled weight
// decay (Loshchilov & Hutter 2019, arXiv:1711.05101), as torch.optim.AdamW computes it, for
// every parameter of a list in one pass over its tensors. With g the gradient (see below) and t
// the parameter's step count after this step:
//   w <- w * (1 - lr * weight_decay)
//   m <- m + (1 - beta1) * (g - m)                   (exp_avg)
//   v <- beta2 * v + (1 - beta2) * g^2                (exp_avg_sq)
//   v_max <- max(v_max, v), used in v's place         (amsgrad)
//   w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// g is the stored gradient divided by `grad_scale` (AMP's loss scale, when given), multiplied by
// the clip coefficient min(1, max_grad_norm / (norm + 1e-6)) of torch.nn.utils.clip_grad_norm_
// (norm: the 2-norm of all the unscaled gradients, from adamw_grad_sumsq; when max_grad_norm is
// given), and negated with `maximize`. Where `found_inf` is given and nonzero nothing is written
// (AMP's skipped step), else each parameter's step count advances by one.
//
// Storage: the parameter w of dtype P (float32, float64, float16, bfloat16) and its gradient of
// P; the moments m, v (and v_max) of one dtype M: P, or float32 for 16-bit P, or bfloat16 /
// float16 for float32 P; optionally a float32 `master` copy of a 16-bit w (master weights: the
// update runs on the master and writes it, and w is the master rounded to P in the same pass);
// the step count a float32 scalar (torch.optim.AdamW's state "step"). Math in float32 (float64
// for float64 P), each stored value rounded once to its dtype; per-parameter coefficients
// (bias corrections, the learning rate's steps) in float64. Deterministic: an element's update
// reads only its own values, and the norm's sums have a fixed order.
//
// On CUDA the learning rate, the step counts, grad_scale, found_inf and the norm are read from
// device memory where the pass runs: no host sync, so a step captures in a CUDA graph. The
// tensors are grouped by their dtypes and each group's table of pointers and sizes travels in
// the kernel's parameters, hundreds of tensors a launch.
#pragma once

#include <cmath>
#include <vector>

#include "util/common.h"

// The update's math, compiled into both the CPU loops (always inlined, into each target clone)
// and the CUDA kernels.
#ifdef __CUDACC__
#define FUSEDLAYERS_ADAMW_INLINE __host__ __device__ __forceinline__
#else
#define FUSEDLAYERS_ADAMW_INLINE inline __attribute__((always_inline))
#endif

namespace fusedlayers {

// One parameter's tensors, each `numel` elements, dense (the same element order in every one).
struct AdamWTensors {
  TensorRef param, grad, exp_avg, exp_avg_sq;
  TensorRef max_exp_avg_sq;  // with amsgrad
  TensorRef master;          // float32, or undefined
  TensorRef step;            // float32, one element
};

struct AdamWOptions {
  double lr = 1e-3;
  const float* lr_device = nullptr;  // when set, the learning rate is read here
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  bool amsgrad = false, maximize = false;
  const float* grad_scale = nullptr;  // float32 scalar, or null
  const float* found_inf = nullptr;   // float32 scalar, or null
  const double* grad_sumsq = nullptr;  // adamw_grad_sumsq's result, with max_grad_norm > 0
  double max_grad_norm = 0;            // 0: no clipping
};

// The dtype rules: masters are for 16-bit parameters; moments of dtype M beside parameters of P
// are P's dtype, float32 for 16-bit P, or 16-bit for float32 P (float64 P keeps float64).
constexpr bool adamw_half(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }
constexpr bool adamw_moment_dtype_ok(DType p, DType m) {
  return m == p || (adamw_half(p) && m == DType::kFloat32) ||
         (p == DType::kFloat32 && adamw_half(m));
}

// Every rule of the arguments (dtypes, sizes, hyperparameters); Error of kind kType for dtypes,
// kValue otherwise, naming `adamw`.
void adamw_check(const std::vector<AdamWTensors>& params, const AdamWOptions& o);
void adamw_grad_sumsq_check(const std::vector<TensorRef>& grads);

// The update of every parameter (and their step counts) on exec's device.
void adamw_step(const std::vector<AdamWTensors>& params, const AdamWOptions& o, const Exec& exec);

// The sum of squares of every element of `grads`, into *sumsq (float64, exec's memory): the
// norm of the gradients is its square root (times 1 / grad_scale). Per-chunk partials in
// `workspace` (adamw_grad_sumsq_workspace_size bytes), summed in a fixed order. A binding whose
// parameters are shards sums the shards' results across processes before the update reads it.
size_t adamw_grad_sumsq_workspace_size(const std::vector<TensorRef>& grads);
void adamw_grad_sumsq(const std::vector<TensorRef>& grads, double* sumsq, void* workspace,
                      const Exec& exec);

// A square root inlined where the loops run (std::sqrt is a call inside a CPU target clone).
FUSEDLAYERS_ADAMW_INLINE float adamw_sqrt(float v) {
#ifdef __CUDA_ARCH__
  return sqrtf(v);
#else
  return __builtin_sqrtf(v);
#endif
}
FUSEDLAYERS_ADAMW_INLINE double adamw_sqrt(double v) {
#ifdef __CUDA_ARCH__
  return ::sqrt(v);
#else
  return __builtin_sqrt(v);
#endif
}

FUSEDLAYERS_ADAMW_INLINE double adamw_pow(double a, double b) {
#ifdef __CUDA_ARCH__
  return ::pow(a, b);
#else
  return std::pow(a, b);
#endif
}

// One step's coefficients for one parameter, in its math type A: g = stored gradient * g_scale.
template <typename A>
struct AdamWCoefficients {
  A decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, g_scale;
};

// g_scale's global factor, from the options alone: 1 / grad_scale, times the clip coefficient
// (NaN where the norm is: clip_grad_norm_'s clamp keeps NaN), negated with maximize.
FUSEDLAYERS_ADAMW_INLINE double adamw_grad_factor(const AdamWOptions& o, double grad_scale,
                                                  double grad_sumsq) {
  double f = 1 / grad_scale;
  if (o.max_grad_norm > 0) {
    const double clip = o.max_grad_norm / (adamw_sqrt(grad_sumsq) / grad_scale + 1e-6);
    f *= clip > 1 ? 1 : clip;
  }
  return o.maximize ? -f : f;
}

// A parameter's coefficients at its step count `step` before this step, in float64 (rounded to
// A once, as torch.optim.AdamW's Python scalars are).
template <typename A>
FUSEDLAYERS_ADAMW_INLINE AdamWCoefficients<A> adamw_coefficients(const AdamWOptions& o,
                                                                 double lr, double step,
                                                                 double grad_factor) {
  const double t = step + 1;
  return {A(1 - lr * o.weight_decay), A(1 - o.beta1), A(o.beta2), A(1 - o.beta2),
          A(lr / (1 - adamw_pow(o.beta1, t))), A(adamw_sqrt(1 - adamw_pow(o.beta2, t))),
          A(o.eps), A(grad_factor)};
}

// One element: w (the master, or the parameter), m, v, v_max updated in A; g as stored.
template <bool kAmsgrad, typename A>
FUSEDLAYERS_ADAMW_INLINE void adamw_update(A& w, A& m, A& v, A& v_max, A g,
                                           const AdamWCoefficients<A>& c) {
  g *= c.g_scale;
  w *= c.decay;
  m += c.one_minus_beta1 * (g - m);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  A d = v;
  if constexpr (kAmsgrad) {
    v_max = (v > v_max || v != v) ? v : v_max;  // torch.maximum: NaN wins
    d = v_max;
  }
  w -= c.step_size * m / (adamw_sqrt(d) / c.bc2_sqrt + c.eps);
}

// The elements a chunk of the table holds: one CUDA block's work, one CPU task's, one partial
// of the norm.
constexpr int64_t kAdamWChunk = 8192;

// The kernels, on the tensors of one dtype combination (P, M, master) after the check: the
// update, then each member's step count advanced.
struct AdamWKernelArgs {
  const std::vector<AdamWTensors>* params;
  std::vector<int64_t> members;  // indices into *params
  DType param_dtype, moment_dtype;
  bool master;
};
void adamw_step_cpu(const AdamWKernelArgs& k, const AdamWOptions& o,
                    const ParallelFor& parallel_for);
void adamw_step_cuda(const AdamWKernelArgs& k, const AdamWOptions& o, cudaStream_t stream);
void adamw_grad_sumsq_cpu(const std::vector<TensorRef>& grads, double* sumsq, double* partials,
                          const ParallelFor& parallel_for);
void adamw_grad_sumsq_cuda(const std::vector<TensorRef>& grads, double* sumsq, double* partials,
                           cudaStream_t stream);

}  // namespace fusedlayers
