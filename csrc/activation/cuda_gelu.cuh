// GELU and the sigmoid in CUDA device code, for kernels that must run at memory speed (~35 FP32
// instructions per bf16 element on an H100): Phi(u) comes from e^{-u^2/2} times the scaled erfc
// fit of gelu.h (relative error ~2e-7 in both tails), so the erf gradient's Phi and pdf share
// one exponential; the tanh form is written as a sigmoid, 1 / (1 + e^{-2z}), to avoid
// cancellation. Reciprocals and exponentials are the MUFU approximations (__expf: 2 + 1.2 |x|
// ulp, ~3e-6 relative at the tail's |x| ~ 40). The forms and constants are gelu.h's.
#pragma once

#include "activation/gelu.h"

namespace fusedlayers {
namespace cuda {

constexpr float kSqrt2OverPi = gelu::kSqrt2OverPi;
constexpr float kInvSqrt2Pi = gelu::kInvSqrt2Pi;
constexpr float kCubic = gelu::kCubic;

// erfc(z) e^{z^2} at z = |u| / sqrt 2: t G(t), the fit of gelu.h. Horner, not Estrin: with many
// warps per SM the pass is throughput-bound, not latency-bound.
__device__ __forceinline__ float erfcx_of_abs(float u) {
  using namespace gelu;
  const float t = __fdividef(1.0f, fmaf(fabsf(u), kHalfInvSqrt2, 1.0f));
  float g = fmaf(kErfcx8, t, kErfcx7);
  g = fmaf(g, t, kErfcx6);
  g = fmaf(g, t, kErfcx5);
  g = fmaf(g, t, kErfcx4);
  g = fmaf(g, t, kErfcx3);
  g = fmaf(g, t, kErfcx2);
  g = fmaf(g, t, kErfcx1);
  g = fmaf(g, t, kErfcx0);
  return t * g;
}

// Phi(u), given e = exp(-u^2 / 2): the upper tail P(N(0,1) > |u|) = erfcx * e / 2, no
// cancellation in either tail.
__device__ __forceinline__ float normal_cdf(float u, float e) {
  const float q = 0.5f * erfcx_of_abs(u) * e;
  return u > 0.0f ? 1.0f - q : q;
}

// sigmoid(2z) = 1 / (1 + e^{-2z}), z = sqrt(2/pi) (u + 0.044715 u^3); 0 once e^{-2z} overflows.
__device__ __forceinline__ float tanh_cdf(float u) {
  const float z = kSqrt2OverPi * fmaf(kCubic * u, u * u, u);
  return __fdividef(1.0f, 1.0f + __expf(-2.0f * z));
}

__device__ __forceinline__ float gelu(float u, bool tanh_form) {
  return u * (tanh_form ? tanh_cdf(u) : normal_cdf(u, __expf(-0.5f * u * u)));
}

__device__ __forceinline__ float gelu_grad(float u, bool tanh_form) {
  if (tanh_form) {
    const float s = tanh_cdf(u);
    return s + 2.0f * u * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * u * u);
  }
  const float e = __expf(-0.5f * u * u);
  return normal_cdf(u, e) + u * kInvSqrt2Pi * e;
}

// sigmoid(u) = 1 / (1 + e^{-u}): 0 once e^{-u} overflows.
__device__ __forceinline__ float sigmoid(float u) { return __fdividef(1.0f, 1.0f + __expf(-u)); }

}  // namespace cuda
}  // namespace fusedlayers
