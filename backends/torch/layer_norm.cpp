// fusedlayers::layer_norm{,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor conversion
// around csrc/layer_norm.h, which checks every argument), autograd and autocast.
#include <ATen/autocast_mode.h>

#include "backends/torch/autograd.h"
#include "backends/torch/binding.h"
#include "csrc/layer_norm.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

using ForwardSig = Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                           const OptTensor&, double, bool, bool);
using BackwardSig = Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                            const OptTensor&, bool, bool);

// The types and devices csrc cannot see; every other rule is csrc's.
void check_tensors(const char* op, const char* x_name, const at::Tensor& x, const OptTensor& w,
                   const OptTensor& b) {
  check_floating(op, x_name, x);
  for (const auto& [arg, t] : {std::pair{"weight", &w}, std::pair{"bias", &b}}) {
    if (!*t) continue;
    check_floating(op, arg, **t);
    check_same_device(op, arg, **t, x_name, x);
  }
}

Tensor3 layer_norm_kernel(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const OptTensor& weight, const OptTensor& bias, double eps,
                          bool /*memory_efficient: read by autograd only*/, bool rms_scaling) {
  check_tensors("layer_norm", "input", input, weight, bias);
  const at::Tensor x = input.contiguous();
  const OptTensor w = contiguous(weight), b = contiguous(bias);
  LayerNormForward a{ref(x), sizes(normalized_shape), ref(w), ref(b), eps, rms_scaling};
  const RowsCols rc = call_csrc([&] { return layer_norm_forward_check(a); });
  at::Tensor y = at::empty(x.sizes(), x.options());
  const auto stat_shape = x.sizes().slice(0, x.dim() - normalized_shape.size());
  const auto stat_options =
      x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor mean = at::empty(stat_shape, stat_options), rstd = at::empty(stat_shape, stat_options);
  a.out = y.data_ptr();
  a.mean = mean.data_ptr();
  a.rstd = rstd.data_ptr();
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { layer_norm_forward(a, rc, exec_for(x)); });
  return {y, mean, rstd};
}

Tensor3 layer_norm_backward_kernel(const at::Tensor& grad_out, const at::Tensor& saved,
                                   const at::Tensor& mean, const at::Tensor& rstd,
                                   at::IntArrayRef normalized_shape, const OptTensor& weight,
                                   const OptTensor& bias, bool memory_efficient,
                                   bool rms_scaling) {
  const char* op = "layer_norm_backward";
  check_tensors(op, "saved", saved, weight, bias);
  check_floating(op, "grad_out", grad_out);
  check_same_device(op, "grad_out", grad_out, "saved", saved);
  check_same_device(op, "rstd", rstd, "saved", saved);
  if (!memory_efficient) check_same_device(op, "mean", mean, "saved", saved);
  const at::Tensor dy = grad_out.contiguous(), s = saved.contiguous();
  const at::Tensor mu = mean.contiguous(), rs = rstd.contiguous();
  const OptTensor w = contiguous(weight), b = contiguous(bias);
  check_floating(op, "mean", mu);
  check_floating(op, "rstd", rs);
  LayerNormBackward a{ref(dy), ref(s), ref(mu), ref(rs), sizes(normalized_shape),
                      ref(w), ref(b), memory_efficient, rms_scaling};
  const RowsCols rc = call_csrc([&] { return layer_norm_backward_check(a); });
  at::Tensor dx = at::empty(s.sizes(), s.options());
  at::Tensor dw = w ? at::empty(w->sizes(), w->options()) : at::empty({0}, s.options());
  at::Tensor db = b ? at::empty(b->sizes(), b->options()) : at::empty({0}, s.options());
  const c10::OptionalDeviceGuard guard(s.device());  // kernels get no guard from the dispatcher
  const Exec exec = exec_for(s);
  const size_t bytes = call_csrc([&] { return layer_norm_backward_workspace_size(a, rc, exec); });
  const at::Tensor ws = bytes ? workspace(bytes, s) : at::Tensor();
  a.grad_input = dx.data_ptr();
  a.grad_weight = w ? dw.data_ptr() : nullptr;
  a.grad_bias = b ? db.data_ptr() : nullptr;
  a.workspace = ws.defined() ? ws.data_ptr() : nullptr;
  call_csrc([&] { layer_norm_backward(a, rc, exec); });
  return {dx, dw, db};
}

