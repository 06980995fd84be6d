// fusedlayers::add_rms_norm and fusedlayers::add_layer_norm (and their _backward) for PyTorch:
// schemas, one CPU/CUDA kernel per pass for both (tensor conversion around csrc/norm/add_norm.h,
// which checks every argument) and autograd. No autocast kernel: under autocast they run in
// their inputs' dtypes, so h keeps the residual stream's dtype (the unfused add's) and y is
// x's (what the linear layer after the norm casts it to).
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "norm/add_norm.h"

namespace fusedlayers::torch_binding {
namespace {

using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using RmsSig = Tensor3(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                       const OptTensor&, double, bool);
using RmsBackwardSig = Tensor3(const at::Tensor&, const OptTensor&, const at::Tensor&,
                               const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, bool);
using LayerSig = Tensor4(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                         const OptTensor&, const OptTensor&, double);
using LayerBackwardSig = Tensor4(const at::Tensor&, const OptTensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                                 const OptTensor&, const OptTensor&);

// Both forwards: (y, h, mean (kLayer; undefined for kRms), rstd).
Tensor4 forward(NormMode mode, const at::Tensor& x_in, const at::Tensor& residual_in,
                at::IntArrayRef normalized_shape, const OptTensor& weight_in,
                const OptTensor& bias_in, double eps, bool zero_centered) {
  const char* name = add_norm_name(mode);
  const OptTensor residual_opt(residual_in);
  check_tensors(name, "x", x_in,
                {{"residual", &residual_opt}, {"weight", &weight_in}, {"bias", &bias_in}});
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous();
  const OptTensor weight = contiguous(weight_in), bias = contiguous(bias_in);
  AddNormForward a{mode, ref(x), ref(residual), sizes(normalized_shape), ref(weight), ref(bias),
                   eps, zero_centered};
  const RowsCols rc = call_csrc([&] { return add_norm_forward_check(a); });
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor h = at::empty(residual.sizes(), residual.options());
  at::Tensor mean = mode == NormMode::kLayer ? stats(x, normalized_shape) : at::Tensor();
  at::Tensor rstd = stats(x, normalized_shape);
  a.y = y.data_ptr();
  a.h = h.data_ptr();
  a.mean = mean.defined() ? mean.data_ptr() : nullptr;
  a.rstd = rstd.data_ptr();
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { add_norm_forward(a, rc, exec_for(x)); });
  return {y, h, mean, rstd};
}

// Both backwards: (dx, dresidual (empty where h has dy's dtype: dx is both), dweight, dbias).
Tensor4 backward(NormMode mode, const at::Tensor& dy_in, const OptTensor& dh_in,
                 const at::Tensor& h_in, const OptTensor& mean_in, const at::Tensor& rstd_in,
                 at::IntArrayRef normalized_shape, const OptTensor& weight_in,
                 const OptTensor& bias_in, bool zero_centered) {
  const std::string name = std::string(add_norm_name(mode)) + "_backward";
  const OptTensor h_opt(h_in), rstd_opt(rstd_in);
  check_tensors(name.c_str(), "dy", dy_in, {{"dh", &dh_in}, {"h", &h_opt}, {"mean", &mean_in},
                                            {"rstd", &rstd_opt}, {"weight", &weight_in},
                                            {"bias", &bias_in}});
  const at::Tensor dy = dy_in.contiguous(), h = h_in.contiguous(), rstd = rstd_in.contiguous();
  const OptTensor dh = contiguous(dh_in), mean = contiguous(mean_in);
  const OptTensor weight = contiguous(weight_in), bias = contiguous(bias_in);
  AddNormBackward a{mode, ref(dy), ref(dh), ref(h), ref(mean), ref(rstd),
                    sizes(normalized_shape), ref(weight), ref(bias), zero_centered};
  const RowsCols rc = call_csrc([&] { return add_norm_backward_check(a); });
  at::Tensor dx = at::empty(dy.sizes(), dy.options());
  at::Tensor dresidual = h.scalar_type() == dy.scalar_type() ? at::empty({0}, h.options())
                                                             : at::empty(h.sizes(), h.options());
  at::Tensor dweight = param_grad(weight, dy), dbias = param_grad(bias, dy);
  a.dx = dx.data_ptr();
  a.dresidual = dresidual.numel() ? dresidual.data_ptr() : nullptr;
  a.dweight = weight ? dweight.data_ptr() : nullptr;
  a.dbias = bias ? dbias.data_ptr() : nullptr;
  run_with_workspace(dy, a, rc, add_norm_backward_workspace_size, add_norm_backward);
  return {dx, dresidual, dweight, dbias};
}

Tensor3 rms_kernel(const at::Tensor& x, const at::Tensor& residual,
                   at::IntArrayRef normalized_shape, const OptTensor& weight, double eps,
                   bool zero_centered) {
  auto [y, h, mean, rstd] =
      forward(NormMode::kRms, x, residual, normalized_shape, weight, {}, eps, zero_centered);
  return {y, h, rstd};
}

Tensor3 rms_backward_kernel(const at::Tensor& dy, const OptTensor& dh, const at::Tensor& h,
                            const at::Tensor& rstd, at::IntArrayRef normalized_shape,
                            const OptTensor& weight, bool zero_centered) {
  auto [dx, dresidual, dweight, dbias] = backward(NormMode::kRms, dy, dh, h, {}, rstd,
                                                  normalized_shape, weight, {}, zero_centered);
  return {dx, dresidual, dweight};
}

Tensor4 layer_kernel(const at::Tensor& x, const at::Tensor& residual,
                     at::IntArrayRef normalized_shape, const OptTensor& weight,
                     const OptTensor& bias, double eps) {
  return forward(NormMode::kLayer, x, residual, normalized_shape, weight, bias, eps, false);
}

Tensor4 layer_backward_kernel(const at::Tensor& dy, const OptTensor& dh, const at::Tensor& h,
                              const at::Tensor& mean, const at::Tensor& rstd,
                              at::IntArrayRef normalized_shape, const OptTensor& weight,
                              const OptTensor& bias) {
  return backward(NormMode::kLayer, dy, dh, h, mean, rstd, normalized_shape, weight, bias, false);
}

// Saves h, the statistics and the parameters; the edges are x, residual, weight[, bias].
struct AddNormBackwardNode final : SavingNode<AddNormBackwardNode> {
  static constexpr const char* kName = "fusedlayers::AddNormBackwardNode";
  SavedVariable h, mean, rstd, weight, bias;
  NormMode mode = NormMode::kRms;
  int64_t norm_ndims = 0;
  bool zero_centered = false, has_weight = false, has_bias = false;
  at::ScalarType x_dtype = at::kFloat;

