// fusedlayers::rms_norm{,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor conversion
// around csrc/rms_norm.h, which checks every argument), autograd and autocast.
#include <ATen/autocast_mode.h>

#include "backends/torch/autograd.h"
#include "backends/torch/binding.h"
#include "csrc/rms_norm.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using ForwardSig = Tensor2(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, double, bool);
using BackwardSig = Tensor2(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            c10::SymIntArrayRef, const OptTensor&, bool);

Tensor2 rms_norm_kernel(const at::Tensor& input, at::IntArrayRef normalized_shape,
                        const OptTensor& weight, double eps, bool zero_centered) {
  check_floating("rms_norm", "input", input);
  if (weight) {
    check_floating("rms_norm", "weight", *weight);
    check_same_device("rms_norm", "weight", *weight, "input", input);
  }
  const at::Tensor x = input.contiguous();
  const OptTensor w = contiguous(weight);
  RmsNormForward a{ref(x), sizes(normalized_shape), ref(w), eps, zero_centered};
  const RowsCols rc = call_csrc([&] { return rms_norm_forward_check(a); });
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd =
      at::empty(x.sizes().slice(0, x.dim() - normalized_shape.size()),
                x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  a.out = y.data_ptr();
  a.rstd = rstd.data_ptr();
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { rms_norm_forward(a, rc, exec_for(x)); });
  return {y, rstd};
}

Tensor2 rms_norm_backward_kernel(const at::Tensor& grad_out, const at::Tensor& input,
                                 const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                                 const OptTensor& weight, bool zero_centered) {
  const char* op = "rms_norm_backward";
  for (const auto& [arg, t] : {std::pair{"grad_out", &grad_out}, std::pair{"input", &input},
                               std::pair{"rstd", &rstd}})
    check_floating(op, arg, *t);
  check_same_device(op, "grad_out", grad_out, "input", input);
  check_same_device(op, "rstd", rstd, "input", input);
  if (weight) {
    check_floating(op, "weight", *weight);
    check_same_device(op, "weight", *weight, "input", input);
  }
  const at::Tensor dy = grad_out.contiguous(), x = input.contiguous(), rs = rstd.contiguous();
  const OptTensor w = contiguous(weight);
  RmsNormBackward a{ref(dy), ref(x), ref(rs), sizes(normalized_shape), ref(w), zero_centered};
  const RowsCols rc = call_csrc([&] { return rms_norm_backward_check(a); });
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw = w ? at::empty(w->sizes(), w->options()) : at::empty({0}, x.options());
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  const Exec exec = exec_for(x);
  const size_t bytes = call_csrc([&] { return rms_norm_backward_workspace_size(a, rc, exec); });
  const at::Tensor ws = bytes ? workspace(bytes, x) : at::Tensor();
  a.grad_input = dx.data_ptr();
  a.grad_weight = w ? dw.data_ptr() : nullptr;
  a.workspace = ws.defined() ? ws.data_ptr() : nullptr;
  call_csrc([&] { rms_norm_backward(a, rc, exec); });
  return {dx, dw};
}

// Autograd saves the input, rstd and the weight.
struct RmsNormBackwardNode final : Node {
  SavedVariable input, rstd, weight;
  int64_t norm_ndims = 0;
  bool zero_centered = false, has_weight = false;

  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<BackwardSig>("rms_norm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(2);
    if (!grads[0].defined()) return out;  // only rstd was used: nothing flows back
    const at::Tensor x = input.unpack(), r = rstd.unpack();
    const OptTensor w = unpack_if(weight, has_weight);
    BackwardGuard guard;
    auto [dx, dw] =
        bwd.call(grads[0], x, r, x.sym_sizes().slice(x.dim() - norm_ndims), w, zero_centered);
    out[0] = std::move(dx);
    if (has_weight) out[1] = std::move(dw);
    return out;
  }
  void release_variables() override {
    for (SavedVariable* v : {&input, &rstd, &weight}) v->reset_data();
  }
  std::string name() const override { return "fusedlayers::RmsNormBackward"; }
};

Tensor2 rms_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                          const OptTensor& weight, double eps, bool zero_centered) {
  static const auto fwd = op<ForwardSig>("rms_norm");
  const bool grad = needs_grad({&input, ptr_if(weight)});
  Tensor2 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = fwd.call(input, normalized_shape, weight, eps, zero_centered);
  }
  if (!grad) return out;
  const auto& [y, rstd] = out;
  auto node = make_node<RmsNormBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight));
  torch::autograd::set_history(y, node);  // rstd is not differentiable
  node->input = SavedVariable(input, false);
  node->rstd = SavedVariable(rstd, false);
  node->has_weight = weight.has_value();
  if (weight) node->weight = SavedVariable(*weight, false);
  node->norm_ndims = static_cast<int64_t>(normalized_shape.size());
  node->zero_centered = zero_centered;
  return out;
}

// Autocast as for layer_norm: float32 on CUDA; the input dtype on the CPU.
Tensor2 rms_norm_autocast_cuda(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                               const OptTensor& weight, double eps, bool zero_centered) {
  static const auto fwd = op<ForwardSig>("rms_norm");
  constexpr auto kCUDA = c10::DeviceType::CUDA;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return fwd.call(at::autocast::cached_cast(at::kFloat, input, kCUDA), normalized_shape,
                  at::autocast::cached_cast(at::kFloat, weight, kCUDA), eps, zero_centered);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // rstd has the leading (unnormalized) shape of input; zero_centered: gain 1 + weight.
  m.def(
      "rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, float eps, "
      "bool zero_centered=False) -> (Tensor out, Tensor rstd)");
  // grad_weight is empty when weight is None.
  m.def(
      "rms_norm_backward(Tensor grad_out, Tensor input, Tensor rstd, SymInt[] normalized_shape, "
      "Tensor? weight, bool zero_centered=False) -> (Tensor grad_input, Tensor grad_weight)");
}

TORCH_LIBRARY_IMPL(fusedlayers, CPU, m) {
  m.impl("rms_norm", &rms_norm_kernel);
  m.impl("rms_norm_backward", &rms_norm_backward_kernel);
}

#ifdef FUSEDLAYERS_WITH_CUDA
TORCH_LIBRARY_IMPL(fusedlayers, CUDA, m) {
  m.impl("rms_norm", &rms_norm_kernel);
  m.impl("rms_norm_backward", &rms_norm_backward_kernel);
}
#endif

TORCH_LIBRARY_IMPL(fusedlayers, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  register_backward_autograd(m, "rms_norm_backward");
}

TORCH_LIBRARY_IMPL(fusedlayers, AutocastCUDA, m) {
  m.impl("rms_norm", &rms_norm_autocast_cuda);
}

}  // namespace torch_binding
}  // namespace fusedlayers
