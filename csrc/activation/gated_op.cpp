// The gated activations: argument checks, then the kernels (contract: gated.h).
#include "activation/gated.h"

namespace fusedlayers {
namespace {

RowsCols rows_cols(const Sizes& s) {
  const int64_t cols = s.size ? s[s.size - 1] : 1;
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < s.size; ++i) rows *= s[i];
  return {rows, cols};
}

// `in` (named arg) has the shape and dtype of `like` (named like_arg), and rows at least cols
// apart.
void check_like(const char* op, const char* arg, const TensorRef& in, const char* like_arg,
                const TensorRef& like) {
  if (in.dtype != like.dtype)
    arg_error(op, std::string(arg) + " must have " + like_arg + "'s dtype " +
                      dtype_name(like.dtype) + ", got " + dtype_name(in.dtype),
              Error::Kind::kType);
  if (!(in.sizes == like.sizes))
    arg_error(op, std::string(arg) + " must have " + like_arg + "'s shape " + like.sizes.str() +
                      ", got " + in.sizes.str());
}

void check_stride(const char* op, const char* arg, const GatedInput& in, RowsCols rc) {
  if (in.row_stride != 0 && rc.rows > 1 && in.row_stride < rc.cols)
    arg_error(op, std::string(arg) + "'s rows must be at least " + std::to_string(rc.cols) +
                      " elements apart, got " + std::to_string(in.row_stride));
}

int64_t stride_or_cols(const GatedInput& in, RowsCols rc) {
  return in.row_stride ? in.row_stride : rc.cols;
}

}  // namespace

RowsCols gated_forward_check(const char* op, const GatedForward& a) {
  check_like(op, "up", a.up.t, "gate", a.gate.t);
  const RowsCols rc = rows_cols(a.gate.t.sizes);
  check_stride(op, "gate", a.gate, rc);
  check_stride(op, "up", a.up, rc);
  return rc;
}

RowsCols gated_backward_check(const char* op, const GatedBackward& a) {
  check_like(op, "up", a.up.t, "gate", a.gate.t);
  check_like(op, "dy", a.dy, "gate", a.gate.t);
  const RowsCols rc = rows_cols(a.gate.t.sizes);
  check_stride(op, "gate", a.gate, rc);
  check_stride(op, "up", a.up, rc);
  return rc;
}

void gated_forward(const GatedForward& a, RowsCols rc, const Exec& exec) {
  const int64_t gs = stride_or_cols(a.gate, rc), us = stride_or_cols(a.up, rc);
  FUSEDLAYERS_ON_DEVICE(
      exec,
      gated_forward_cpu(a.gate.t.data, gs, a.up.t.data, us, a.y, rc.rows, rc.cols, a.activation,
                        a.gate.t.dtype, exec.parallel_for),
      gated_forward_cuda(a.gate.t.data, gs, a.up.t.data, us, a.y, rc.rows, rc.cols, a.activation,
                         a.gate.t.dtype, exec.stream));
}

void gated_backward(const GatedBackward& a, RowsCols rc, const Exec& exec) {
  const int64_t gs = stride_or_cols(a.gate, rc), us = stride_or_cols(a.up, rc);
  FUSEDLAYERS_ON_DEVICE(
      exec,
      gated_backward_cpu(a.dy.data, a.gate.t.data, gs, a.up.t.data, us, a.dgate, a.dup, rc.rows,
                         rc.cols, a.activation, a.gate.t.dtype, exec.parallel_for),
      gated_backward_cuda(a.dy.data, a.gate.t.data, gs, a.up.t.data, us, a.dgate, a.dup, rc.rows,
                          rc.cols, a.activation, a.gate.t.dtype, exec.stream));
}

}  // namespace fusedlayers
