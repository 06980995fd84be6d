// The bias + GELU epilogue as an op: argument checks, then the kernels (contract: linear_gelu_epilogue.h).
#include "gemm/linear_gelu_epilogue.h"

namespace fusedlayers {
namespace {

RowsCols rows_cols(const char* op, const char* arg, const TensorRef& t) {
  if (t.sizes.size < 1) arg_error(op, std::string(arg) + " must be at least 1-D, got shape []");
  const int64_t cols = t.sizes[t.sizes.size - 1];
  return {cols ? t.sizes.numel() / cols : 0, cols};
}

}  // namespace

RowsCols linear_gelu_epilogue_forward_check(const char* op, const LinearGeluEpilogueForward& a) {
  const RowsCols rc = rows_cols(op, "h", a.h);
  if (!a.bias.defined) return rc;
  if (a.bias.sizes.size != 1 || a.bias.sizes[0] != rc.cols)
    arg_error(op, "bias must have shape [" + std::to_string(rc.cols) + "] (out_features), got " +
                      a.bias.sizes.str());
  if (a.bias.dtype != a.h.dtype)
    arg_error(op, std::string("bias must have x's dtype ") + dtype_name(a.h.dtype) +
                      ", got " + dtype_name(a.bias.dtype),
              Error::Kind::kType);
  return rc;
}

RowsCols linear_gelu_epilogue_backward_check(const char* op, const LinearGeluEpilogueBackward& a) {
  const RowsCols rc = rows_cols(op, "pre", a.pre);
  if (!(a.dy.sizes == a.pre.sizes) || a.dy.dtype != a.pre.dtype)
    arg_error(op, "dy must match pre (" + a.pre.sizes.str() + ", " +
                      dtype_name(a.pre.dtype) + "), got " + a.dy.sizes.str() + ", " +
                      dtype_name(a.dy.dtype));
  return rc;
}

void linear_gelu_epilogue_forward(const LinearGeluEpilogueForward& a, RowsCols rc, const Exec& exec) {
  const void* b = data_if(a.bias);
  FUSEDLAYERS_ON_DEVICE(exec,
                        linear_gelu_epilogue_forward_cpu(a.h.data, b, a.pre, a.y, rc.rows, rc.cols,
                                              a.approx, a.h.dtype, exec.parallel_for),
                        linear_gelu_epilogue_forward_cuda(a.h.data, b, a.pre, a.y, rc.rows, rc.cols,
                                               a.approx, a.h.dtype, exec.stream));
}

size_t linear_gelu_epilogue_backward_workspace_size(const LinearGeluEpilogueBackward& a, RowsCols rc,
                                         const Exec& exec) {
  if (!a.has_bias) return 0;
  return FUSEDLAYERS_ON_DEVICE(
      exec, linear_gelu_epilogue_backward_workspace_size_cpu(rc.rows, rc.cols, a.pre.dtype),
      linear_gelu_epilogue_backward_workspace_size_cuda(rc.rows, rc.cols, a.pre.dtype));
}

void linear_gelu_epilogue_backward(const LinearGeluEpilogueBackward& a, RowsCols rc, const Exec& exec) {
  void* db = a.has_bias ? a.dbias : nullptr;
  FUSEDLAYERS_ON_DEVICE(
      exec,
      linear_gelu_epilogue_backward_cpu(a.dy.data, a.pre.data, a.dpre, db, a.workspace, rc.rows,
                             rc.cols, a.approx, a.pre.dtype, exec.parallel_for),
      linear_gelu_epilogue_backward_cuda(a.dy.data, a.pre.data, a.dpre, db, a.workspace, rc.rows,
                              rc.cols, a.approx, a.pre.dtype, exec.stream));
}

}  // namespace fusedlayers
