// The gated activations' device math (gated.h), shared by the gated kernels and those that
// write their results in FP8 (fp8/fp8_gated.h), so that both round the same float32 values.
#pragma once

#include "activation/cuda_gelu.cuh"
#include "activation/gated.h"

namespace fusedlayers::cuda {

template <GatedActivation kAct>
__device__ __forceinline__ float activation(float g) {
  if constexpr (kAct == GatedActivation::kSilu) {
    return g * sigmoid(g);
  } else {
    return gelu(g, kAct == GatedActivation::kGeluTanh);
  }
}

// act(g) into a, act'(g) into d.
template <GatedActivation kAct>
__device__ __forceinline__ void activation_and_grad(float g, float& a, float& d) {
  if constexpr (kAct == GatedActivation::kSilu) {
    const float s = sigmoid(g);
    a = g * s;
    d = s * fmaf(g, 1.0f - s, 1.0f);
  } else {
    a = gelu(g, kAct == GatedActivation::kGeluTanh);
    d = gelu_grad(g, kAct == GatedActivation::kGeluTanh);
  }
}

}  // namespace fusedlayers::cuda
