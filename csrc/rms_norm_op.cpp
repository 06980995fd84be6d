// The RMSNorm op: argument checks, then the norm kernels in NormMode::kRms (contract:
// rms_norm.h).
#include "rms_norm.h"

namespace fusedlayers {

RowsCols rms_norm_forward_check(const RmsNormForward& a) {
  const RowsCols rc = check_norm_input("rms_norm", a.input, a.normalized_shape);
  check_norm_param("rms_norm", "weight", a.weight, a.input, a.normalized_shape);
  check_eps("rms_norm", a.eps);
  return rc;
}

void rms_norm_forward(const RmsNormForward& a, RowsCols rc, const Exec& exec) {
  norm_forward({a.input.data, a.weight.data, nullptr, a.out, nullptr, a.rstd, rc.rows, rc.cols,
                a.eps, a.zero_centered ? 1.0f : 0.0f, NormMode::kRms, a.input.dtype,
                a.weight.defined ? a.weight.dtype : a.input.dtype},
               exec);
}

RowsCols rms_norm_backward_check(const RmsNormBackward& a) {
  const char* op = "rms_norm_backward";
  const RowsCols rc = check_norm_input(op, a.input, a.normalized_shape);
  check_norm_param(op, "weight", a.weight, a.input, a.normalized_shape);
  check_norm_backward(op, a.grad_out, a.input, TensorRef{}, a.rstd, rc.rows, false);
  return rc;
}

size_t rms_norm_backward_workspace_size(const RmsNormBackward& a, RowsCols rc,
                                        const Exec& exec) {
  return a.weight.defined ? norm_backward_workspace_size(rc.rows, rc.cols, a.input.dtype, exec)
                          : 0;
}

void rms_norm_backward(const RmsNormBackward& a, RowsCols rc, const Exec& exec) {
  norm_backward({a.grad_out.data, a.input.data, nullptr, a.rstd.data, a.weight.data, nullptr,
                 a.grad_input, a.weight.defined ? a.grad_weight : nullptr, nullptr, a.workspace,
                 rc.rows, rc.cols, a.zero_centered ? 1.0f : 0.0f, false, NormMode::kRms,
                 a.input.dtype, a.weight.defined ? a.weight.dtype : a.input.dtype},
                exec);
}

}  // namespace fusedlayers
