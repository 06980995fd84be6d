// The CUDA FP8 GEMM on cuBLASLt's scaled matmul (contract: fp8/fp8_gemm.h). Row-major
// d [m, n] = a [m, k] b [n, k]^T is column-major d^T = b a^T: cuBLASLt's A is our b (taken
// transposed), its B our a, each with its operand's scale mode and scale_inv.
#include <cublasLt.h>

#include "fp8/fp8_gemm.h"
#include "gemm/cublaslt.cuh"
#include "util/cuda_common.cuh"

namespace fusedlayers {
namespace {

cudaDataType_t fp8_type(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

// cuBLASLt's scale mode of a scaling (cublasLtMatmulMatrixScale_t's values).
int32_t scale_mode(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::kTensorwise: return 0;    // SCALAR_32F
    case Fp8Scaling::kBlock1x128: return 4;    // VEC128_32F
    case Fp8Scaling::kBlock128x128: return 5;  // BLK128x128_32F
  }
  return 0;
}

}  // namespace

void fp8_gemm_cuda(const Fp8Gemm& g, const LtContext& lt) {
  int device, major, minor;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
              "cudaDeviceGetAttribute");
  cuda::check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
              "cudaDeviceGetAttribute");
  const bool blockwise = g.a.scaling != Fp8Scaling::kTensorwise;
  if (blockwise ? major != 9 : major * 10 + minor < 89)
    fail(std::string("fp8_gemm: ") +
         (blockwise ? "block scales run on sm_90 (Hopper) GPUs alone"
                    : "FP8 GEMMs need an sm_89 or newer GPU") +
         ", this one is sm_" + std::to_string(major * 10 + minor));
  const LtFp8 fp8{fp8_type(g.b.format), fp8_type(g.a.format), scale_mode(g.b.scaling),
                  scale_mode(g.a.scaling), g.b.scale_inv, g.a.scale_inv, g.fast_accum};
  const int64_t m = g.m(), n = g.n(), k = g.k();
  LtGemm lt_gemm{true, false, n, m, k, g.b.data, k, g.a.data, k, g.d};
  if (g.bias) {
    lt_gemm.epilogue = CUBLASLT_EPILOGUE_BIAS;
    lt_gemm.bias = g.bias;
  }
  lt_gemm.fp8 = &fp8;
  cublaslt_matmul(lt, g.out_dtype, lt_gemm, "fp8_gemm");
}

}  // namespace fusedlayers
