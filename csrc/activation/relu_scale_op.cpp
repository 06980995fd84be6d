// The ReLU*scale op: argument checks, then the kernels (contract: relu_scale.h).
#include <cmath>

#include "activation/relu_scale.h"

namespace fusedlayers {
namespace {

void check_alpha(const char* op, double alpha) {
  if (!std::isfinite(alpha)) arg_error(op, "alpha must be finite, got " + format_number(alpha));
}

}  // namespace

void relu_scale_forward_check(const ReluScaleForward& a) { check_alpha("relu_scale", a.alpha); }

void relu_scale_backward_check(const ReluScaleBackward& a) {
  const char* op = "relu_scale_backward";
  check_alpha(op, a.alpha);
  const int64_t n = a.dy.sizes.numel();
  const int64_t words = relu_scale_mask_words(n);
  if (a.mask_sizes.size != 1 || a.mask_sizes[0] != words)
    arg_error(op, "mask must have shape [" + std::to_string(words) + "] for dy of " +
                      std::to_string(n) + " elements, got " + a.mask_sizes.str());
}

void relu_scale_forward(const ReluScaleForward& a, const Exec& exec) {
  const int64_t n = a.x.sizes.numel();
  FUSEDLAYERS_ON_DEVICE(
      exec,
      relu_scale_forward_cpu(a.x.data, a.y, a.mask, n, a.alpha, a.x.dtype, exec.parallel_for),
      relu_scale_forward_cuda(a.x.data, a.y, a.mask, n, a.alpha, a.x.dtype, exec.stream));
}

void relu_scale_backward(const ReluScaleBackward& a, const Exec& exec) {
  const TensorRef& dy = a.dy;
  const int64_t n = dy.sizes.numel();
  FUSEDLAYERS_ON_DEVICE(exec,
                        relu_scale_backward_cpu(dy.data, a.mask, a.dx, n, a.alpha,
                                                dy.dtype, exec.parallel_for),
                        relu_scale_backward_cuda(dy.data, a.mask, a.dx, n, a.alpha,
                                                 dy.dtype, exec.stream));
}

}  // namespace fusedlayers
