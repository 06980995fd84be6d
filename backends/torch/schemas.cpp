// The operator schemas of the fusedlayers torch library: the single source of truth for
// argument names and types. Implementations live in one file per op, autograd in autograd.cpp;
// Python adds the fake (meta) kernels in fusedlayers/torch/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(fusedlayers, m) {
  m.def("relu_scale(Tensor x, float alpha) -> Tensor");
  // mask: int32 words of packed bits, where x is not <= 0 (layout in csrc/relu_scale.h).
  m.def("relu_scale_with_mask(Tensor x, float alpha) -> (Tensor out, Tensor mask)");
  m.def("relu_scale_backward(Tensor grad_out, Tensor mask, float alpha) -> Tensor");
  // mean/rstd have the leading (unnormalized) shape of input; memory_efficient only tells
  // autograd to save the output instead of the input; subtract_mean=False is Keras'
  // rms_scaling (y = x * rstd * weight, see csrc/layer_norm.h).
  m.def(
      "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps, bool memory_efficient=False, bool subtract_mean=True) "
      "-> (Tensor out, Tensor mean, Tensor rstd)");
  // saved is the input, or the output when memory_efficient; grad_weight/grad_bias are empty
  // when weight/bias are None.
  m.def(
      "layer_norm_backward(Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, "
      "SymInt[] normalized_shape, Tensor? weight, Tensor? bias, bool memory_efficient=False, "
      "bool subtract_mean=True) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // weight is (out_features, in_features), stored so or as the transpose of a contiguous
  // (in_features, out_features) tensor (both read in place). linear_gelu_with_pre also returns
  // the pre-activation input @ weight^T + bias, kept for the backward; grad_weight has weight's
  // layout.
  m.def("linear_gelu(Tensor input, Tensor weight, Tensor? bias, str approximate) -> Tensor");
  m.def(
      "linear_gelu_with_pre(Tensor input, Tensor weight, Tensor? bias, str approximate) "
      "-> (Tensor out, Tensor pre)");
  m.def(
      "linear_gelu_backward(Tensor grad_out, Tensor input, Tensor weight, Tensor pre, "
      "bool has_bias, str approximate) -> (Tensor grad_input, Tensor grad_weight, "
      "Tensor grad_bias)");
}
