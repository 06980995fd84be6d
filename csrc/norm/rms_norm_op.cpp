// The RMSNorm op: argument checks, then the norm kernels in NormMode::kRms (contract:
// rms_norm.h).
#include "norm/rms_norm.h"

namespace fusedlayers {

RowsCols rms_norm_forward_check(const RmsNormForward& a) {
  const RowsCols rc = check_norm_input("rms_norm", a.x, a.normalized_shape);
  check_norm_param("rms_norm", "weight", a.weight, a.x, a.normalized_shape);
  check_eps("rms_norm", a.eps);
  return rc;
}

void rms_norm_forward(const RmsNormForward& a, RowsCols rc, const Exec& exec) {
  norm_forward({a.x.data, data_if(a.weight), nullptr, a.y, nullptr, a.rstd, rc.rows, rc.cols,
                a.eps, a.zero_centered ? 1.0f : 0.0f, NormMode::kRms, a.x.dtype,
                a.weight.defined ? a.weight.dtype : a.x.dtype},
               exec);
}

RowsCols rms_norm_backward_check(const RmsNormBackward& a) {
  const char* op = "rms_norm_backward";
  const RowsCols rc = check_norm_input(op, a.x, a.normalized_shape);
  check_norm_param(op, "weight", a.weight, a.x, a.normalized_shape);
  check_norm_backward(op, a.dy, a.x, TensorRef{}, a.rstd, rc.rows, false);
  return rc;
}

size_t rms_norm_backward_workspace_size(const RmsNormBackward& a, RowsCols rc,
                                        const Exec& exec) {
  return a.weight.defined ? norm_backward_workspace_size(rc.rows, rc.cols, a.x.dtype, exec)
                          : 0;
}

void rms_norm_backward(const RmsNormBackward& a, RowsCols rc, const Exec& exec) {
  norm_backward({a.dy.data, a.x.data, nullptr, a.rstd.data, data_if(a.weight), nullptr,
                 a.dx, a.weight.defined ? a.dweight : nullptr, nullptr, a.workspace,
                 rc.rows, rc.cols, a.zero_centered ? 1.0f : 0.0f, false, NormMode::kRms,
                 a.x.dtype, a.weight.defined ? a.weight.dtype : a.x.dtype},
                exec);
}

}  // namespace fusedlayers
