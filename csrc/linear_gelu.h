// Linear + GELU on CUDA, y = gelu(x @ W^T + b) (Hendrycks & Gimpel 2016, arXiv:1606.08415), with
// the GEMMs on cuBLASLt. (On the CPU the framework's GEMM runs and csrc only fuses the epilogue:
// bias_gelu.h.) x: m x k, b: n, y and pre: m x n, all row-major and contiguous; W is the n x k
// matrix, stored either as nn.Linear keeps it (n x k row-major, WeightLayout::kOutIn) or as GPT-2's
// Conv1D and Keras' Dense keep it (k x n row-major, kInOut): both are read in place, never
// transposed or copied. float32/float16/bfloat16, fp32 accumulation (no TF32).
//
// Forward, approximate='tanh' and n % 8 == 0: one GEMM with cuBLASLt's GELU_BIAS epilogue writes
//   y, and, with its GELU_AUX_BIAS form, the pre-activation pre = x W^T + b (cuBLASLt's GELU
//   epilogue is the tanh form).
// Forward otherwise (erf has no cuBLASLt epilogue): a GEMM with the BIAS epilogue writes pre (or
//   y when pre is not wanted), then one pass computes y = gelu(pre).
// pre is written only when the caller passes it: a forward that no backward follows skips it.
// Backward: one pass dpre = dy * gelu'(pre) with dbias from deterministic slab sums, then the
//   dgrad GEMM dx = dpre W and the wgrad GEMM dW = dpre^T x, dW written in W's layout.
//
// cuBLASLt plans (matmul descriptor, matrix layouts, heuristic algorithm) are cached per host
// thread, keyed by device, sizes, layouts, dtype, epilogue, pointer alignments and workspace
// size: the heuristic query costs tens of microseconds, which a small layer cannot hide.
#pragma once

#include <cstddef>

#include "bias_gelu.h"
#include "common.h"

typedef struct cublasLtContext* cublasLtHandle_t;  // as cublasLt.h declares it

namespace fusedlayers {

// How the n x k matrix W is stored (row-major): (out_features, in_features) as nn.Linear, or
// (in_features, out_features) as GPT-2's Conv1D and Keras' Dense.
enum class WeightLayout { kOutIn, kInOut };

// The cuBLASLt handle and workspace come from the caller (the framework's, reused across calls).
struct LtContext {
  cublasLtHandle_t handle;
  void* workspace;
  size_t workspace_size;
  cudaStream_t stream;
};

// pre: m x n, or nullptr when no backward will read it.
void linear_gelu_forward_cuda(const void* x, const void* w, WeightLayout w_layout,
                              const void* bias, void* pre, void* y, int64_t m, int64_t n,
                              int64_t k, GeluApprox approx, DType dtype, const LtContext& lt);

// Scratch for the backward: dpre (m x n of dtype) followed by the dbias slab sums.
size_t linear_gelu_backward_workspace_size_cuda(int64_t m, int64_t n, DType dtype);

// dw is written in w_layout, like w.
void linear_gelu_backward_cuda(const void* dy, const void* x, const void* w,
                               WeightLayout w_layout, const void* pre, void* dx, void* dw,
                               void* dbias, void* workspace, int64_t m, int64_t n, int64_t k,
                               GeluApprox approx, DType dtype, const LtContext& lt);

}  // namespace fusedlayers
