// Gated activations, the feed-forward layers of the GLU variants (Shazeer 2020, "GLU Variants
// Improve Transformer", arXiv:2002.05202) that Llama, Mistral, Qwen (SwiGLU) and Gemma (GeGLU)
// use between their gate/up and down projections:
//   swiglu(gate, up) = silu(gate) * up,  silu(g) = g sigmoid(g)
//   geglu(gate, up)  = gelu(gate) * up   (either form of gelu.h: approximate 'none' or 'tanh')
// Backward, recomputing the activation from gate (nothing is saved but gate and up):
//   dup = dy act(gate),  dgate = dy up act'(gate),  silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
// All math in float32 (float64 for float64) with one rounding per output: float32 results are
// the unfused `F.silu(gate) * up` to float32's rounding, half results that layer's rounded once
// where it rounds twice (the activation, then the product).
//
// The op's contract, for every binding: gate and up of one shape and dtype, viewed as rows x
// cols over their last dim (a 0-d tensor is one element); each may be a view whose rows are
// `*_stride` elements apart (cols contiguous), as the halves of one projection split with
// chunk(2, -1); dy and every output contiguous, of gate's shape and dtype. Deterministic:
// elementwise, no sums. Errors: Error of kind kType for dtypes, kValue otherwise, naming the
// public op the caller passes (swiglu, geglu, or their _backward).
#pragma once

#include <string>
#include <type_traits>

#include "util/common.h"
#include "activation/gelu.h"

namespace fusedlayers {

enum class GatedActivation { kSilu, kGelu, kGeluTanh };

// geglu's `approximate` ('none' or 'tanh', as gelu.h), an Error naming op otherwise.
inline GatedActivation geglu_activation(const char* op, const std::string& approximate) {
  return parse_gelu_approx(op, approximate) == GeluApprox::kTanh ? GatedActivation::kGeluTanh
                                                                 : GatedActivation::kGelu;
}

// fn(std::integral_constant<GatedActivation, act>{}): each activation a kernel instantiation.
template <typename Fn>
void with_activation(GatedActivation act, Fn&& fn) {
  using A = GatedActivation;
  switch (act) {
    case A::kSilu: fn(std::integral_constant<A, A::kSilu>{}); return;
    case A::kGelu: fn(std::integral_constant<A, A::kGelu>{}); return;
    case A::kGeluTanh: fn(std::integral_constant<A, A::kGeluTanh>{}); return;
  }
}

// A tensor's rows: 0 for contiguous ones (cols apart), else the elements between rows.
struct GatedInput {
  TensorRef t;
  int64_t row_stride = 0;
};

struct GatedForward {
  GatedInput gate, up;
  GatedActivation activation = GatedActivation::kSilu;
  void* y = nullptr;  // like gate, contiguous
};

struct GatedBackward {
  TensorRef dy;  // contiguous, gate's shape and dtype
  GatedInput gate, up;
  GatedActivation activation = GatedActivation::kSilu;
  void* dgate = nullptr;  // like gate, contiguous
  void* dup = nullptr;
};

RowsCols gated_forward_check(const char* op, const GatedForward& a);
RowsCols gated_backward_check(const char* op, const GatedBackward& a);
// Run the pass on exec's device; a must have passed its check.
void gated_forward(const GatedForward& a, RowsCols rc, const Exec& exec);
void gated_backward(const GatedBackward& a, RowsCols rc, const Exec& exec);

// The kernels: rows x cols of `dtype`, gate and up rows gate_stride and up_stride elements apart
// (>= cols), dy and the outputs contiguous.
void gated_forward_cpu(const void* gate, int64_t gate_stride, const void* up, int64_t up_stride,
                       void* y, int64_t rows, int64_t cols, GatedActivation activation,
                       DType dtype, const ParallelFor& parallel_for);
void gated_backward_cpu(const void* dy, const void* gate, int64_t gate_stride, const void* up,
                        int64_t up_stride, void* dgate, void* dup, int64_t rows, int64_t cols,
                        GatedActivation activation, DType dtype, const ParallelFor& parallel_for);
// CUDA: the same on device pointers, launched on `stream` of the current device, for
// float32/float16/bfloat16. 16-byte vectors where cols, the strides and the pointers allow.
void gated_forward_cuda(const void* gate, int64_t gate_stride, const void* up, int64_t up_stride,
                        void* y, int64_t rows, int64_t cols, GatedActivation activation,
                        DType dtype, cudaStream_t stream);
void gated_backward_cuda(const void* dy, const void* gate, int64_t gate_stride, const void* up,
                         int64_t up_stride, void* dgate, void* dup, int64_t rows, int64_t cols,
                         GatedActivation activation, DType dtype, cudaStream_t stream);

}  // namespace fusedlayers
