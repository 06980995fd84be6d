// The epilogue of a linear layer followed by GELU (forms and constants: gelu.h):
//
//   pre = h + bias            (h = x @ W^T, computed by a GEMM before it)
//   y   = gelu(pre)
//
// Backward: dpre = dy * gelu'(pre), dbias = sum_rows dpre; the GEMMs for dgrad and wgrad are the
// caller's. All math in float32 (float64 for float64) with one rounding to the output dtype.
//
// The op's contract, for every binding: h at least 1-D, viewed as rows x cols over its last dim;
// bias of shape (cols,) and h's dtype; the backward's grad_out of pre's shape and dtype. Errors:
// Error of kind kType for dtypes, kValue otherwise, naming the op the caller passes (the public op
// it serves). Tensors are contiguous; the bindings allocate the outputs.
#pragma once

#include <cstddef>

#include "common.h"
#include "gelu.h"

namespace fusedlayers {

struct BiasGeluForward {
  TensorRef h;     // (..., cols)
  TensorRef bias;  // (cols,), or not defined
  GeluApprox approx = GeluApprox::kNone;
  // Outputs like h: pre (may alias h.data; nullptr on CUDA: not written, and then out may alias
  // h.data) and out = gelu(pre).
  void* pre = nullptr;
  void* out = nullptr;
};

struct BiasGeluBackward {
  TensorRef grad_out, pre;  // (..., cols)
  bool has_bias = false;
  GeluApprox approx = GeluApprox::kNone;
  // Outputs: grad_pre like pre (may alias grad_out.data); grad_bias (cols,) when has_bias.
  void* grad_pre = nullptr;
  void* grad_bias = nullptr;
  void* workspace = nullptr;  // bias_gelu_backward_workspace_size() bytes
};

RowsCols bias_gelu_forward_check(const char* op, const BiasGeluForward& a);
RowsCols bias_gelu_backward_check(const char* op, const BiasGeluBackward& a);
// Run the pass on exec's device; a must have passed its check.
void bias_gelu_forward(const BiasGeluForward& a, RowsCols rc, const Exec& exec);
size_t bias_gelu_backward_workspace_size(const BiasGeluBackward& a, RowsCols rc,
                                         const Exec& exec);
void bias_gelu_backward(const BiasGeluBackward& a, RowsCols rc, const Exec& exec);

// The kernels. h: rows x cols of `dtype`, bias: cols or nullptr. Writes pre (may alias h) and
// y = gelu(pre). pre is rounded to `dtype` and y computed from the rounded value, as the unfused
// layer does.
void bias_gelu_forward_cpu(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                           int64_t cols, GeluApprox approx, DType dtype,
                           const ParallelFor& parallel_for);
// Bytes of workspace bias_gelu_backward_cpu needs for per-chunk partial dbias sums.
size_t bias_gelu_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype);
// dy, pre, dpre: rows x cols (dpre may alias dy). dbias: cols or nullptr; when given it is fully
// written (zeros for rows == 0) and does not depend on how parallel_for splits the work.
void bias_gelu_backward_cpu(const void* dy, const void* pre, void* dpre, void* dbias,
                            void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                            DType dtype, const ParallelFor& parallel_for);

// CUDA: the same contract on device pointers, launched on `stream` of the current device, for
// float32/float16/bfloat16. 16-byte vectors when cols and the pointers allow it. The forward's
// pre may also be nullptr (not written), and then y may alias h: y = gelu(h + bias) in place.
void bias_gelu_forward_cuda(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                            int64_t cols, GeluApprox approx, DType dtype, cudaStream_t stream);
size_t bias_gelu_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype);
void bias_gelu_backward_cuda(const void* dy, const void* pre, void* dpre, void* dbias,
                             void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                             DType dtype, cudaStream_t stream);

}  // namespace fusedlayers
