// ReLU followed by a constant scale, y = max(x, 0) * alpha, and its gradient.
//
// Semantics follow the unfused `torch.relu(x) * alpha` bit for bit: the product is taken in the
// accumulation type (fp32, fp64 for fp64) with alpha rounded to it, then rounded to the output
// dtype; NaN inputs stay NaN; the gradient is dy * alpha where x is not <= 0 (so NaN lets the
// gradient through, as torch's threshold_backward does) and 0 elsewhere.
//
// The gradient needs only one bit of x, so the forward can save a bitmask for the backward instead
// of x: forward + backward then move 16.25 bytes per float32 element instead of 20 (8.25 instead
// of 10 for 16-bit types), and the saved activation is 32x (16x) smaller.
// Mask layout: relu_scale_mask_words(n) 32-bit words; bit i % 32 of word i / 32 is set where x[i]
// is not <= 0; the bits past n are 0. In bytes on a little-endian host it is
// numpy.packbits(x > 0 | isnan(x), bitorder='little'), zero-padded to whole words.
#pragma once

#include "util/common.h"

namespace fusedlayers {

inline int64_t relu_scale_mask_words(int64_t n) { return (n + 31) / 32; }

// The op's contract, for every binding: alpha finite; the mask of the backward holds
// relu_scale_mask_words(n) words for dy's n elements. Errors: Error of kind kValue. Tensors
// are contiguous; the bindings allocate the outputs (like x / dy, and the mask).
struct ReluScaleForward {
  TensorRef x;
  double alpha = 1.0;
  void* y = nullptr;       // may alias x.data
  uint32_t* mask = nullptr;  // relu_scale_mask_words(n) words, written when not null
};

struct ReluScaleBackward {
  TensorRef dy;
  const uint32_t* mask = nullptr;  // as the forward wrote it
  Sizes mask_sizes;
  double alpha = 1.0;
  void* dx = nullptr;  // may alias dy.data
};

void relu_scale_forward_check(const ReluScaleForward& a);
void relu_scale_backward_check(const ReluScaleBackward& a);
// Run the pass on exec's device; a must have passed its check.
void relu_scale_forward(const ReluScaleForward& a, const Exec& exec);
void relu_scale_backward(const ReluScaleBackward& a, const Exec& exec);

// The kernels. x, y: n elements of `dtype`; y may alias x. mask: written when not null.
void relu_scale_forward_cpu(const void* x, void* y, uint32_t* mask, int64_t n, double alpha,
                            DType dtype, const ParallelFor& parallel_for);
void relu_scale_backward_cpu(const void* dy, const uint32_t* mask, void* dx, int64_t n,
                             double alpha, DType dtype, const ParallelFor& parallel_for);
// CUDA: the same on device pointers, launched on `stream` of the current device. 16-byte vector
// accesses when x, y (and dy, dx) are 16-byte aligned; 64-bit indexing.
void relu_scale_forward_cuda(const void* x, void* y, uint32_t* mask, int64_t n, double alpha,
                             DType dtype, cudaStream_t stream);
void relu_scale_backward_cuda(const void* dy, const uint32_t* mask, void* dx, int64_t n,
                              double alpha, DType dtype, cudaStream_t stream);

}  // namespace fusedlayers
