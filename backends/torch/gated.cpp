// fusedlayers::swiglu and fusedlayers::geglu (and their _backward) for PyTorch: schemas, CPU/CUDA
// kernels (tensor conversion around csrc/activation/gated.h, which checks the arguments), autograd (saves
// gate and up; the backward recomputes the activation) and autocast (as ATen's for mul: mixed
// dtypes are promoted).
#include "backends/torch/autograd.h"
#include "backends/torch/gated_binding.h"

namespace fusedlayers::torch_binding {
namespace {

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, c10::string_view);
using SwigluSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using SwigluBackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&);

// The two public ops: their names, their activation (geglu's from `approximate`) and calls of
// their operators (swiglu has no approximate argument).
struct Swiglu {
  static constexpr const char* kName = "swiglu";
  static constexpr const char* kBackward = "swiglu_backward";
  static constexpr const char* kNode = "fusedlayers::SwigluBackwardNode";
  static GatedActivation activation(const char*, c10::string_view) {
    return GatedActivation::kSilu;
  }
  static at::Tensor forward(const at::Tensor& gate, const at::Tensor& up, c10::string_view) {
    static const auto handle = op<SwigluSig>(kName);
    return handle.call(gate, up);
  }
  static std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& dy, const at::Tensor& gate,
                                                     const at::Tensor& up, c10::string_view) {
    static const auto handle = op<SwigluBackwardSig>(kBackward);
    return handle.call(dy, gate, up);
  }
};
struct Geglu {
  static constexpr const char* kName = "geglu";
  static constexpr const char* kBackward = "geglu_backward";
  static constexpr const char* kNode = "fusedlayers::GegluBackwardNode";
  static GatedActivation activation(const char* op, c10::string_view approximate) {
    return call_csrc([&] { return geglu_activation(op, std::string(approximate)); });
  }
  static at::Tensor forward(const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view approximate) {
    static const auto handle = op<ForwardSig>(kName);
    return handle.call(gate, up, approximate);
  }
  static std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& dy, const at::Tensor& gate,
                                                     const at::Tensor& up,
                                                     c10::string_view approximate) {
    static const auto handle = op<BackwardSig>(kBackward);
    return handle.call(dy, gate, up, approximate);
  }
};

template <typename Op>
at::Tensor forward_kernel(const at::Tensor& gate, const at::Tensor& up,
                          c10::string_view approximate) {
  check_gated_args(Op::kName, gate, up);
  at::Tensor g, u;
  GatedForward a{gated_input(gate, g), gated_input(up, u), Op::activation(Op::kName, approximate)};
  const RowsCols rc = call_csrc([&] { return gated_forward_check(Op::kName, a); });
  at::Tensor y = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  a.y = y.data_ptr();
  const c10::OptionalDeviceGuard guard(gate.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { gated_forward(a, rc, exec_for(gate)); });
  return y;
}

template <typename Op>
std::tuple<at::Tensor, at::Tensor> backward_kernel(const at::Tensor& dy_in, const at::Tensor& gate,
                                                   const at::Tensor& up,
                                                   c10::string_view approximate) {
  const char* op = Op::kBackward;
  check_gated_backward_args(op, dy_in, gate, up);
  const at::Tensor dy = dy_in.contiguous();
  at::Tensor g, u;
  GatedBackward a{ref(dy), gated_input(gate, g), gated_input(up, u),
                  Op::activation(op, approximate)};
  const RowsCols rc = call_csrc([&] { return gated_backward_check(op, a); });
  const auto options = gate.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dgate = at::empty(gate.sizes(), options), dup = at::empty(gate.sizes(), options);
  a.dgate = dgate.data_ptr();
  a.dup = dup.data_ptr();
  const c10::OptionalDeviceGuard guard(dy.device());
  call_csrc([&] { gated_backward(a, rc, exec_for(dy)); });
  return {dgate, dup};
}

