// fusedlayers::relu_scale{,_with_mask,_backward} for PyTorch: schema, CPU/CUDA kernel (tensor
// conversion around csrc/activation/relu_scale.h, which checks the arguments) and autograd. No autocast
// kernel: the autocast keys fall through, so relu_scale runs in its input's dtype, as relu does.
#include "backends/torch/autograd.h"
#include "backends/torch/torch_binding.h"
#include "activation/relu_scale.h"

namespace fusedlayers::torch_binding {
namespace {

using ForwardSig = at::Tensor(const at::Tensor&, double);
using WithMaskSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double);
using BackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);

// y, and the packed mask when with_mask (else an undefined tensor).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x_in, double alpha, bool with_mask) {
  check_tensors("relu_scale", "x", x_in, {});
  const at::Tensor x = x_in.contiguous();
  ReluScaleForward a{ref(x), alpha};
  call_csrc([&] { relu_scale_forward_check(a); });
  at::Tensor y = at::empty_like(x);
  at::Tensor mask;
  if (with_mask) {
    mask = at::empty({relu_scale_mask_words(x.numel())}, x.options().dtype(at::kUInt32));
    a.mask = static_cast<uint32_t*>(mask.data_ptr());
  }
  a.y = y.data_ptr();
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { relu_scale_forward(a, exec_for(x)); });
  return {y, mask};
}

at::Tensor forward_kernel(const at::Tensor& x, double alpha) {
  return std::get<0>(forward(x, alpha, false));
}

std::tuple<at::Tensor, at::Tensor> with_mask_kernel(const at::Tensor& x, double alpha) {
  return forward(x, alpha, true);
}

at::Tensor backward_kernel(const at::Tensor& dy_in, const at::Tensor& mask_in, double alpha) {
  const char* op = "relu_scale_backward";
  check_tensors(op, "dy", dy_in, {});
  TORCH_CHECK_TYPE(mask_in.scalar_type() == at::kUInt32, "fusedlayers.", op,
                   ": mask must be uint32 (packed bits), got ", mask_in.scalar_type());
  check_same_device(op, "mask", mask_in, "dy", dy_in);
  const at::Tensor dy = dy_in.contiguous(), mask = mask_in.contiguous();
  ReluScaleBackward a{ref(dy), static_cast<const uint32_t*>(mask.data_ptr()),
                      sizes(mask.sizes()), alpha};
  call_csrc([&] { relu_scale_backward_check(a); });
  at::Tensor dx = at::empty_like(dy);
  a.dx = dx.data_ptr();
  const c10::OptionalDeviceGuard guard(dy.device());
  call_csrc([&] { relu_scale_backward(a, exec_for(dy)); });
  return dx;
}

// Saves the packed sign mask, not x: 1 bit per element (csrc/activation/relu_scale.h).
struct ReluScaleBackwardNode final : SavingNode<ReluScaleBackwardNode> {
  static constexpr const char* kName = "fusedlayers::ReluScaleBackwardNode";
  SavedVariable mask;
  double alpha = 0;

  variable_list apply(variable_list&& grads) override {
    static const auto backward = op<BackwardSig>("relu_scale_backward");
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor m = mask.unpack();
    BackwardGuard guard;
    return {backward.call(grads[0], m, alpha)};
  }
  auto saved_variables() { return std::array{&mask}; }
};

// Without a backward to feed, the plain forward: no mask is written and no Node is made.
at::Tensor autograd_kernel(const at::Tensor& x, double alpha) {
  if (!needs_grad({&x})) {
    static const auto forward = op<ForwardSig>("relu_scale");
    return below_autograd([&] { return forward.call(x, alpha); });
  }
  static const auto forward = op<WithMaskSig>("relu_scale_with_mask");
  auto node = make_node<ReluScaleBackwardNode>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  auto [y, mask] = below_autograd([&] { return forward.call(x, alpha); });
  torch::autograd::set_history(y, node);
  node->mask = SavedVariable(mask, false);
  node->alpha = alpha;
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // mask: uint32 words of packed bits, where x is not <= 0 (layout in csrc/activation/relu_scale.h).
  m.def("relu_scale(Tensor x, float alpha) -> Tensor");
  m.def("relu_scale_with_mask(Tensor x, float alpha) -> (Tensor y, Tensor mask)");
  m.def("relu_scale_backward(Tensor dy, Tensor mask, float alpha) -> Tensor");
  impl_op(m, "relu_scale", &forward_kernel, &backward_kernel, &autograd_kernel);
  impl_devices(m, "relu_scale_with_mask", &with_mask_kernel);
}

}  // namespace fusedlayers::torch_binding
