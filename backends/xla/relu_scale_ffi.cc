// XLA FFI handlers fusedlayers_relu_scale_{forward,backward} on csrc/activation/relu_scale.h, which checks
// the arguments. The forward writes the packed mask (uint32 words) when with_mask; its result is
// then relu_scale_mask_words(n) words, else empty.
#include "backends/xla/ffi_binding.h"
#include "activation/relu_scale.h"

namespace fusedlayers::xla_binding {
namespace {

ffi::Error forward(Device& device, AnyBuffer x, Out y, Out mask, float alpha, bool with_mask) {
  return call_csrc([&] {
    ReluScaleForward a{ref(x), alpha, data(y),
                       with_mask ? static_cast<uint32_t*>(data(mask)) : nullptr};
    relu_scale_forward_check(a);
    relu_scale_forward(a, device.exec());
  });
}

ffi::Error backward(Device& device, AnyBuffer dy, AnyBuffer mask, Out dx, float alpha) {
  return call_csrc([&] {
    ReluScaleBackward a{ref(dy), static_cast<const uint32_t*>(mask.untyped_data()),
                        sizes(mask.dimensions()), alpha, data(dx)};
    relu_scale_backward_check(a);
    relu_scale_backward(a, device.exec());
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<float>("alpha").template Attr<bool>("with_mask");
};
const auto kBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<float>("alpha");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_OP(relu_scale);

// The forward's argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_relu_scale_check(
    const fusedlayers::xla_binding::TracedTensor* x, float alpha, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] { relu_scale_forward_check({ref(x), alpha}); }, msg, msg_size);
}
