// The epilogue of a linear layer followed by GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415):
//
//   pre = h + bias            (h = x @ W^T, computed by the framework's GEMM)
//   y   = gelu(pre)
//   erf  form ('none'): gelu(u) = u/2 * (1 + erf(u / sqrt(2)))
//   tanh form ('tanh'): gelu(u) = u/2 * (1 + tanh(sqrt(2/pi) * (u + 0.044715 u^3)))
//
// Backward: dpre = dy * gelu'(pre), dbias = sum_rows dpre; the GEMMs for dgrad and wgrad are the
// framework's. All math in float32 (float64 for float64) with one rounding to the output dtype.
#pragma once

#include <cstddef>

#include "common.h"

namespace fusedlayers {

enum class GeluApprox { kNone, kTanh };

// h: rows x cols of `dtype`, bias: cols or nullptr. Writes pre (may alias h) and y = gelu(pre).
// pre is rounded to `dtype` and y computed from the rounded value, as the unfused layer does.
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
