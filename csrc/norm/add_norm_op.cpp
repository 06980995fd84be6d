// The add+norm ops: argument checks, then the norm kernels with a residual (contract:
// add_norm.h).
#include "norm/add_norm.h"

#include <string>

namespace fusedlayers {
namespace {

void check_mode(NormMode mode) {
  if (mode != NormMode::kRms && mode != NormMode::kLayer)
    fail("add_norm: mode must be NormMode::kRms or kLayer");
}

// The parameters' rules for `op` on x (x's dtype: `like`'s).
void check_params(const char* op, NormMode mode, const TensorRef& like, Sizes normalized_shape,
                  const TensorRef& weight, const TensorRef& bias) {
  check_norm_param(op, "weight", weight, like, normalized_shape);
  if (mode == NormMode::kRms && bias.defined) fail(std::string(op) + ": bias with kRms");
  check_norm_param(op, "bias", bias, like, normalized_shape);
  check_same_param_dtype(op, weight, bias);
}

// `arg` (residual, h or dh) has `like`'s shape, and x's dtype or float32 under half x.
void check_residual(const char* op, const char* arg, const TensorRef& t, const TensorRef& like,
                    const char* like_name, DType x_dtype) {
  if (!(t.sizes == like.sizes))
    arg_error(op, std::string(arg) + " must have " + like_name + "'s shape " + like.sizes.str() +
                      ", got " + t.sizes.str());
  const bool half = x_dtype == DType::kFloat16 || x_dtype == DType::kBFloat16;
  if (!norm_param_dtype_ok(x_dtype, t.dtype))
    arg_error(op, std::string(arg) + " must have x's dtype " + dtype_name(x_dtype) +
                      (half ? " or float32" : "") + ", got " + dtype_name(t.dtype),
              Error::Kind::kType);
}

}  // namespace

const char* add_norm_name(NormMode mode) {
  return mode == NormMode::kRms ? "add_rms_norm" : "add_layer_norm";
}

RowsCols add_norm_forward_check(const AddNormForward& a) {
  check_mode(a.mode);
  const char* op = add_norm_name(a.mode);
  const RowsCols rc = check_norm_input(op, a.x, a.normalized_shape);
  check_residual(op, "residual", a.residual, a.x, "x", a.x.dtype);
  check_params(op, a.mode, a.x, a.normalized_shape, a.weight, a.bias);
  check_eps(op, a.eps);
  return rc;
}

void add_norm_forward(const AddNormForward& a, RowsCols rc, const Exec& exec) {
  NormForwardArgs n{a.x.data, data_if(a.weight), data_if(a.bias), a.y,
                    a.mode == NormMode::kLayer ? a.mean : nullptr, a.rstd, rc.rows, rc.cols,
                    a.eps, a.zero_centered ? 1.0f : 0.0f, a.mode, a.x.dtype,
                    norm_param_dtype(a.x, a.weight, a.bias)};
  n.residual = a.residual.data;
  n.h = a.h;
  n.residual_dtype = a.residual.dtype;
  norm_forward(n, exec);
}

RowsCols add_norm_backward_check(const AddNormBackward& a) {
  check_mode(a.mode);
  const std::string name = std::string(add_norm_name(a.mode)) + "_backward";
  const char* op = name.c_str();
  const RowsCols rc = check_norm_input(op, a.dy, a.normalized_shape);
  check_residual(op, "h", a.h, a.dy, "dy", a.dy.dtype);
  if (a.dh.defined) check_residual(op, "dh", a.dh, a.h, "h", a.dy.dtype);
  if (a.dh.defined && a.dh.dtype != a.h.dtype)
    arg_error(op, std::string("dh must have h's dtype ") + dtype_name(a.h.dtype) + ", got " +
                      dtype_name(a.dh.dtype), Error::Kind::kType);
  check_params(op, a.mode, a.dy, a.normalized_shape, a.weight, a.bias);
  // The statistics: rows values of x's stat dtype (dy stands for x: same shape and dtype).
  check_norm_backward(op, a.dy, a.dy, a.mean, a.rstd, rc.rows, a.mode == NormMode::kLayer);
  return rc;
}

size_t add_norm_backward_workspace_size(const AddNormBackward& a, RowsCols rc,
                                        const Exec& exec) {
  if (!a.weight.defined && !a.bias.defined) return 0;
  return norm_backward_workspace_size(rc.rows, rc.cols, a.dy.dtype, exec);
}

void add_norm_backward(const AddNormBackward& a, RowsCols rc, const Exec& exec) {
  NormBackwardArgs n{a.dy.data, a.h.data, a.mode == NormMode::kLayer ? a.mean.data : nullptr,
                     a.rstd.data, data_if(a.weight), data_if(a.bias), a.dx,
                     a.weight.defined ? a.dweight : nullptr, a.bias.defined ? a.dbias : nullptr,
                     a.workspace, rc.rows, rc.cols, a.zero_centered ? 1.0f : 0.0f, false,
                     a.mode, a.dy.dtype, norm_param_dtype(a.dy, a.weight, a.bias)};
  n.add = true;
  n.dh = data_if(a.dh);
  n.dresidual = a.h.dtype != a.dy.dtype ? a.dresidual : nullptr;
  n.residual_dtype = a.h.dtype;
  norm_backward(n, exec);
}

}  // namespace fusedlayers
