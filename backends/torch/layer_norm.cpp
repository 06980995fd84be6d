// PyTorch CPU and CUDA implementation of fusedlayers::layer_norm{,_backward}: checks, allocation,
// csrc call.
#include "backends/torch/binding.h"
#include "csrc/layer_norm.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

struct RowsCols {
  int64_t rows;
  int64_t cols;
};

// Checks input against normalized_shape and weight/bias against both; returns the 2-D view.
RowsCols check_layer_norm_args(const char* op, const at::Tensor& input,
                               at::IntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias) {
  check_floating(op, "input", input);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK_VALUE(k > 0, "fusedlayers.", op, ": normalized_shape must not be empty");
  int64_t cols = 1;
  for (int64_t d : normalized_shape) {
    TORCH_CHECK_VALUE(d > 0, "fusedlayers.", op,
                      ": normalized_shape must have positive sizes, got ", normalized_shape);
    cols *= d;
  }
  TORCH_CHECK_VALUE(input.dim() >= k && input.sizes().slice(input.dim() - k) == normalized_shape,
                    "fusedlayers.", op, ": the last ", k,
                    " dimension(s) of input must equal normalized_shape ", normalized_shape,
                    ", got input of shape ", input.sizes());
  const bool half = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  for (const auto& [arg, p] : {std::pair{"weight", &weight}, std::pair{"bias", &bias}}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    check_same_device(op, arg, t, "input", input);
    TORCH_CHECK_VALUE(t.sizes() == normalized_shape, "fusedlayers.", op, ": ", arg,
                      " must have shape normalized_shape ", normalized_shape, ", got ",
                      t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == input.scalar_type() ||
                         (half && t.scalar_type() == at::kFloat),
                     "fusedlayers.", op, ": ", arg, " must have input's dtype ",
                     input.scalar_type(), half ? " or float32" : "", ", got ", t.scalar_type());
  }
  TORCH_CHECK_TYPE(!weight || !bias || weight->scalar_type() == bias->scalar_type(),
                   "fusedlayers.", op, ": weight and bias must share a dtype, got ",
                   weight ? weight->scalar_type() : at::kFloat, " and ",
                   bias ? bias->scalar_type() : at::kFloat);
  return {cols == 0 ? 0 : input.numel() / cols, cols};
}

DType param_dtype(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  const std::optional<at::Tensor>& bias) {
  if (weight) return to_dtype(weight->scalar_type());
  if (bias) return to_dtype(bias->scalar_type());
  return to_dtype(input.scalar_type());
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr() : nullptr;
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_op(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool /*memory_efficient: read by autograd only*/, bool subtract_mean) {
  const auto [rows, cols] =
      check_layer_norm_args("layer_norm", input, normalized_shape, weight, bias);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0,
                    "fusedlayers.layer_norm: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(subtract_mean || !bias,
                    "fusedlayers.layer_norm: bias must be None when subtract_mean is False");
  const at::Tensor x = input.contiguous();
  const auto w = contiguous(weight), b = contiguous(bias);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const auto stat_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto stat_shape = x.sizes().slice(0, x.dim() - normalized_shape.size());
  at::Tensor mean = at::empty(stat_shape, x.options().dtype(stat_dtype));
  at::Tensor rstd = at::empty(stat_shape, x.options().dtype(stat_dtype));
#ifdef FUSEDLAYERS_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    call_csrc([&] {
      layer_norm_forward_cuda(x.data_ptr(), ptr_or_null(w), ptr_or_null(b), y.data_ptr(),
                              mean.data_ptr(), rstd.data_ptr(), rows, cols, eps, subtract_mean,
                              to_dtype(x.scalar_type()), param_dtype(x, w, b), current_stream());
    });
    return {y, mean, rstd};
  }