  variable_list apply(variable_list&& grads) override {
    static const auto rms_backward = op<RmsBackwardSig>("add_rms_norm_backward");
    static const auto layer_backward = op<LayerBackwardSig>("add_layer_norm_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list out(mode == NormMode::kLayer ? 4 : 3);
    const at::Tensor& dy = grads[0];
    const OptTensor dh = grads[1].defined() ? OptTensor(grads[1]) : OptTensor();
    if (!dy.defined()) {  // only h (or the statistics) was used: h's gradient passes through
      if (dh) out[0] = dh->to(x_dtype), out[1] = *dh;
      return out;
    }
    const at::Tensor hs = h.unpack(getptr()), r = rstd.unpack();
    const OptTensor w = unpack_if(weight, has_weight);
    const auto shape = hs.sym_sizes().slice(hs.dim() - norm_ndims);
    BackwardGuard guard;
    at::Tensor dx, dres, dw, db;
    if (mode == NormMode::kLayer) {
      std::tie(dx, dres, dw, db) = layer_backward.call(dy, dh, hs, mean.unpack(), r, shape, w,
                                                       unpack_if(bias, has_bias));
    } else {
      std::tie(dx, dres, dw) = rms_backward.call(dy, dh, hs, r, shape, w, zero_centered);
    }
    out[1] = hs.scalar_type() == dx.scalar_type() ? dx : dres;  // dx is both
    out[0] = std::move(dx);
    if (has_weight) out[2] = std::move(dw);
    if (has_bias) out[3] = std::move(db);
    return out;
  }
  auto saved_variables() { return std::array{&h, &mean, &rstd, &weight, &bias}; }
};

// Records the Node for a forward's results (y, h, [mean,] rstd) when a backward will run.
void record(NormMode mode, const at::Tensor& x, const at::Tensor& residual,
            c10::SymIntArrayRef normalized_shape, const OptTensor& weight, const OptTensor& bias,
            bool zero_centered, const at::Tensor& y, const at::Tensor& h, const at::Tensor& mean,
            const at::Tensor& rstd) {
  auto node = make_node<AddNormBackwardNode>();
  if (mode == NormMode::kLayer)
    node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
  else
    node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight));
  torch::autograd::set_history(y, node);  // output 0
  torch::autograd::set_history(h, node);  // output 1; the statistics are not differentiable
  node->mode = mode;
  node->h = SavedVariable(h, true);
  if (mean.defined()) node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  std::tie(node->weight, node->has_weight) = save_if(weight);
  std::tie(node->bias, node->has_bias) = save_if(bias);
  node->norm_ndims = static_cast<int64_t>(normalized_shape.size());
  node->zero_centered = zero_centered;
  node->x_dtype = x.scalar_type();
}

