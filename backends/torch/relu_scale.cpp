// fusedlayers::relu_scale{,_with_mask,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor
// conversion around csrc/relu_scale.h, which checks the arguments) and autograd. No autocast
// kernel: the autocast keys fall through, so relu_scale runs in its input's dtype, as relu does.
#include "backends/torch/autograd.h"
#include "backends/torch/binding.h"
#include "csrc/relu_scale.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

// y, and the packed mask when save_mask (else an undefined tensor).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, double alpha, bool save_mask) {
  check_floating("relu_scale", "x", x);
  const at::Tensor xc = x.contiguous();
  ReluScaleForward a{ref(xc), alpha};
  call_csrc([&] { relu_scale_forward_check(a); });
  at::Tensor y = at::empty_like(xc);
  at::Tensor mask;
  if (save_mask) {
    mask = at::empty({relu_scale_mask_words(xc.numel())}, xc.options().dtype(at::kInt));
    a.mask = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  }
  a.out = y.data_ptr();
  const c10::OptionalDeviceGuard guard(xc.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { relu_scale_forward(a, exec_for(xc)); });
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
  const char* op = "relu_scale_backward";
  check_floating(op, "grad_out", grad_out);
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kInt, "fusedlayers.", op,
                   ": mask must be int32 (packed bits), got ", mask.scalar_type());
  check_same_device(op, "mask", mask, "grad_out", grad_out);
  const at::Tensor dy = grad_out.contiguous(), m = mask.contiguous();
  ReluScaleBackward a{ref(dy), reinterpret_cast<const uint32_t*>(m.data_ptr<int32_t>()),
                      sizes(m.sizes()), alpha};
  call_csrc([&] { relu_scale_backward_check(a); });
  at::Tensor dx = at::empty_like(dy);
  a.grad_input = dx.data_ptr();
  const c10::OptionalDeviceGuard guard(dy.device());
  call_csrc([&] { relu_scale_backward(a, exec_for(dy)); });
  return dx;
}

// relu_scale saves the packed sign mask, not x: 1 bit per element (csrc/relu_scale.h).
struct ReluScaleBackward final : Node {
  SavedVariable mask;
  double alpha = 0;

  variable_list apply(variable_list&& grads) override {
    static const auto bwd =
        op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("relu_scale_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor m = mask.unpack();
    BackwardGuard guard;
    return {bwd.call(grads[0], m, alpha)};
  }
  void release_variables() override { mask.reset_data(); }
  std::string name() const override { return "fusedlayers::ReluScaleBackward"; }
};

// Without a backward to feed, the plain forward: no mask is written and no Node is made.
at::Tensor relu_scale_autograd(const at::Tensor& x, double alpha) {
  if (!needs_grad({&x})) {
    static const auto fwd = op<at::Tensor(const at::Tensor&, double)>("relu_scale");
    at::AutoDispatchBelowADInplaceOrView below;
    return fwd.call(x, alpha);
  }
  static const auto fwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double)>(
      "relu_scale_with_mask");
  auto node = make_node<ReluScaleBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  at::Tensor y, mask;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::tie(y, mask) = fwd.call(x, alpha);
  }
  torch::autograd::set_history(y, node);
  node->mask = SavedVariable(mask, false);
  node->alpha = alpha;
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  m.def("relu_scale(Tensor x, float alpha) -> Tensor");
  // mask: int32 words of packed bits, where x is not <= 0 (layout in csrc/relu_scale.h).
  m.def("relu_scale_with_mask(Tensor x, float alpha) -> (Tensor out, Tensor mask)");
  m.def("relu_scale_backward(Tensor grad_out, Tensor mask, float alpha) -> Tensor");
}

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

TORCH_LIBRARY_IMPL(fusedlayers, Autograd, m) {
  m.impl("relu_scale", &relu_scale_autograd);
  register_backward_autograd(m, "relu_scale_backward");
}

}  // namespace torch_binding
}  // namespace fusedlayers
