// The norm passes on the Exec's device, and the argument checks the norm ops share.
#include "norm.h"

#include <cmath>
#include <string>

namespace fusedlayers {

void norm_forward(const NormForwardArgs& a, const Exec& exec) {
  FUSEDLAYERS_ON_DEVICE(exec, norm_forward_cpu(a, exec.parallel_for),
                        norm_forward_cuda(a, exec.stream));
}

size_t norm_backward_workspace_size(int64_t rows, int64_t cols, DType dtype, const Exec& exec) {
  return FUSEDLAYERS_ON_DEVICE(exec, norm_backward_workspace_size_cpu(rows, cols, dtype),
                               norm_backward_workspace_size_cuda(rows, cols, dtype));
}

void norm_backward(const NormBackwardArgs& a, const Exec& exec) {
  if ((a.dgamma && !a.gamma) || (a.dbeta && !a.beta))
    fail("norm_backward: dgamma/dbeta requested without gamma/beta");
  if ((a.saved_is_output || a.dbeta) && a.mode != NormMode::kLayer)
    fail("norm_backward: saved_is_output and beta need NormMode::kLayer");
  if ((a.dgamma || a.dbeta) && !a.workspace) fail("norm_backward: workspace is null");
  FUSEDLAYERS_ON_DEVICE(exec, norm_backward_cpu(a, exec.parallel_for),
                        norm_backward_cuda(a, exec.stream));
}

namespace {
std::string count(int64_t n, const TensorRef& t) {
  return std::to_string(n) + " " + dtype_name(t.dtype);
}
}  // namespace

Sizes trailing_dims(const char* op, const TensorRef& input, int64_t k) {
  if (k < 1 || input.sizes.size < k)
    arg_error(op, "input must have at least " + std::to_string(k) + " dims, got shape " +
                      input.sizes.str());
  return input.sizes.tail(k);
}

RowsCols check_norm_input(const char* op, const TensorRef& input, Sizes normalized_shape) {
  const int64_t k = normalized_shape.size;
  if (k == 0) arg_error(op, "normalized_shape must not be empty");
  for (int64_t i = 0; i < k; ++i)
    if (normalized_shape[i] <= 0)
      arg_error(op, "normalized_shape must have positive sizes, got " + normalized_shape.str());
  if (input.sizes.size < k || !(input.sizes.tail(k) == normalized_shape))
    arg_error(op, "the last " + std::to_string(k) +
                      " dimension(s) of input must equal normalized_shape " +
                      normalized_shape.str() + ", got input of shape " + input.sizes.str());
  const int64_t cols = normalized_shape.numel();
  return {input.sizes.numel() / cols, cols};
}

void check_norm_param(const char* op, const char* arg, const TensorRef& param,
                      const TensorRef& input, Sizes normalized_shape) {
  if (!param.defined) return;
  if (!(param.sizes == normalized_shape))
    arg_error(op, std::string(arg) + " must have shape normalized_shape " +
                      normalized_shape.str() + ", got " + param.sizes.str());
  const bool half = input.dtype == DType::kFloat16 || input.dtype == DType::kBFloat16;
  if (param.dtype != input.dtype && !(half && param.dtype == DType::kFloat32))
    arg_error(op, std::string(arg) + " must have input's dtype " + dtype_name(input.dtype) +
                      (half ? " or float32" : "") + ", got " + dtype_name(param.dtype),
              Error::Kind::kType);
}

void check_same_param_dtype(const char* op, const TensorRef& weight, const TensorRef& bias) {
  if (weight.defined && bias.defined && weight.dtype != bias.dtype)
    arg_error(op, std::string("weight and bias must share a dtype, got ") +
                      dtype_name(weight.dtype) + " and " + dtype_name(bias.dtype),
              Error::Kind::kType);
}

void check_eps(const char* op, double eps) {
  if (!std::isfinite(eps) || eps < 0)
    arg_error(op, "eps must be finite and >= 0, got " + format_number(eps));
}

void check_norm_backward(const char* op, const TensorRef& grad_out, const TensorRef& saved,
                         const TensorRef& mean, const TensorRef& rstd, int64_t rows,
                         bool with_mean) {
  if (!(grad_out.sizes == saved.sizes) || grad_out.dtype != saved.dtype)
    arg_error(op, "grad_out must match saved (" + saved.sizes.str() + ", " +
                      dtype_name(saved.dtype) + "), got " + grad_out.sizes.str() + ", " +
                      dtype_name(grad_out.dtype));
  const DType stat = norm_stat_dtype(saved.dtype);
  const bool mean_ok = !with_mean || (mean.sizes.numel() == rows && mean.dtype == stat);
  if (rstd.sizes.numel() != rows || rstd.dtype != stat || !mean_ok)
    arg_error(op, std::string(with_mean ? "mean/rstd" : "rstd") + " must hold " +
                      std::to_string(rows) + " " + dtype_name(stat) + " values, got " +
                      (with_mean ? count(mean.sizes.numel(), mean) + " and " : "") +
                      count(rstd.sizes.numel(), rstd));
}

DType norm_param_dtype(const TensorRef& input, const TensorRef& weight, const TensorRef& bias) {
  if (weight.defined) return weight.dtype;
  if (bias.defined) return bias.dtype;
  return input.dtype;
}

}  // namespace fusedlayers