#endif
  call_csrc([&] {
    layer_norm_forward_cpu(x.data_ptr(), ptr_or_null(w), ptr_or_null(b), y.data_ptr(),
                           mean.data_ptr(), rstd.data_ptr(), rows, cols, eps, subtract_mean,
                           to_dtype(x.scalar_type()), param_dtype(x, w, b), aten_parallel_for());
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_op(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean,
    const at::Tensor& rstd, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    bool memory_efficient, bool subtract_mean) {
  const auto [rows, cols] =
      check_layer_norm_args("layer_norm_backward", saved, normalized_shape, weight, bias);
  TORCH_CHECK_VALUE(grad_out.sizes() == saved.sizes() &&
                        grad_out.scalar_type() == saved.scalar_type(),
                    "fusedlayers.layer_norm_backward: grad_out must match saved (",
                    saved.sizes(), ", ", saved.scalar_type(), "), got ", grad_out.sizes(), ", ",
                    grad_out.scalar_type());
  const auto stat_dtype = saved.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_VALUE(rstd.numel() == rows && rstd.scalar_type() == stat_dtype &&
                        (memory_efficient || (mean.numel() == rows &&
                                              mean.scalar_type() == stat_dtype)),
                    "fusedlayers.layer_norm_backward: mean/rstd must hold ", rows, " ",
                    stat_dtype, " values, got ", mean.numel(), " ", mean.scalar_type(), " and ",
                    rstd.numel(), " ", rstd.scalar_type());
  check_same_device("layer_norm_backward", "grad_out", grad_out, "saved", saved);
  check_same_device("layer_norm_backward", "rstd", rstd, "saved", saved);
  const at::Tensor dy = grad_out.contiguous(), s = saved.contiguous();
  const at::Tensor mu = mean.contiguous(), rs = rstd.contiguous();
  const auto w = contiguous(weight), b = contiguous(bias);
  at::Tensor dx = at::empty(s.sizes(), s.options());
  at::Tensor dw = w ? at::empty(w->sizes(), w->options()) : at::empty({0}, s.options());
  at::Tensor db = b ? at::empty(b->sizes(), b->options()) : at::empty({0}, s.options());
  const DType dtype = to_dtype(s.scalar_type());
  at::Tensor ws;
#ifdef FUSEDLAYERS_WITH_CUDA
  if (s.is_cuda()) {
    const c10::cuda::CUDAGuard guard(s.device());
    call_csrc([&] {
      if (w || b) ws = workspace(layer_norm_backward_workspace_size_cuda(rows, cols, dtype), s);
      layer_norm_backward_cuda(
          dy.data_ptr(), s.data_ptr(), memory_efficient ? nullptr : mu.data_ptr(), rs.data_ptr(),
          ptr_or_null(w), ptr_or_null(b), dx.data_ptr(), w ? dw.data_ptr() : nullptr,
          b ? db.data_ptr() : nullptr, ws.defined() ? ws.data_ptr() : nullptr, rows, cols,
          memory_efficient, subtract_mean, dtype, param_dtype(s, w, b), current_stream());
    });
    return {dx, dw, db};
  }
#endif
  call_csrc([&] {
    if (w || b) ws = workspace(layer_norm_backward_workspace_size_cpu(rows, cols, dtype), s);
    layer_norm_backward_cpu(dy.data_ptr(), s.data_ptr(), memory_efficient ? nullptr : mu.data_ptr(),
                            rs.data_ptr(), ptr_or_null(w), ptr_or_null(b), dx.data_ptr(),
                            w ? dw.data_ptr() : nullptr, b ? db.data_ptr() : nullptr,
                            ws.defined() ? ws.data_ptr() : nullptr, rows, cols, memory_efficient,
                            subtract_mean, dtype, param_dtype(s, w, b), aten_parallel_for());
  });
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedlayers, CPU, m) {
  m.impl("layer_norm", &layer_norm_op);
  m.impl("layer_norm_backward", &layer_norm_backward_op);
}

#ifdef FUSEDLAYERS_WITH_CUDA
TORCH_LIBRARY_IMPL(fusedlayers, CUDA, m) {
  m.impl("layer_norm", &layer_norm_op);
  m.impl("layer_norm_backward", &layer_norm_backward_op);
}
#endif

}  // namespace torch_binding
}  // namespace fusedlayers
