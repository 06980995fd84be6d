// The FP8 gated activations: argument checks (gated.h's, then fp8_gated.h's), then the kernels.
#include "fp8/fp8_gated.h"

namespace fusedlayers {
namespace {

void check_fp8(const char* op, DType dtype, const Fp8Target& out, RowsCols rc) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16)
    arg_error(op, std::string("gate must be float16 or bfloat16, got ") + dtype_name(dtype),
              Error::Kind::kType);
  if (out.scaling == Fp8Scaling::kBlock128x128)
    arg_error(op, "scaling must be '1x128' or 'tensorwise' (128x128 tiles are for weights)");
  fp8_target_check(op, out);
  if (rc.cols % kFp8Block != 0)
    arg_error(op, "gate's last dimension must be a multiple of " + std::to_string(kFp8Block) +
                      ", got " + std::to_string(rc.cols));
}

int64_t stride_or_cols(const GatedInput& in, RowsCols rc) {
  return in.row_stride ? in.row_stride : rc.cols;
}

}  // namespace

GatedActivation parse_gated_activation(const char* op, const std::string& activation) {
  if (activation == "silu") return GatedActivation::kSilu;
  if (activation == "gelu") return GatedActivation::kGelu;
  if (activation == "gelu_tanh") return GatedActivation::kGeluTanh;
  arg_error(op, "activation must be 'silu', 'gelu' or 'gelu_tanh', got '" + activation + "'");
}

RowsCols fp8_gated_forward_check(const char* op, const Fp8GatedForward& a) {
  GatedForward g;
  g.gate = a.gate;
  g.up = a.up;
  const RowsCols rc = gated_forward_check(op, g);
  check_fp8(op, a.gate.t.dtype, a.out, rc);
  return rc;
}

RowsCols fp8_gated_backward_check(const char* op, const Fp8GatedBackward& a) {
  GatedBackward g;
  g.dy = a.dy;
  g.gate = a.gate;
  g.up = a.up;
  const RowsCols rc = gated_backward_check(op, g);
  check_fp8(op, a.gate.t.dtype, a.out, rc);
  if (a.out.scaling_t != a.out.scaling)
    arg_error(op, "scaling_t must be scaling: the gradient's x^T is the weight gradient's "
                  "dy operand, blocked as dy");
  return rc;
}

void fp8_gated_forward(const Fp8GatedForward& a, RowsCols rc, const Exec& exec) {
  const int64_t gs = stride_or_cols(a.gate, rc), us = stride_or_cols(a.up, rc);
  // no values: no blocks, and a tensorwise scale of 1 (amax 0), which the kernels write
  if (rc.rows * rc.cols == 0 && a.out.scaling != Fp8Scaling::kTensorwise) return;
  FUSEDLAYERS_ON_DEVICE(exec, fp8_gated_forward_cpu(a, gs, us, rc, exec.parallel_for),
                        fp8_gated_forward_cuda(a, gs, us, rc, exec.stream));
}

void fp8_gated_backward(const Fp8GatedBackward& a, RowsCols rc, const Exec& exec) {
  const int64_t gs = stride_or_cols(a.gate, rc), us = stride_or_cols(a.up, rc);
  if (rc.rows * rc.cols == 0 && a.out.scaling != Fp8Scaling::kTensorwise) return;
  FUSEDLAYERS_ON_DEVICE(exec, fp8_gated_backward_cpu(a, gs, us, rc, exec.parallel_for),
                        fp8_gated_backward_cuda(a, gs, us, rc, exec.stream));
}

}  // namespace fusedlayers
