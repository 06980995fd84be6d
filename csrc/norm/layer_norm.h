// The LayerNorm op: torch.nn.functional.layer_norm's contract, plus Keras' rms_scaling, on the
// row normalization kernels of norm.h (the math, dtypes and determinism are stated there).
//
// Every argument rule is checked here, for every binding: x's trailing dims equal
// normalized_shape (non-empty, positive sizes); weight and bias have shape normalized_shape and
// x's dtype, or float32 for float16/bfloat16 x, one dtype for both; eps finite and >= 0;
// no bias with rms_scaling; memory_efficient only without rms_scaling. Errors: Error of kind
// kType for dtypes, kValue otherwise. Tensors are contiguous; the bindings allocate the outputs.
#pragma once

#include "norm/norm.h"

namespace fusedlayers {

struct LayerNormForward {
  TensorRef x;  // (..., *normalized_shape)
  Sizes normalized_shape;
  TensorRef weight, bias;  // normalized_shape, or not defined
  double eps = 1e-5;
  bool rms_scaling = false;  // NormMode::kKerasRmsScaling instead of kLayer
  // Outputs: y like x; mean, rstd of x's leading dims in norm_stat_dtype(x.dtype).
  void* y = nullptr;
  void* mean = nullptr;
  void* rstd = nullptr;
};

struct LayerNormBackward {
  TensorRef dy;  // like saved
  TensorRef saved;     // x, or y when memory_efficient
  TensorRef mean, rstd;
  Sizes normalized_shape;
  TensorRef weight, bias;
  bool memory_efficient = false, rms_scaling = false;
  // Outputs: dx like saved; dweight / dbias like weight / bias where defined.
  void* dx = nullptr;
  void* dweight = nullptr;
  void* dbias = nullptr;
  void* workspace = nullptr;  // layer_norm_backward_workspace_size() bytes
};

// Checks every argument rule; rows x cols of the normalized view.
RowsCols layer_norm_forward_check(const LayerNormForward& a);
RowsCols layer_norm_backward_check(const LayerNormBackward& a);

// Run the pass on exec's device; a must have passed its check.
void layer_norm_forward(const LayerNormForward& a, RowsCols rc, const Exec& exec);
size_t layer_norm_backward_workspace_size(const LayerNormBackward& a, RowsCols rc,
                                          const Exec& exec);
void layer_norm_backward(const LayerNormBackward& a, RowsCols rc, const Exec& exec);

}  // namespace fusedlayers
