// The LayerNorm op: argument checks, then the norm kernels (contract: layer_norm.h). Named
// *_op.cpp: the JIT build names objects by file stem, and backends/torch/layer_norm.cpp exists.
#include "norm/layer_norm.h"

namespace fusedlayers {
namespace {

NormMode mode_of(bool rms_scaling) {
  return rms_scaling ? NormMode::kKerasRmsScaling : NormMode::kLayer;
}

// The rules forward and backward share, for `op` on x (or saved).
RowsCols check_common(const char* op, const TensorRef& x, Sizes normalized_shape,
                      const TensorRef& weight, const TensorRef& bias, bool rms_scaling) {
  const RowsCols rc = check_norm_input(op, x, normalized_shape);
  check_norm_param(op, "weight", weight, x, normalized_shape);
  check_norm_param(op, "bias", bias, x, normalized_shape);
  check_same_param_dtype(op, weight, bias);
  if (rms_scaling && bias.defined) arg_error(op, "bias must be None when rms_scaling is True");
  return rc;
}

}  // namespace

RowsCols layer_norm_forward_check(const LayerNormForward& a) {
  const RowsCols rc =
      check_common("layer_norm", a.x, a.normalized_shape, a.weight, a.bias, a.rms_scaling);
  check_eps("layer_norm", a.eps);
  return rc;
}

void layer_norm_forward(const LayerNormForward& a, RowsCols rc, const Exec& exec) {
  norm_forward({a.x.data, data_if(a.weight), data_if(a.bias), a.y, a.mean, a.rstd, rc.rows,
                rc.cols, a.eps, 0.0f, mode_of(a.rms_scaling), a.x.dtype,
                norm_param_dtype(a.x, a.weight, a.bias)},
               exec);
}

RowsCols layer_norm_backward_check(const LayerNormBackward& a) {
  const char* op = "layer_norm_backward";
  const RowsCols rc =
      check_common(op, a.saved, a.normalized_shape, a.weight, a.bias, a.rms_scaling);
  if (a.memory_efficient && a.rms_scaling)
    arg_error(op, "memory_efficient needs rms_scaling False");
  check_norm_backward(op, a.dy, a.saved, a.mean, a.rstd, rc.rows, !a.memory_efficient);
  return rc;
}

size_t layer_norm_backward_workspace_size(const LayerNormBackward& a, RowsCols rc,
                                          const Exec& exec) {
  if (!a.weight.defined && !a.bias.defined) return 0;
  return norm_backward_workspace_size(rc.rows, rc.cols, a.saved.dtype, exec);
}

void layer_norm_backward(const LayerNormBackward& a, RowsCols rc, const Exec& exec) {
  norm_backward({a.dy.data, a.saved.data, a.memory_efficient ? nullptr : a.mean.data,
                 a.rstd.data, data_if(a.weight), data_if(a.bias), a.dx,
                 a.weight.defined ? a.dweight : nullptr,
                 a.bias.defined ? a.dbias : nullptr, a.workspace, rc.rows, rc.cols, 0.0f,
                 a.memory_efficient, mode_of(a.rms_scaling), a.saved.dtype,
                 norm_param_dtype(a.saved, a.weight, a.bias)},
                exec);
}

}  // namespace fusedlayers
