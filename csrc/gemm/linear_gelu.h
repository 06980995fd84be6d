// The Linear + GELU op, y = gelu(x @ W^T + b) (gelu.h): its contract and its passes. x: m x k,
// b: n, y and pre: m x n, all row-major and contiguous; W is the n x k matrix, stored either as
// nn.Linear keeps it (n x k row-major, WeightLayout::kOutIn) or as GPT-2's Conv1D and Keras' Dense
// keep it (k x n row-major, kInOut): both are read in place, never transposed or copied.
//
// CPU: the GEMMs are the framework's (a GemmContext::cpu callback) and csrc fuses the epilogue
// (linear_gelu_epilogue.h): the forward's GEMM writes pre (or y in place when pre is not wanted),
// one pass adds the bias and applies GELU; the backward's one pass gives dpre and dbias, then the
// dgrad and wgrad GEMMs run. float32/float64/float16/bfloat16, as the framework's GEMM.
//
// CUDA: everything on cuBLASLt (GemmContext::lt, the framework's handle and workspace),
// float32/float16/bfloat16, fp32 accumulation (no TF32):
// Forward, approximate='tanh' and n % 8 == 0: one GEMM with cuBLASLt's GELU_BIAS epilogue writes
//   y, and, with its GELU_AUX_BIAS form, the pre-activation pre = x W^T + b (cuBLASLt's GELU
//   epilogue is the tanh form).
// Forward otherwise (erf has no cuBLASLt epilogue): a GEMM with the BIAS epilogue writes pre (or
//   y when pre is not wanted), then one pass computes y = gelu(pre).
// pre is written only when the caller passes it: a forward that no backward follows skips it.
// Backward: one pass dpre = dy * gelu'(pre) with dbias from deterministic slab sums, then the
//   dgrad GEMM dx = dpre W and the wgrad GEMM dW = dpre^T x, dW written in W's layout.
#pragma once

#include <cstddef>

#include "gemm/linear_gelu_epilogue.h"
#include "util/common.h"
#include "gemm/cublaslt.h"
#include "gemm/gemm.h"
#include "activation/gelu.h"

namespace fusedlayers {

// How the n x k matrix W is stored (row-major): (out_features, in_features) as nn.Linear, or
// (in_features, out_features) as GPT-2's Conv1D and Keras' Dense.
enum class WeightLayout { kOutIn, kInOut };

// c = a @ b in `dtype` (a.rows x b.cols, contiguous row-major, gemm.h's Matrix operands), by
// the framework's GEMM.
using CpuGemm = std::function<void(const Matrix& a, const Matrix& b, void* c, DType dtype)>;

// The GEMMs of the op on each device: the binding hands both in, the entry point uses the one of
// its Exec.
struct GemmContext {
  CpuGemm cpu;
  LtContext lt;
};

// The op's contract, for every binding: x at least 1-D with last dim in_features; weight 2-D
// (out_features, in_features) in x's dtype; bias (out_features,) in x's dtype; the
// backward's dy and pre of shape (..., out_features) in x's dtype. Errors: Error of kind
// kType for dtypes, kValue otherwise. x, pre and dy are contiguous; weight is stored
// contiguous in weight_layout; the bindings allocate the outputs.
struct LinearGeluForward {
  TensorRef x;   // (..., in_features)
  TensorRef weight;  // sizes (out_features, in_features); data stored in weight_layout
  WeightLayout weight_layout = WeightLayout::kOutIn;
  TensorRef bias;  // (out_features,), or not defined
  GeluApprox approx = GeluApprox::kNone;
  // Outputs of shape (..., out_features): pre (nullptr when no backward will read it) and out.
  void* pre = nullptr;
  void* y = nullptr;
};

struct LinearGeluBackward {
  TensorRef dy, x, weight, pre;
  WeightLayout weight_layout = WeightLayout::kOutIn;
  bool has_bias = false;
  GeluApprox approx = GeluApprox::kNone;
  // Outputs: dx like x, dweight in weight_layout, dbias when has_bias.
  void* dx = nullptr;
  void* dweight = nullptr;
  void* dbias = nullptr;
  void* workspace = nullptr;  // linear_gelu_backward_workspace_size() bytes
};

// The GEMM's sizes: m rows (x's leading dims), n = out_features, k = in_features.
struct GemmSizes {
  int64_t m, n, k;
};

GemmSizes linear_gelu_forward_check(const LinearGeluForward& a);
GemmSizes linear_gelu_backward_check(const LinearGeluBackward& a);

// Run the pass on exec's device (the CPU's GEMMs: gemm.cpu; CUDA's: gemm.lt, whose stream is
// exec's); a must have passed its check.
void linear_gelu_forward(const LinearGeluForward& a, GemmSizes s, const Exec& exec,
                         const GemmContext& gemm);
size_t linear_gelu_backward_workspace_size(const LinearGeluBackward& a, GemmSizes s,
                                           const Exec& exec);
void linear_gelu_backward(const LinearGeluBackward& a, GemmSizes s, const Exec& exec,
                          const GemmContext& gemm);

// The CUDA passes (linear_gelu_cuda.cu).
void linear_gelu_forward_cuda(const LinearGeluForward& a, GemmSizes s, const LtContext& lt);
size_t linear_gelu_backward_workspace_size_cuda(GemmSizes s, DType dtype);
void linear_gelu_backward_cuda(const LinearGeluBackward& a, GemmSizes s, const LtContext& lt);

}  // namespace fusedlayers
