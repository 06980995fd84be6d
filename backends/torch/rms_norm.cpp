// fusedlayers::rms_norm{,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor conversion
// around csrc/norm/rms_norm.h, which checks every argument), autograd and autocast.
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "norm/rms_norm.h"

namespace fusedlayers::torch_binding {
namespace {

using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using ForwardSig = Tensor2(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, double, bool);
using BackwardSig = Tensor2(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            c10::SymIntArrayRef, const OptTensor&, bool);

Tensor2 forward_kernel(const at::Tensor& x_in, at::IntArrayRef normalized_shape,
                       const OptTensor& weight_in, double eps, bool zero_centered) {
  check_tensors("rms_norm", "x", x_in, {{"weight", &weight_in}});
  const at::Tensor x = x_in.contiguous();
  const OptTensor weight = contiguous(weight_in);
  RmsNormForward a{ref(x), sizes(normalized_shape), ref(weight), eps, zero_centered};
  const RowsCols rc = call_csrc([&] { return rms_norm_forward_check(a); });
  at::Tensor y = at::empty(x.sizes(), x.options()), rstd = stats(x, normalized_shape);
  a.y = y.data_ptr();
  a.rstd = rstd.data_ptr();
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { rms_norm_forward(a, rc, exec_for(x)); });
  return {y, rstd};
}

Tensor2 backward_kernel(const at::Tensor& dy_in, const at::Tensor& x_in,
                        const at::Tensor& rstd_in, at::IntArrayRef normalized_shape,
                        const OptTensor& weight_in, bool zero_centered) {
  const OptTensor dy_opt(dy_in), rstd_opt(rstd_in);
  check_tensors("rms_norm_backward", "x", x_in,
                {{"dy", &dy_opt}, {"rstd", &rstd_opt}, {"weight", &weight_in}});
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), rstd = rstd_in.contiguous();
  const OptTensor weight = contiguous(weight_in);
  RmsNormBackward a{ref(dy), ref(x), ref(rstd), sizes(normalized_shape), ref(weight),
                    zero_centered};
  const RowsCols rc = call_csrc([&] { return rms_norm_backward_check(a); });
  at::Tensor dx = at::empty(x.sizes(), x.options()), dweight = param_grad(weight, x);
  a.dx = dx.data_ptr();
  a.dweight = weight ? dweight.data_ptr() : nullptr;
  run_with_workspace(x, a, rc, rms_norm_backward_workspace_size, rms_norm_backward);
  return {dx, dweight};
}

// Saves x, rstd and the weight.
struct RmsNormBackwardNode final : SavingNode<RmsNormBackwardNode> {
  static constexpr const char* kName = "fusedlayers::RmsNormBackwardNode";
  SavedVariable x, rstd, weight;
  int64_t norm_ndims = 0;
  bool zero_centered = false, has_weight = false;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<BackwardSig>("rms_norm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(2);
    if (!grads[0].defined()) return out;  // only rstd was used: nothing flows back
    const at::Tensor xs = x.unpack(), r = rstd.unpack();
    const OptTensor w = unpack_if(weight, has_weight);
    BackwardGuard guard;
    auto [dx, dw] = backward.call(grads[0], xs, r, xs.sym_sizes().slice(xs.dim() - norm_ndims),
                                  w, zero_centered);
    out[0] = std::move(dx);
    if (has_weight) out[1] = std::move(dw);
    return out;
  }
  auto saved_variables() { return std::array{&x, &rstd, &weight}; }
};

Tensor2 autograd_kernel(const at::Tensor& x, c10::SymIntArrayRef normalized_shape,
                        const OptTensor& weight, double eps, bool zero_centered) {
  static const auto forward = op<ForwardSig>("rms_norm");
  const bool grad = needs_grad({&x, ptr_if(weight)});
  const Tensor2 out =
      below_autograd([&] { return forward.call(x, normalized_shape, weight, eps, zero_centered); });
  if (!grad) return out;
  auto node = make_node<RmsNormBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight));
  torch::autograd::set_history(std::get<0>(out), node);  // rstd is not differentiable
  node->x = SavedVariable(x, false);
  node->rstd = SavedVariable(std::get<1>(out), false);
  std::tie(node->weight, node->has_weight) = save_if(weight);
  node->norm_ndims = static_cast<int64_t>(normalized_shape.size());
  node->zero_centered = zero_centered;
  return out;
}

// Autocast as for layer_norm: float32 on CUDA; the input dtype on the CPU.
Tensor2 autocast_cuda_kernel(const at::Tensor& x, c10::SymIntArrayRef normalized_shape,
                             const OptTensor& weight, double eps, bool zero_centered) {
  static const auto forward = op<ForwardSig>("rms_norm");
  const AutocastToFloat cast;
  return forward.call(cast(x), normalized_shape, cast(weight), eps, zero_centered);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // rstd has the leading (unnormalized) shape of x; zero_centered: gain 1 + weight; dweight is
  // empty when weight is None.
  m.def(
      "rms_norm(Tensor x, SymInt[] normalized_shape, Tensor? weight, float eps, "
      "bool zero_centered=False) -> (Tensor y, Tensor rstd)");
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor rstd, SymInt[] normalized_shape, "
      "Tensor? weight, bool zero_centered=False) -> (Tensor dx, Tensor dweight)");
  impl_op(m, "rms_norm", &forward_kernel, &backward_kernel, &autograd_kernel);
  impl_key(m, c10::DispatchKey::AutocastCUDA, "rms_norm", &autocast_cuda_kernel);
}

}  // namespace fusedlayers::torch_binding
