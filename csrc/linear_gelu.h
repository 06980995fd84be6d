// The Linear + GELU op, y = gelu(x @ W^T + b) (gelu.h): its contract, and on CUDA its passes, with
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
#include "gelu.h"

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

// The op's contract, for every binding: input at least 1-D with last dim in_features; weight 2-D
// (out_features, in_features) in input's dtype; bias (out_features,) in input's dtype; the
// backward's grad_out and pre of shape (..., out_features) in input's dtype. Errors: Error of kind
// kType for dtypes, kValue otherwise. input, pre and grad_out are contiguous; weight is stored
// contiguous in weight_layout; the bindings allocate the outputs.
struct LinearGeluForward {
  TensorRef input;   // (..., in_features)
  TensorRef weight;  // sizes (out_features, in_features); data stored in weight_layout
  WeightLayout weight_layout = WeightLayout::kOutIn;
  TensorRef bias;  // (out_features,), or not defined
  GeluApprox approx = GeluApprox::kNone;
  // Outputs of shape (..., out_features): pre (nullptr when no backward will read it) and out.
  void* pre = nullptr;
  void* out = nullptr;
};

struct LinearGeluBackward {
  TensorRef grad_out, input, weight, pre;
  WeightLayout weight_layout = WeightLayout::kOutIn;
  bool has_bias = false;
  GeluApprox approx = GeluApprox::kNone;
  // Outputs: grad_input like input, grad_weight in weight_layout, grad_bias when has_bias.
  void* grad_input = nullptr;
  void* grad_weight = nullptr;
  void* grad_bias = nullptr;
  void* workspace = nullptr;  // linear_gelu_backward_workspace_size_cuda() bytes
};

// The GEMM's sizes: m rows (input's leading dims), n = out_features, k = in_features.
struct GemmSizes {
  int64_t m, n, k;
};

GemmSizes linear_gelu_forward_check(const LinearGeluForward& a);
GemmSizes linear_gelu_backward_check(const LinearGeluBackward& a);

// The CUDA passes; a must have passed its check. On the CPU the bindings run their framework's
// GEMMs around the bias_gelu op.
void linear_gelu_forward_cuda(const LinearGeluForward& a, GemmSizes s, const LtContext& lt);
size_t linear_gelu_backward_workspace_size_cuda(GemmSizes s, DType dtype);
void linear_gelu_backward_cuda(const LinearGeluBackward& a, GemmSizes s, const LtContext& lt);

}  // namespace fusedlayers
