// The FP8 norms: argument checks (add_norm.h's, then fp8_norm.h's), then the kernels.
#include "fp8/fp8_norm.h"

namespace fusedlayers {

const char* fp8_norm_name(NormMode mode) {
  return mode == NormMode::kRms ? "fp8_rms_norm" : "fp8_layer_norm";
}

RowsCols fp8_norm_forward_check(const Fp8NormForward& a) {
  const char* op = fp8_norm_name(a.norm.mode);
  const RowsCols rc = check_add_norm_forward(op, a.norm);
  if (a.norm.x.dtype == DType::kFloat64)
    arg_error(op, "x must be float32, float16 or bfloat16, got float64", Error::Kind::kType);
  if (a.out.scaling == Fp8Scaling::kBlock128x128)
    arg_error(op, "scaling must be '1x128' or 'tensorwise' (128x128 tiles are for weights)");
  return rc;
}

void fp8_norm_forward(const Fp8NormForward& a, RowsCols rc, const Exec& exec) {
  const NormForwardArgs n = add_norm_args(a.norm, rc);
  FUSEDLAYERS_ON_DEVICE(exec, fp8_norm_forward_cpu(n, a.out, exec.parallel_for),
                        fp8_norm_forward_cuda(n, a.out, exec.stream));
}

}  // namespace fusedlayers
