// The RMSNorm op: torch.nn.functional.rms_norm's contract (Zhang, Sennrich 2019, arXiv:1910.07467),
// with an optional zero-centred gain (y = x * rstd * (1 + weight), as Gemma), on the row
// normalization kernels of norm.h (math, dtypes and determinism stated there).
//
// Checked here for every binding: x's trailing dims equal normalized_shape (non-empty,
// positive sizes); weight of shape normalized_shape in x's dtype, or float32 for
// float16/bfloat16 x; eps finite and >= 0 (bindings resolve torch's eps=None). Errors: Error
// of kind kType for dtypes, kValue otherwise. Tensors are contiguous; bindings allocate outputs.
#pragma once

#include "norm/norm.h"

namespace fusedlayers {

struct RmsNormForward {
  TensorRef x;  // (..., *normalized_shape)
  Sizes normalized_shape;
  TensorRef weight;  // normalized_shape, or not defined
  double eps = 0;
  bool zero_centered = false;  // gain 1 + weight
  // Outputs: y like x; rstd of x's leading dims in norm_stat_dtype(x.dtype).
  void* y = nullptr;
  void* rstd = nullptr;
};

struct RmsNormBackward {
  TensorRef dy, x, rstd;
  Sizes normalized_shape;
  TensorRef weight;
  bool zero_centered = false;
  // Outputs: dx like x; dweight like weight where defined.
  void* dx = nullptr;
  void* dweight = nullptr;
  void* workspace = nullptr;  // rms_norm_backward_workspace_size() bytes
};

RowsCols rms_norm_forward_check(const RmsNormForward& a);
RowsCols rms_norm_backward_check(const RmsNormBackward& a);

// Run the pass on exec's device; a must have passed its check.
void rms_norm_forward(const RmsNormForward& a, RowsCols rc, const Exec& exec);
size_t rms_norm_backward_workspace_size(const RmsNormBackward& a, RowsCols rc, const Exec& exec);
void rms_norm_backward(const RmsNormBackward& a, RowsCols rc, const Exec& exec);

}  // namespace fusedlayers
