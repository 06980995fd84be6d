// The FP8 GEMM op's entry point: its checks (fp8_gemm_check.cpp), then the CPU reference or
// cuBLASLt (contract: fp8/fp8_gemm.h).
#include "fp8/fp8_gemm.h"

namespace fusedlayers {

void fp8_gemm(const Fp8Gemm& g, const Exec& exec, const LtContext& lt) {
  fp8_gemm_check(g);
  if (g.m() == 0 || g.n() == 0) return;
  FUSEDLAYERS_ON_DEVICE(exec, fp8_gemm_cpu(g, exec.parallel_for), fp8_gemm_cuda(g, lt));
}

}  // namespace fusedlayers
