// XLA FFI handlers fusedlayers_{swiglu,geglu}_{forward,backward} on csrc/activation/gated.h, which checks
// the arguments. XLA's buffers are contiguous: gate and up are read as they are. geglu's
// `approximate` is a string attribute ('none' or 'tanh').
#include "backends/xla/ffi_binding.h"
#include "activation/gated.h"

namespace fusedlayers::xla_binding {
namespace {

void run_forward(Device& device, const char* op, GatedActivation act, AnyBuffer gate,
                 AnyBuffer up, Out y) {
  GatedForward a{{ref(gate)}, {ref(up)}, act, data(y)};
  const RowsCols rc = gated_forward_check(op, a);
  gated_forward(a, rc, device.exec());
}

void run_backward(Device& device, const char* op, GatedActivation act, AnyBuffer dy,
                  AnyBuffer gate, AnyBuffer up, Out dgate, Out dup) {
  GatedBackward a{ref(dy), {ref(gate)}, {ref(up)}, act, data(dgate), data(dup)};
  const RowsCols rc = gated_backward_check(op, a);
  gated_backward(a, rc, device.exec());
}

ffi::Error swiglu_forward(Device& device, AnyBuffer gate, AnyBuffer up, Out y) {
  return call_csrc([&] { run_forward(device, "swiglu", GatedActivation::kSilu, gate, up, y); });
}

ffi::Error swiglu_backward(Device& device, AnyBuffer dy, AnyBuffer gate, AnyBuffer up,
                           Out dgate, Out dup) {
  return call_csrc([&] {
    run_backward(device, "swiglu_backward", GatedActivation::kSilu, dy, gate, up, dgate, dup);
  });
}

ffi::Error geglu_forward(Device& device, AnyBuffer gate, AnyBuffer up, Out y,
                         std::string_view approximate) {
  return call_csrc([&] {
    run_forward(device, "geglu", geglu_activation("geglu", std::string(approximate)), gate, up,
                y);
  });
}

ffi::Error geglu_backward(Device& device, AnyBuffer dy, AnyBuffer gate, AnyBuffer up, Out dgate,
                          Out dup, std::string_view approximate) {
  return call_csrc([&] {
    const char* op = "geglu_backward";
    run_backward(device, op, geglu_activation(op, std::string(approximate)), dy, gate, up, dgate,
                 dup);
  });
}

const auto kSwigluForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>();
};
const auto kSwigluBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>();
};
const auto kGegluForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<std::string_view>("approximate");
};
const auto kGegluBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<std::string_view>("approximate");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_HANDLERS(swiglu_forward, ::fusedlayers::xla_binding::swiglu_forward,
                         ::fusedlayers::xla_binding::kSwigluForwardSig);
FUSEDLAYERS_XLA_HANDLERS(swiglu_backward, ::fusedlayers::xla_binding::swiglu_backward,
                         ::fusedlayers::xla_binding::kSwigluBackwardSig);
FUSEDLAYERS_XLA_HANDLERS(geglu_forward, ::fusedlayers::xla_binding::geglu_forward,
                         ::fusedlayers::xla_binding::kGegluForwardSig);
FUSEDLAYERS_XLA_HANDLERS(geglu_backward, ::fusedlayers::xla_binding::geglu_backward,
                         ::fusedlayers::xla_binding::kGegluBackwardSig);

// The forwards' argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_swiglu_check(
    const fusedlayers::xla_binding::TracedTensor* gate,
    const fusedlayers::xla_binding::TracedTensor* up, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] { gated_forward_check("swiglu", {{ref(gate)}, {ref(up)}}); }, msg,
                         msg_size);
}

FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_geglu_check(
    const fusedlayers::xla_binding::TracedTensor* gate,
    const fusedlayers::xla_binding::TracedTensor* up, const char* approximate, char* msg,
    size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    gated_forward_check("geglu", {{ref(gate)}, {ref(up)}, geglu_activation("geglu", approximate)});
  }, msg, msg_size);
}
