// The RMSNorm op: torch.nn.functional.rms_norm's contract (Zhang, Sennrich 2019, arXiv:1910.07467),
// with an optional zero-centred gain (y = x * rstd * (1 + weight), as Gemma), on the row
// normalization kernels of norm.h (math, dtypes and determinism stated there).
//
// Checked here for every binding: input's trailing dims equal normalized_shape (non-empty,
// positive sizes); weight of shape normalized_shape in input's dtype, or float32 for
// float16/bfloat16 input; eps finite and >= 0 (bindings resolve torch's eps=None). Errors: Error
// of kind kType for dtypes, kValue otherwise. Tensors are contiguous; bindings allocate outputs.
#pragma once

#include "norm.h"

namespace fusedlayers {

struct RmsNormForward {
  TensorRef input;  // (..., *normalized_shape)
  Sizes normalized_shape;
  TensorRef weight;  // normalized_shape, or not defined
  double eps = 0;
  bool zero_centered = false;  // gain 1 + weight
  // Outputs: out like input; rstd of input's leading dims in norm_stat_dtype(input.dtype).
  void* out = nullptr;
  void* rstd = nullptr;
};

struct RmsNormBackward {
  TensorRef grad_out, input, rstd;
  Sizes normalized_shape;
  TensorRef weight;
  bool zero_centered = false;
  // Outputs: grad_input like input; grad_weight like weight where defined.
  void* grad_input = nullptr;
  void* grad_weight = nullptr;
  void* workspace = nullptr;  // rms_norm_backward_workspace_size() bytes
};

RowsCols rms_norm_forward_check(const RmsNormForward& a);
RowsCols rms_norm_backward_check(const RmsNormBackward& a);

// Run the pass on exec's device; a must have passed its check.
void rms_norm_forward(const RmsNormForward& a, RowsCols rc, const Exec& exec);
size_t rms_norm_backward_workspace_size(const RmsNormBackward& a, RowsCols rc, const Exec& exec);
void rms_norm_backward(const RmsNormBackward& a, RowsCols rc, const Exec& exec);

}  // namespace fusedlayers
