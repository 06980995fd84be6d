// PyTorch CPU and CUDA implementation of fusedlayers::relu_scale{,_with_mask,_backward}: checks,
// allocation, csrc call.
#include "backends/torch/binding.h"
#include "csrc/relu_scale.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

// y, and the packed mask when save_mask (else an undefined tensor).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, double alpha, bool save_mask) {
  check_floating("relu_scale", "x", x);
  check_finite("relu_scale", "alpha", alpha);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  at::Tensor mask;
  uint32_t* mask_ptr = nullptr;
  if (save_mask) {
    mask = at::empty({relu_scale_mask_words(xc.numel())}, xc.options().dtype(at::kInt));
    mask_ptr = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  }
  const DType dtype = to_dtype(xc.scalar_type());
#ifdef FUSEDLAYERS_WITH_CUDA
  if (xc.is_cuda()) {
    const c10::cuda::CUDAGuard guard(xc.device());
    call_csrc([&] {
      relu_scale_forward_cuda(xc.data_ptr(), y.data_ptr(), mask_ptr, xc.numel(), alpha, dtype,
                              current_stream());
    });
    return {y, mask};
  }
#endif
  call_csrc([&] {
    relu_scale_forward_cpu(xc.data_ptr(), y.data_ptr(), mask_ptr, xc.numel(), alpha, dtype,
                           aten_parallel_for());
  });
  return {y, mask};
}

at::Tensor relu_scale_op(const at::Tensor& x, double alpha) {
  return std::get<0>(forward(x, alpha, false));
}

std::tuple<at::Tensor, at::Tensor> relu_scale_with_mask_op(const at::Tensor& x, double alpha) {
  return forward(x, alpha, true);
}

at::Tensor relu_scale_backward_op(const at::Tensor& grad_out, const at::Tensor& mask,
                                   double alpha) {
  check_floating("relu_scale_backward", "grad_out", grad_out);
  check_finite("relu_scale_backward", "alpha", alpha);
  const int64_t words = relu_scale_mask_words(grad_out.numel());
  TORCH_CHECK_VALUE(mask.dim() == 1 && mask.numel() == words && mask.scalar_type() == at::kInt,
                    "fusedlayers.relu_scale_backward: mask must be int32 of shape [", words,
                    "] for grad_out of ", grad_out.numel(), " elements, got ", mask.scalar_type(),
                    " of shape ", mask.sizes());
  check_same_device("relu_scale_backward", "mask", mask, "grad_out", grad_out);
  const at::Tensor dyc = grad_out.contiguous();
  const at::Tensor mc = mask.contiguous();
  const auto* mask_ptr = reinterpret_cast<const uint32_t*>(mc.data_ptr<int32_t>());
  at::Tensor dx = at::empty_like(dyc);
  const DType dtype = to_dtype(dyc.scalar_type());
#ifdef FUSEDLAYERS_WITH_CUDA
  if (dyc.is_cuda()) {
    const c10::cuda::CUDAGuard guard(dyc.device());
    call_csrc([&] {
      relu_scale_backward_cuda(dyc.data_ptr(), mask_ptr, dx.data_ptr(), dyc.numel(), alpha,
                               dtype, current_stream());
    });
    return dx;
  }
#endif
  call_csrc([&] {
    relu_scale_backward_cpu(dyc.data_ptr(), mask_ptr, dx.data_ptr(), dyc.numel(), alpha, dtype,
                            aten_parallel_for());
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedlayers, CPU, m) {
  m.impl("relu_scale", &relu_scale_op);
  m.impl("relu_scale_with_mask", &relu_scale_with_mask_op);
  m.impl("relu_scale_backward", &relu_scale_backward_op);
}

#ifdef FUSEDLAYERS_WITH_CUDA
TORCH_LIBRARY_IMPL(fusedlayers, CUDA, m) {
  m.impl("relu_scale", &relu_scale_op);
  m.impl("relu_scale_with_mask", &relu_scale_with_mask_op);
  m.impl("relu_scale_backward", &relu_scale_backward_op);
}
#endif

}  // namespace torch_binding
}  // namespace fusedlayers