// Saves gate and up as they came (views stay views): the backward recomputes the activation.
template <typename Op>
struct GatedBackwardNode final : SavingNode<GatedBackwardNode<Op>> {
  static constexpr const char* kName = Op::kNode;
  SavedVariable gate, up;
  std::string approximate;

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(this->mutex_);
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor g = gate.unpack(), u = up.unpack();
    BackwardGuard guard;
    auto [dgate, dup] = Op::backward(grads[0], g, u, approximate);
    return {dgate, dup};
  }
  auto saved_variables() { return std::array{&gate, &up}; }
};

template <typename Op>
at::Tensor autograd_kernel(const at::Tensor& gate, const at::Tensor& up,
                           c10::string_view approximate) {
  if (!needs_grad({&gate, &up}))
    return below_autograd([&] { return Op::forward(gate, up, approximate); });
  auto node = make_node<GatedBackwardNode<Op>>();
  node->set_next_edges(torch::autograd::collect_next_edges(gate, up));
  at::Tensor y = below_autograd([&] { return Op::forward(gate, up, approximate); });
  torch::autograd::set_history(y, node);
  node->gate = SavedVariable(gate, false);
  node->up = SavedVariable(up, false);
  node->approximate = std::string(approximate);
  return y;
}

// Autocast as ATen's for mul (its "promote" list): gate and up of different floating dtypes run
// in the wider one.
template <typename Op, c10::DeviceType Device>
at::Tensor autocast_kernel(const at::Tensor& gate, const at::Tensor& up,
                           c10::string_view approximate) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(Device));
  if (gate.scalar_type() == up.scalar_type() || !gate.is_floating_point() ||
      !up.is_floating_point())
    return Op::forward(gate, up, approximate);
  const auto dtype = at::promote_types(gate.scalar_type(), up.scalar_type());
  return Op::forward(gate.to(dtype), up.to(dtype), approximate);
}

// swiglu has no approximate argument: its kernels take the shared signature through these.
at::Tensor swiglu_kernel(const at::Tensor& gate, const at::Tensor& up) {
  return forward_kernel<Swiglu>(gate, up, "none");
}
std::tuple<at::Tensor, at::Tensor> swiglu_backward_kernel(const at::Tensor& dy,
                                                          const at::Tensor& gate,
                                                          const at::Tensor& up) {
  return backward_kernel<Swiglu>(dy, gate, up, "none");
}
at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return autograd_kernel<Swiglu>(gate, up, "none");
}
template <c10::DeviceType Device>
at::Tensor swiglu_autocast(const at::Tensor& gate, const at::Tensor& up) {
  return autocast_kernel<Swiglu, Device>(gate, up, "none");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // gate and up: one shape and dtype, any layout (evenly spaced rows with a contiguous last dim,
  // as chunk(2, -1) halves, are read in place); the results are contiguous.
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor dy, Tensor gate, Tensor up) -> (Tensor dgate, Tensor dup)");
  m.def("geglu(Tensor gate, Tensor up, str approximate='none') -> Tensor");
  m.def(
      "geglu_backward(Tensor dy, Tensor gate, Tensor up, str approximate) "
      "-> (Tensor dgate, Tensor dup)");
  impl_op(m, "swiglu", &swiglu_kernel, &swiglu_backward_kernel, &swiglu_autograd);
  impl_op(m, "geglu", &forward_kernel<Geglu>, &backward_kernel<Geglu>, &autograd_kernel<Geglu>);
  impl_key(m, c10::DispatchKey::AutocastCPU, "swiglu", &swiglu_autocast<c10::DeviceType::CPU>);
  impl_key(m, c10::DispatchKey::AutocastCUDA, "swiglu", &swiglu_autocast<c10::DeviceType::CUDA>);
  impl_key(m, c10::DispatchKey::AutocastCPU, "geglu",
           &autocast_kernel<Geglu, c10::DeviceType::CPU>);
  impl_key(m, c10::DispatchKey::AutocastCUDA, "geglu",
           &autocast_kernel<Geglu, c10::DeviceType::CUDA>);
}

}  // namespace fusedlayers::torch_binding
