// Linear + GELU on CUDA, y = gelu(x @ W^T + b) (Hendrycks & Gimpel 2016, arXiv:1606.08415), with
// the GEMMs on cuBLASLt. (On the CPU the framework's GEMM runs and csrc only fuses the epilogue:
// bias_gelu.h.) x: m x k, W: n x k, b: n, y and pre: m x n, all row-major and contiguous,
// float32/float16/bfloat16, fp32 accumulation (no TF32).
//
// Forward, approximate='tanh' and n % 8 == 0: one GEMM with cuBLASLt's GELU_AUX_BIAS epilogue
//   writes y and the pre-activation pre = x W^T + b (cuBLASLt's GELU epilogue is the tanh form).
// Forward otherwise (erf has no cuBLASLt epilogue): a GEMM with the BIAS epilogue writes pre,
//   then one pass computes y = gelu(pre).
// Backward: one pass dpre = dy * gelu'(pre) with dbias from deterministic slab sums, then the
//   dgrad GEMM dx = dpre W and the wgrad GEMM dW = dpre^T x.
#pragma once

#include <cstddef>

#include "bias_gelu.h"
#include "common.h"

typedef struct cublasLtContext* cublasLtHandle_t;  // as cublasLt.h declares it

namespace fusedlayers {

// The cuBLASLt handle and workspace come from the caller (the framework's, reused across calls).
struct LtContext {
  cublasLtHandle_t handle;
  void* workspace;
  size_t workspace_size;
  cudaStream_t stream;
};

void linear_gelu_forward_cuda(const void* x, const void* w, const void* bias, void* pre, void* y,
                              int64_t m, int64_t n, int64_t k, GeluApprox approx, DType dtype,
                              const LtContext& lt);

// Scratch for the backward: dpre (m x n of dtype) followed by the dbias slab sums.
size_t linear_gelu_backward_workspace_size_cuda(int64_t m, int64_t n, DType dtype);

void linear_gelu_backward_cuda(const void* dy, const void* x, const void* w, const void* pre,
                               void* dx, void* dw, void* dbias, void* workspace, int64_t m,
                               int64_t n, int64_t k, GeluApprox approx, DType dtype,
                               const LtContext& lt);

}  // namespace fusedlayers
