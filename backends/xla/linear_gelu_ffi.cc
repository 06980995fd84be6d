// XLA FFI handlers fusedlayers_linear_gelu_{forward,backward}: linear_gelu's bias + GELU epilogue
// (csrc/gemm/linear_gelu_epilogue.h) on the output of XLA's own dot, and its gradient with dbias; the
// dgrad and wgrad dots are XLA's (fusedlayers/jax/linear_gelu.py). The forward writes the
// pre-activation only when with_pre (its result is then like h, else empty and y is written as
// pre, which the epilogue allows).
#include "backends/xla/ffi_binding.h"
#include "gemm/linear_gelu.h"
#include "gemm/linear_gelu_epilogue.h"

namespace fusedlayers::xla_binding {
namespace {

ffi::Error forward(Device& device, AnyBuffer h, AnyBuffer bias, Out pre, Out y, bool has_bias,
                   std::string_view approximate, bool with_pre) {
  return call_csrc([&] {
    LinearGeluEpilogueForward a{ref(h), ref(bias, has_bias),
                                parse_gelu_approx("linear_gelu", std::string(approximate)),
                                with_pre ? data(pre) : data(y), data(y)};
    const RowsCols rc = linear_gelu_epilogue_forward_check("linear_gelu", a);
    linear_gelu_epilogue_forward(a, rc, device.exec());
  });
}

ffi::Error backward(Device& device, AnyBuffer dy, AnyBuffer pre, Out dpre, Out dbias,
                    Out workspace, bool has_bias, std::string_view approximate) {
  return call_csrc([&] {
    LinearGeluEpilogueBackward a{ref(dy), ref(pre), has_bias,
                                 parse_gelu_approx("linear_gelu_backward", std::string(approximate)),
                                 data(dpre), data(dbias)};
    run_with_workspace(
        device, a, workspace,
        [](const auto& args) {
          return linear_gelu_epilogue_backward_check("linear_gelu_backward", args);
        },
        linear_gelu_epilogue_backward_workspace_size, linear_gelu_epilogue_backward);
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Attr<bool>("has_bias")
      .template Attr<std::string_view>("approximate").template Attr<bool>("with_pre");
};
const auto kBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<bool>("has_bias")
      .template Attr<std::string_view>("approximate");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_OP(linear_gelu);

// The whole op's argument checks for a trace (ffi_binding.h, TracedTensor): weight with csrc's
// (out_features, in_features) sizes, whatever its layout.
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_linear_gelu_check(
    const fusedlayers::xla_binding::TracedTensor* x,
    const fusedlayers::xla_binding::TracedTensor* weight,
    const fusedlayers::xla_binding::TracedTensor* bias, const char* approximate, char* msg,
    size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    parse_gelu_approx("linear_gelu", approximate);
    linear_gelu_forward_check({ref(x), ref(weight), WeightLayout::kOutIn, ref(bias)});
  }, msg, msg_size);
}