// Autograd saves the input (or, memory_efficient, the output), mean, rstd and parameters.
struct LayerNormBackwardNode final : Node {
  SavedVariable saved, mean, rstd, weight, bias;
  int64_t norm_ndims = 0;
  bool memory_efficient = false, rms_scaling = false, has_weight = false, has_bias = false;

  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<BackwardSig>("layer_norm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(3);
    if (!grads[0].defined()) return out;  // only mean/rstd were used: nothing flows back
    const at::Tensor x = saved.unpack(getptr()), m = mean.unpack(), r = rstd.unpack();
    const OptTensor w = unpack_if(weight, has_weight), b = unpack_if(bias, has_bias);
    BackwardGuard guard;
    auto [dx, dw, db] = bwd.call(grads[0], x, m, r, x.sym_sizes().slice(x.dim() - norm_ndims), w,
                                 b, memory_efficient, rms_scaling);
    out[0] = std::move(dx);
    if (has_weight) out[1] = std::move(dw);
    if (has_bias) out[2] = std::move(db);
    return out;
  }
  void release_variables() override {
    for (SavedVariable* v : {&saved, &mean, &rstd, &weight, &bias}) v->reset_data();
  }
  std::string name() const override { return "fusedlayers::LayerNormBackward"; }
};

Tensor3 layer_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps,
                            bool memory_efficient, bool rms_scaling) {
  static const auto fwd = op<ForwardSig>("layer_norm");
  const bool grad = needs_grad({&input, ptr_if(weight), ptr_if(bias)});
  Tensor3 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = fwd.call(input, normalized_shape, weight, bias, eps, memory_efficient, rms_scaling);
  }
  if (!grad) return out;
  const auto& [y, mean, rstd] = out;
  auto node = make_node<LayerNormBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  torch::autograd::set_history(y, node);  // mean and rstd are not differentiable
  node->saved = memory_efficient ? SavedVariable(y, true) : SavedVariable(input, false);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  node->has_weight = weight.has_value();
  node->has_bias = bias.has_value();
  if (weight) node->weight = SavedVariable(*weight, false);
  if (bias) node->bias = SavedVariable(*bias, false);
  node->norm_ndims = static_cast<int64_t>(normalized_shape.size());
  node->memory_efficient = memory_efficient;
  node->rms_scaling = rms_scaling;
  return out;
}

// Autocast as ATen's for layer_norm: float32 on CUDA; on the CPU ATen registers none.
Tensor3 layer_norm_autocast_cuda(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                 const OptTensor& weight, const OptTensor& bias, double eps,
                                 bool memory_efficient, bool rms_scaling) {
  static const auto fwd = op<ForwardSig>("layer_norm");
  constexpr auto kCUDA = c10::DeviceType::CUDA;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return fwd.call(at::autocast::cached_cast(at::kFloat, input, kCUDA), normalized_shape,
                  at::autocast::cached_cast(at::kFloat, weight, kCUDA),
                  at::autocast::cached_cast(at::kFloat, bias, kCUDA), eps, memory_efficient,
                  rms_scaling);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // mean/rstd have the leading (unnormalized) shape of input; memory_efficient only tells
  // autograd to save the output instead of the input; rms_scaling is Keras'
  // LayerNormalization(rms_scaling=True) (see csrc/norm.h).
  m.def(
      "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps, bool memory_efficient=False, bool rms_scaling=False) "
      "-> (Tensor out, Tensor mean, Tensor rstd)");
  // saved is the input, or the output when memory_efficient; grad_weight/grad_bias are empty
  // when weight/bias are None.
  m.def(
      "layer_norm_backward(Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, "
      "SymInt[] normalized_shape, Tensor? weight, Tensor? bias, bool memory_efficient=False, "
      "bool rms_scaling=False) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(fusedlayers, CPU, m) {
  m.impl("layer_norm", &layer_norm_kernel);
  m.impl("layer_norm_backward", &layer_norm_backward_kernel);
}

#ifdef FUSEDLAYERS_WITH_CUDA
TORCH_LIBRARY_IMPL(fusedlayers, CUDA, m) {
  m.impl("layer_norm", &layer_norm_kernel);
  m.impl("layer_norm_backward", &layer_norm_backward_kernel);
}
#endif

TORCH_LIBRARY_IMPL(fusedlayers, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  register_backward_autograd(m, "layer_norm_backward");
}

TORCH_LIBRARY_IMPL(fusedlayers, AutocastCUDA, m) {
  m.impl("layer_norm", &layer_norm_autocast_cuda);
}

}  // namespace torch_binding
}  // namespace fusedlayers
