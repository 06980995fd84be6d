// PyTorch CPU and CUDA implementation of fusedlayers::relu_scale{,_backward}: checks, allocation,
// csrc call.
#include "backends/torch/binding.h"
#include "csrc/relu_scale.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

at::Tensor relu_scale_op(const at::Tensor& x, double alpha) {
  check_floating("relu_scale", "x", x);
  check_finite("relu_scale", "alpha", alpha);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const DType dtype = to_dtype(xc.scalar_type());
#ifdef FUSEDLAYERS_WITH_CUDA
  if (xc.is_cuda()) {
    const c10::cuda::CUDAGuard guard(xc.device());
    call_csrc([&] {
      relu_scale_forward_cuda(xc.data_ptr(), y.data_ptr(), xc.numel(), alpha, dtype,
                              current_stream());
    });
    return y;
  }
#endif
  call_csrc([&] {
    relu_scale_forward_cpu(xc.data_ptr(), y.data_ptr(), xc.numel(), alpha, dtype,
                           aten_parallel_for());
  });
  return y;
}

at::Tensor relu_scale_backward_op(const at::Tensor& grad_out, const at::Tensor& x,
                                   double alpha) {
  check_floating("relu_scale_backward", "x", x);
  check_finite("relu_scale_backward", "alpha", alpha);
  TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(),
                    "fusedlayers.relu_scale_backward: grad_out must match x (", x.sizes(), ", ",
                    x.scalar_type(), "), got ", grad_out.sizes(), ", ", grad_out.scalar_type());
  check_same_device("relu_scale_backward", "grad_out", grad_out, "x", x);
  const at::Tensor dyc = grad_out.contiguous();
  const at::Tensor xc = x.contiguous();
  at::Tensor dx = at::empty_like(xc);
#ifdef FUSEDLAYERS_WITH_CUDA
  if (xc.is_cuda()) {
    const c10::cuda::CUDAGuard guard(xc.device());
    call_csrc([&] {
      relu_scale_backward_cuda(dyc.data_ptr(), xc.data_ptr(), dx.data_ptr(), xc.numel(), alpha,
                               to_dtype(xc.scalar_type()), current_stream());
    });
    return dx;
  }
#endif
  call_csrc([&] {
    relu_scale_backward_cpu(dyc.data_ptr(), xc.data_ptr(), dx.data_ptr(),
                            xc.numel(), alpha, to_dtype(xc.scalar_type()),
                            aten_parallel_for());
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedlayers, CPU, m) {
  m.impl("relu_scale", &relu_scale_op);
  m.impl("relu_scale_backward", &relu_scale_backward_op);
}

#ifdef FUSEDLAYERS_WITH_CUDA
TORCH_LIBRARY_IMPL(fusedlayers, CUDA, m) {
  m.impl("relu_scale", &relu_scale_op);
  m.impl("relu_scale_backward", &relu_scale_backward_op);
}
#endif

}  // namespace torch_binding
}  // namespace fusedlayers