Tensor3 rms_autograd_kernel(const at::Tensor& x, const at::Tensor& residual,
                            c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                            double eps, bool zero_centered) {
  static const auto forward_op = op<RmsSig>("add_rms_norm");
  const bool grad = needs_grad({&x, &residual, ptr_if(weight)});
  const Tensor3 out = below_autograd([&] {
    return forward_op.call(x, residual, normalized_shape, weight, eps, zero_centered);
  });
  if (grad) {
    const auto& [y, h, rstd] = out;
    record(NormMode::kRms, x, residual, normalized_shape, weight, {}, zero_centered, y, h, {},
           rstd);
  }
  return out;
}

Tensor4 layer_autograd_kernel(const at::Tensor& x, const at::Tensor& residual,
                              c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                              const OptTensor& bias, double eps) {
  static const auto forward_op = op<LayerSig>("add_layer_norm");
  const bool grad = needs_grad({&x, &residual, ptr_if(weight), ptr_if(bias)});
  const Tensor4 out = below_autograd(
      [&] { return forward_op.call(x, residual, normalized_shape, weight, bias, eps); });
  if (grad) {
    const auto& [y, h, mean, rstd] = out;
    record(NormMode::kLayer, x, residual, normalized_shape, weight, bias, false, y, h, mean,
           rstd);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // h = x + residual in residual's dtype, y = the norm of h in x's dtype; the statistics have
  // x's leading (unnormalized) shape. Backward: dh is the gradient of h from its other uses (None
  // where there are none); dresidual is empty where h has dy's dtype (dx is the gradient of both
  // x and residual), dweight / dbias empty where weight / bias are None.
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, SymInt[] normalized_shape, Tensor? weight, "
      "float eps, bool zero_centered=False) -> (Tensor y, Tensor h, Tensor rstd)");
  m.def(
      "add_rms_norm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor rstd, "
      "SymInt[] normalized_shape, Tensor? weight, bool zero_centered=False) -> "
      "(Tensor dx, Tensor dresidual, Tensor dweight)");
  m.def(
      "add_layer_norm(Tensor x, Tensor residual, SymInt[] normalized_shape, Tensor? weight, "
      "Tensor? bias, float eps) -> (Tensor y, Tensor h, Tensor mean, Tensor rstd)");
  m.def(
      "add_layer_norm_backward(Tensor dy, Tensor? dh, Tensor h, Tensor mean, Tensor rstd, "
      "SymInt[] normalized_shape, Tensor? weight, Tensor? bias) -> "
      "(Tensor dx, Tensor dresidual, Tensor dweight, Tensor dbias)");
  impl_op(m, "add_rms_norm", &rms_kernel, &rms_backward_kernel, &rms_autograd_kernel);
  impl_op(m, "add_layer_norm", &layer_kernel, &layer_backward_kernel, &layer_autograd_kernel);
}

}  // namespace fusedlayers::torch_binding
