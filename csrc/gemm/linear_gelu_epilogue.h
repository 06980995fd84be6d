// The epilogue of a linear layer followed by GELU (forms and constants: gelu.h):
//
//   pre = h + bias            (h = x @ W^T, computed by a GEMM before it)
//   y   = gelu(pre)
//
// Backward: dpre = dy * gelu'(pre), dbias = sum_rows dpre; the GEMMs for dgrad and wgrad are the
// caller's. All math in float32 (float64 for float64) with one rounding to the output dtype.
//
// The op's contract, for every binding: h at least 1-D, viewed as rows x cols over its last dim;
// bias of shape (cols,) and h's dtype; the backward's dy of pre's shape and dtype. Errors:
// Error of kind kType for dtypes, kValue otherwise, naming the op the caller passes (the public op
// it serves). Tensors are contiguous; the bindings allocate the outputs.
#pragma once

#include <cstddef>

#include "util/common.h"
#include "activation/gelu.h"

namespace fusedlayers {

struct LinearGeluEpilogueForward {
  TensorRef h;     // (..., cols)
  TensorRef bias;  // (cols,), or not defined
  GeluApprox approx = GeluApprox::kNone;
  // Outputs like h: pre (may alias h.data; nullptr on CUDA: not written, and then y may alias
  // h.data) and y = gelu(pre).
  void* pre = nullptr;
  void* y = nullptr;
};

struct LinearGeluEpilogueBackward {
  TensorRef dy, pre;  // (..., cols)
  bool has_bias = false;
  GeluApprox approx = GeluApprox::kNone;
  // Outputs: dpre like pre (may alias dy.data); dbias (cols,) when has_bias.
  void* dpre = nullptr;
  void* dbias = nullptr;
  void* workspace = nullptr;  // linear_gelu_epilogue_backward_workspace_size() bytes
};

RowsCols linear_gelu_epilogue_forward_check(const char* op, const LinearGeluEpilogueForward& a);
RowsCols linear_gelu_epilogue_backward_check(const char* op, const LinearGeluEpilogueBackward& a);
// Run the pass on exec's device; a must have passed its check.
void linear_gelu_epilogue_forward(const LinearGeluEpilogueForward& a, RowsCols rc, const Exec& exec);
size_t linear_gelu_epilogue_backward_workspace_size(const LinearGeluEpilogueBackward& a, RowsCols rc,
                                         const Exec& exec);
void linear_gelu_epilogue_backward(const LinearGeluEpilogueBackward& a, RowsCols rc, const Exec& exec);

// The kernels. h: rows x cols of `dtype`, bias: cols or nullptr. Writes pre (may alias h) and
// y = gelu(pre). pre is rounded to `dtype` and y computed from the rounded value, as the unfused
// layer does.
void linear_gelu_epilogue_forward_cpu(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                           int64_t cols, GeluApprox approx, DType dtype,
                           const ParallelFor& parallel_for);
// Bytes of workspace linear_gelu_epilogue_backward_cpu needs for per-chunk partial dbias sums.
size_t linear_gelu_epilogue_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype);
// dy, pre, dpre: rows x cols (dpre may alias dy). dbias: cols or nullptr; when given it is fully
// written (zeros for rows == 0) and does not depend on how parallel_for splits the work.
void linear_gelu_epilogue_backward_cpu(const void* dy, const void* pre, void* dpre, void* dbias,
                            void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                            DType dtype, const ParallelFor& parallel_for);

// CUDA: the same contract on device pointers, launched on `stream` of the current device, for
// float32/float16/bfloat16. 16-byte vectors when cols and the pointers allow it. The forward's
// pre may also be nullptr (not written), and then y may alias h: y = gelu(h + bias) in place.
void linear_gelu_epilogue_forward_cuda(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                            int64_t cols, GeluApprox approx, DType dtype, cudaStream_t stream);
size_t linear_gelu_epilogue_backward_workspace_size_cuda(int64_t rows, int64_t cols, DType dtype);
void linear_gelu_epilogue_backward_cuda(const void* dy, const void* pre, void* dpre, void* dbias,
                             void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                             DType dtype, cudaStream_t stream);

}  // namespace fusedlayers
