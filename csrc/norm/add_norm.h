// The add+norm ops: add_rms_norm and add_layer_norm, the residual add of a transformer block
// inside its norm (as Transformer Engine, flash-attention's dropout_add_layer_norm without
// dropout, and vLLM's fused_add_rms_norm):
//   h = x + residual,  y = norm(h)     (RMSNorm: NormMode::kRms; LayerNorm: NormMode::kLayer)
// in one pass forward and one backward, on the row normalization kernels of norm.h (the math,
// the rounding of h and of the residual's gradient, dtypes and determinism are stated there).
//
// Checked here for every binding, with errors named by the op (`add_rms_norm`,
// `add_layer_norm`, and `..._backward`): x's trailing dims equal normalized_shape (non-empty,
// positive sizes); residual of x's shape, in x's dtype or float32 for float16/bfloat16 x;
// weight (and bias) of shape normalized_shape in x's dtype or float32 for half x, one dtype
// for both; eps finite and >= 0. Errors: Error of kind kType for dtypes, kValue otherwise.
// Tensors are contiguous; bindings allocate outputs.
#pragma once

#include "norm/norm.h"

namespace fusedlayers {

// The op's name: add_rms_norm (kRms) or add_layer_norm (kLayer).
const char* add_norm_name(NormMode mode);

struct AddNormForward {
  NormMode mode;  // kRms or kLayer
  TensorRef x;    // (..., *normalized_shape)
  TensorRef residual;  // x's shape; x's dtype or float32
  Sizes normalized_shape;
  TensorRef weight, bias;  // normalized_shape, or not defined (bias: kLayer only)
  double eps = 0;
  bool zero_centered = false;  // kRms: gain 1 + weight
  // Outputs: y like x; h like residual; mean (kLayer) and rstd of x's leading dims in
  // norm_stat_dtype(x.dtype).
  void* y = nullptr;
  void* h = nullptr;
  void* mean = nullptr;
  void* rstd = nullptr;
};

struct AddNormBackward {
  NormMode mode;
  TensorRef dy;  // like x: the gradient of y
  TensorRef dh;  // like h: the gradient of h from its other uses, or not defined
  TensorRef h;   // the forward's h
  TensorRef mean, rstd;  // mean: kLayer only
  Sizes normalized_shape;
  TensorRef weight, bias;
  bool zero_centered = false;
  // Outputs: dx like dy; dresidual like h where h's dtype is not dy's (else dx holds it, and it
  // must be null); dweight / dbias like weight / bias where defined.
  void* dx = nullptr;
  void* dresidual = nullptr;
  void* dweight = nullptr;
  void* dbias = nullptr;
  void* workspace = nullptr;  // add_norm_backward_workspace_size() bytes
};

RowsCols add_norm_forward_check(const AddNormForward& a);
RowsCols add_norm_backward_check(const AddNormBackward& a);

// Run the pass on exec's device; a must have passed its check.
void add_norm_forward(const AddNormForward& a, RowsCols rc, const Exec& exec);
size_t add_norm_backward_workspace_size(const AddNormBackward& a, RowsCols rc, const Exec& exec);
void add_norm_backward(const AddNormBackward& a, RowsCols rc, const Exec& exec);

}  // namespace fusedlayers
