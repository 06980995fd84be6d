// The norm passes on the Exec's device, and the argument checks the norm ops share.
#include "norm/norm.h"

#include <cmath>
#include <string>

namespace fusedlayers {

bool norm_param_dtype_ok(DType dtype, DType param_dtype) {
  const bool half = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  return param_dtype == dtype || (half && param_dtype == DType::kFloat32);
}

namespace {
void check_param_dtype(const char* pass, DType dtype, DType param_dtype) {
  if (!norm_param_dtype_ok(dtype, param_dtype))
    fail(std::string(pass) + ": parameter dtype " + dtype_name(param_dtype) + " for x of " +
         dtype_name(dtype));
}

// A residual stream of x's dtype, or float32 under float16/bfloat16 x: the parameters' rule.
void check_residual_dtype(const char* pass, DType dtype, DType residual_dtype) {
  if (!norm_param_dtype_ok(dtype, residual_dtype))
    fail(std::string(pass) + ": residual dtype " + dtype_name(residual_dtype) + " for x of " +
         dtype_name(dtype));
}
}  // namespace

void norm_forward(const NormForwardArgs& a, const Exec& exec) {
  check_param_dtype("norm_forward", a.dtype, a.param_dtype);
  if (a.residual) {
    check_residual_dtype("norm_forward", a.dtype, a.residual_dtype);
    if (!a.h && a.rows > 0) fail("norm_forward: h is null");
  }
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
  check_param_dtype("norm_backward", a.dtype, a.param_dtype);
  if (a.add) {
    check_residual_dtype("norm_backward", a.dtype, a.residual_dtype);
    if (a.saved_is_output) fail("norm_backward: add saves h, not the output");
    if ((a.dresidual != nullptr) != (a.residual_dtype != a.dtype))
      fail("norm_backward: dresidual must be given exactly when the residual's dtype is not x's");
  }
  FUSEDLAYERS_ON_DEVICE(exec, norm_backward_cpu(a, exec.parallel_for),
                        norm_backward_cuda(a, exec.stream));
}

namespace {
std::string count(int64_t n, const TensorRef& t) {
  return std::to_string(n) + " " + dtype_name(t.dtype);
}
}  // namespace

RowsCols check_norm_input(const char* op, const TensorRef& x, Sizes normalized_shape) {
  const int64_t k = normalized_shape.size;
  if (k == 0) arg_error(op, "normalized_shape must not be empty");
  for (int64_t i = 0; i < k; ++i)
    if (normalized_shape[i] <= 0)
      arg_error(op, "normalized_shape must have positive sizes, got " + normalized_shape.str());
  if (x.sizes.size < k || !(x.sizes.tail(k) == normalized_shape))
    arg_error(op, "the last " + std::to_string(k) +
                      " dimension(s) of x must equal normalized_shape " +
                      normalized_shape.str() + ", got x of shape " + x.sizes.str());
  const int64_t cols = normalized_shape.numel();
  return {x.sizes.numel() / cols, cols};
}

void check_norm_param(const char* op, const char* arg, const TensorRef& param,
                      const TensorRef& x, Sizes normalized_shape) {
  if (!param.defined) return;
  if (!(param.sizes == normalized_shape))
    arg_error(op, std::string(arg) + " must have shape normalized_shape " +
                      normalized_shape.str() + ", got " + param.sizes.str());
  const bool half = x.dtype == DType::kFloat16 || x.dtype == DType::kBFloat16;
  if (!norm_param_dtype_ok(x.dtype, param.dtype))
    arg_error(op, std::string(arg) + " must have x's dtype " + dtype_name(x.dtype) +
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

void check_norm_backward(const char* op, const TensorRef& dy, const TensorRef& saved,
                         const TensorRef& mean, const TensorRef& rstd, int64_t rows,
                         bool with_mean) {
  if (!(dy.sizes == saved.sizes) || dy.dtype != saved.dtype)
    arg_error(op, "dy must match saved (" + saved.sizes.str() + ", " +
                      dtype_name(saved.dtype) + "), got " + dy.sizes.str() + ", " +
                      dtype_name(dy.dtype));
  const DType stat = norm_stat_dtype(saved.dtype);
  const bool mean_ok = !with_mean || (mean.sizes.numel() == rows && mean.dtype == stat);
  if (rstd.sizes.numel() != rows || rstd.dtype != stat || !mean_ok)
    arg_error(op, std::string(with_mean ? "mean/rstd" : "rstd") + " must hold " +
                      std::to_string(rows) + " " + dtype_name(stat) + " values, got " +
                      (with_mean ? count(mean.sizes.numel(), mean) + " and " : "") +
                      count(rstd.sizes.numel(), rstd));
}

DType norm_param_dtype(const TensorRef& x, const TensorRef& weight, const TensorRef& bias) {
  if (weight.defined) return weight.dtype;
  if (bias.defined) return bias.dtype;
  return x.dtype;
}

}  // namespace fusedlayers
