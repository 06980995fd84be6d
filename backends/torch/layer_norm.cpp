// fusedlayers::layer_norm{,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor conversion
// around csrc/norm/layer_norm.h, which checks every argument), autograd and autocast.
#include <ATen/autocast_mode.h>

#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "norm/layer_norm.h"

namespace fusedlayers::torch_binding {
namespace {

using ForwardSig = Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                           const OptTensor&, double, bool, bool);
using BackwardSig = Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                            const OptTensor&, bool, bool);

Tensor3 forward_kernel(const at::Tensor& x_in, at::IntArrayRef normalized_shape,
                       const OptTensor& weight_in, const OptTensor& bias_in, double eps,
                       bool /*memory_efficient: read by autograd only*/, bool rms_scaling) {
  check_tensors("layer_norm", "x", x_in, {{"weight", &weight_in}, {"bias", &bias_in}});
  const at::Tensor x = x_in.contiguous();
  const OptTensor weight = contiguous(weight_in), bias = contiguous(bias_in);
  LayerNormForward a{ref(x), sizes(normalized_shape), ref(weight), ref(bias), eps, rms_scaling};
  const RowsCols rc = call_csrc([&] { return layer_norm_forward_check(a); });
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor mean = stats(x, normalized_shape), rstd = stats(x, normalized_shape);
  a.y = y.data_ptr();
  a.mean = mean.data_ptr();
  a.rstd = rstd.data_ptr();
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { layer_norm_forward(a, rc, exec_for(x)); });
  return {y, mean, rstd};
}

Tensor3 backward_kernel(const at::Tensor& dy_in, const at::Tensor& saved_in,
                        const at::Tensor& mean_in, const at::Tensor& rstd_in,
                        at::IntArrayRef normalized_shape, const OptTensor& weight_in,
                        const OptTensor& bias_in, bool memory_efficient, bool rms_scaling) {
  const char* op = "layer_norm_backward";
  const OptTensor dy_opt(dy_in), rstd_opt(rstd_in);
  const OptTensor mean_opt = memory_efficient ? OptTensor() : OptTensor(mean_in);
  check_tensors(op, "saved", saved_in, {{"dy", &dy_opt}, {"mean", &mean_opt}, {"rstd", &rstd_opt},
                               {"weight", &weight_in}, {"bias", &bias_in}});
  const at::Tensor dy = dy_in.contiguous(), saved = saved_in.contiguous();
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const OptTensor weight = contiguous(weight_in), bias = contiguous(bias_in);
  LayerNormBackward a{ref(dy),  ref(saved),  ref(mean),       ref(rstd), sizes(normalized_shape),
                      ref(weight), ref(bias), memory_efficient, rms_scaling};
  const RowsCols rc = call_csrc([&] { return layer_norm_backward_check(a); });
  at::Tensor dx = at::empty(saved.sizes(), saved.options());
  at::Tensor dweight = param_grad(weight, saved), dbias = param_grad(bias, saved);
  a.dx = dx.data_ptr();
  a.dweight = weight ? dweight.data_ptr() : nullptr;
  a.dbias = bias ? dbias.data_ptr() : nullptr;
  run_with_workspace(saved, a, rc, layer_norm_backward_workspace_size, layer_norm_backward);
  return {dx, dweight, dbias};
}

// Saves x (or, memory_efficient, y), mean, rstd and the parameters.
struct LayerNormBackwardNode final : SavingNode<LayerNormBackwardNode> {
  static constexpr const char* kName = "fusedlayers::LayerNormBackwardNode";
  SavedVariable saved, mean, rstd, weight, bias;
  int64_t norm_ndims = 0;
  bool memory_efficient = false, rms_scaling = false, has_weight = false, has_bias = false;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<BackwardSig>("layer_norm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(3);
    if (!grads[0].defined()) return out;  // only mean/rstd were used: nothing flows back
    const at::Tensor s = saved.unpack(getptr()), m = mean.unpack(), r = rstd.unpack();
    const OptTensor w = unpack_if(weight, has_weight), b = unpack_if(bias, has_bias);
    BackwardGuard guard;
    auto [dx, dw, db] = backward.call(grads[0], s, m, r, s.sym_sizes().slice(s.dim() - norm_ndims),
                                      w, b, memory_efficient, rms_scaling);
    out[0] = std::move(dx);
    if (has_weight) out[1] = std::move(dw);
    if (has_bias) out[2] = std::move(db);
    return out;
  }
  auto saved_variables() { return std::array{&saved, &mean, &rstd, &weight, &bias}; }
};

Tensor3 autograd_kernel(const at::Tensor& x, c10::SymIntArrayRef normalized_shape,
                        const OptTensor& weight, const OptTensor& bias, double eps,
                        bool memory_efficient, bool rms_scaling) {
  static const auto forward = op<ForwardSig>("layer_norm");
  const bool grad = needs_grad({&x, ptr_if(weight), ptr_if(bias)});
  const Tensor3 out = below_autograd(
      [&] { return forward.call(x, normalized_shape, weight, bias, eps, memory_efficient,
                                rms_scaling); });
  if (!grad) return out;
  const auto& [y, mean, rstd] = out;
  auto node = make_node<LayerNormBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
  torch::autograd::set_history(y, node);  // mean and rstd are not differentiable
  node->saved = memory_efficient ? SavedVariable(y, true) : SavedVariable(x, false);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  std::tie(node->weight, node->has_weight) = save_if(weight);
  std::tie(node->bias, node->has_bias) = save_if(bias);
  node->norm_ndims = static_cast<int64_t>(normalized_shape.size());
  node->memory_efficient = memory_efficient;
  node->rms_scaling = rms_scaling;
  return out;
}

// Autocast as ATen's for layer_norm: float32 on CUDA; on the CPU ATen registers none.
Tensor3 autocast_cuda_kernel(const at::Tensor& x, c10::SymIntArrayRef normalized_shape,
                             const OptTensor& weight, const OptTensor& bias, double eps,
                             bool memory_efficient, bool rms_scaling) {
  static const auto forward = op<ForwardSig>("layer_norm");
  const AutocastToFloat cast;
  return forward.call(cast(x), normalized_shape, cast(weight), cast(bias), eps, memory_efficient,
                      rms_scaling);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // mean/rstd have the leading (unnormalized) shape of x; memory_efficient only tells autograd
  // to save y instead of x; rms_scaling is Keras' LayerNormalization(rms_scaling=True) (see
  // csrc/norm/norm.h). saved is x, or y when memory_efficient; dweight/dbias are empty when
  // weight/bias are None.
  m.def(
      "layer_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "bool memory_efficient=False, bool rms_scaling=False) -> (Tensor y, Tensor mean, "
      "Tensor rstd)");
  m.def(
      "layer_norm_backward(Tensor dy, Tensor saved, Tensor mean, Tensor rstd, "
      "SymInt[] normalized_shape, Tensor? weight, Tensor? bias, bool memory_efficient=False, "
      "bool rms_scaling=False) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  impl_op(m, "layer_norm", &forward_kernel, &backward_kernel, &autograd_kernel);
  impl_key(m, c10::DispatchKey::AutocastCUDA, "layer_norm", &autocast_cuda_kernel);
}

}  // namespace fusedlayers::torch_binding
