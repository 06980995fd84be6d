// ReLU followed by a constant scale, y = max(x, 0) * alpha, and its gradient.
//
// Semantics follow the unfused `torch.relu(x) * alpha` bit for bit: the product is taken in the
// accumulation type (fp32, fp64 for fp64) with alpha rounded to it, then rounded to the output
// dtype; NaN inputs stay NaN; the gradient is dy * alpha where x is not <= 0 (so NaN lets the
// gradient through, as torch's threshold_backward does) and 0 elsewhere.
#pragma once

#include "common.h"

namespace fusedlayers {

// x, y: n elements of `dtype`, contiguous. y may alias x.
void relu_scale_forward_cpu(const void* x, void* y, int64_t n, double alpha, DType dtype,
                            const ParallelFor& parallel_for);

// dy, x, dx: n elements of `dtype`, contiguous. dx may alias dy.
void relu_scale_backward_cpu(const void* dy, const void* x, void* dx, int64_t n, double alpha,
                             DType dtype, const ParallelFor& parallel_for);

// CUDA: the same contract on device pointers, launched on `stream` of the current device.
// 16-byte vector accesses when x, y (and dy, dx) are 16-byte aligned; 64-bit indexing.
void relu_scale_forward_cuda(const void* x, void* y, int64_t n, double alpha, DType dtype,
                             cudaStream_t stream);
void relu_scale_backward_cuda(const void* dy, const void* x, void* dx, int64_t n, double alpha,
                              DType dtype, cudaStream_t stream);

}  // namespace fusedlayers
