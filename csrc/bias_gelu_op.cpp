// The bias + GELU epilogue as an op: argument checks, then the kernels (contract: bias_gelu.h).
#include "bias_gelu.h"

namespace fusedlayers {
namespace {

RowsCols rows_cols(const char* op, const char* arg, const TensorRef& t) {
  if (t.sizes.size < 1) arg_error(op, std::string(arg) + " must be at least 1-D, got shape []");
  const int64_t cols = t.sizes[t.sizes.size - 1];
  return {cols ? t.sizes.numel() / cols : 0, cols};
}

}  // namespace

RowsCols bias_gelu_forward_check(const char* op, const BiasGeluForward& a) {
  const RowsCols rc = rows_cols(op, "input", a.h);
  if (!a.bias.defined) return rc;
  if (a.bias.sizes.size != 1 || a.bias.sizes[0] != rc.cols)
    arg_error(op, "bias must have shape [" + std::to_string(rc.cols) + "] (out_features), got " +
                      a.bias.sizes.str());
  if (a.bias.dtype != a.h.dtype)
    arg_error(op, std::string("bias must have input's dtype ") + dtype_name(a.h.dtype) +
                      ", got " + dtype_name(a.bias.dtype),
              Error::Kind::kType);
  return rc;
}

RowsCols bias_gelu_backward_check(const char* op, const BiasGeluBackward& a) {
  const RowsCols rc = rows_cols(op, "pre", a.pre);
  if (!(a.grad_out.sizes == a.pre.sizes) || a.grad_out.dtype != a.pre.dtype)
    arg_error(op, "grad_out must match pre (" + a.pre.sizes.str() + ", " +
                      dtype_name(a.pre.dtype) + "), got " + a.grad_out.sizes.str() + ", " +
                      dtype_name(a.grad_out.dtype));
  return rc;
}

void bias_gelu_forward(const BiasGeluForward& a, RowsCols rc, const Exec& exec) {
  const void* b = a.bias.defined ? a.bias.data : nullptr;
  FUSEDLAYERS_ON_DEVICE(exec,
                        bias_gelu_forward_cpu(a.h.data, b, a.pre, a.out, rc.rows, rc.cols,
                                              a.approx, a.h.dtype, exec.parallel_for),
                        bias_gelu_forward_cuda(a.h.data, b, a.pre, a.out, rc.rows, rc.cols,
                                               a.approx, a.h.dtype, exec.stream));
}

size_t bias_gelu_backward_workspace_size(const BiasGeluBackward& a, RowsCols rc,
                                         const Exec& exec) {
  if (!a.has_bias) return 0;
  return FUSEDLAYERS_ON_DEVICE(
      exec, bias_gelu_backward_workspace_size_cpu(rc.rows, rc.cols, a.pre.dtype),
      bias_gelu_backward_workspace_size_cuda(rc.rows, rc.cols, a.pre.dtype));
}

void bias_gelu_backward(const BiasGeluBackward& a, RowsCols rc, const Exec& exec) {
  void* db = a.has_bias ? a.grad_bias : nullptr;
  FUSEDLAYERS_ON_DEVICE(
      exec,
      bias_gelu_backward_cpu(a.grad_out.data, a.pre.data, a.grad_pre, db, a.workspace, rc.rows,
                             rc.cols, a.approx, a.pre.dtype, exec.parallel_for),
      bias_gelu_backward_cuda(a.grad_out.data, a.pre.data, a.grad_pre, db, a.workspace, rc.rows,
                              rc.cols, a.approx, a.pre.dtype, exec.stream));
}

}  // namespace fusedlayers
