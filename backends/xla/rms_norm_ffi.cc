// XLA FFI handlers fusedlayers_rms_norm_{forward,backward} on csrc/norm/rms_norm.h, which checks every
// argument. weight is always an operand and counts only when has_weight.
#include "backends/xla/ffi_binding.h"
#include "norm/rms_norm.h"

namespace fusedlayers::xla_binding {
namespace {

ffi::Error forward(Device& device, AnyBuffer x, AnyBuffer weight, Out y, Out rstd,
                   Dims normalized_shape, float eps, bool has_weight, bool zero_centered) {
  return call_csrc([&] {
    RmsNormForward a{ref(x), sizes(normalized_shape), ref(weight, has_weight), eps,
                     zero_centered};
    const RowsCols rc = rms_norm_forward_check(a);
    a.y = data(y);
    a.rstd = data(rstd);
    rms_norm_forward(a, rc, device.exec());
  });
}

ffi::Error backward(Device& device, AnyBuffer dy, AnyBuffer x, AnyBuffer rstd, AnyBuffer weight,
                    Out dx, Out dweight, Out workspace, Dims normalized_shape, bool has_weight,
                    bool zero_centered) {
  return call_csrc([&] {
    RmsNormBackward a{ref(dy), ref(x), ref(rstd), sizes(normalized_shape),
                      ref(weight, has_weight), zero_centered};
    a.dx = data(dx);
    a.dweight = data(dweight);
    run_with_workspace(device, a, workspace, rms_norm_backward_check,
                       rms_norm_backward_workspace_size, rms_norm_backward);
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<float>("eps")
      .template Attr<bool>("has_weight").template Attr<bool>("zero_centered");
};
const auto kBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<bool>("has_weight")
      .template Attr<bool>("zero_centered");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_OP(rms_norm);

// The forward's argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_rms_norm_check(
    const fusedlayers::xla_binding::TracedTensor* x,
    const fusedlayers::xla_binding::TracedTensor* weight, const int64_t* normalized_shape,
    int64_t normalized_ndim, float eps, bool zero_centered, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    rms_norm_forward_check({ref(x), {normalized_shape, normalized_ndim}, ref(weight), eps,
                            zero_centered});
  }, msg, msg_size);
}
