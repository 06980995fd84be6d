// XLA FFI handlers fusedlayers_layer_norm_{forward,backward} on csrc/norm/layer_norm.h, which checks
// every argument. weight and bias are always operands and count only when has_weight / has_bias.
#include "backends/xla/ffi_binding.h"
#include "norm/layer_norm.h"

namespace fusedlayers::xla_binding {
namespace {

ffi::Error forward(Device& device, AnyBuffer x, AnyBuffer weight, AnyBuffer bias, Out y, Out mean,
                   Out rstd, Dims normalized_shape, float eps, bool has_weight, bool has_bias,
                   bool rms_scaling) {
  return call_csrc([&] {
    LayerNormForward a{ref(x),   sizes(normalized_shape), ref(weight, has_weight),
                       ref(bias, has_bias), eps,          rms_scaling};
    const RowsCols rc = layer_norm_forward_check(a);
    a.y = data(y);
    a.mean = data(mean);
    a.rstd = data(rstd);
    layer_norm_forward(a, rc, device.exec());
  });
}

ffi::Error backward(Device& device, AnyBuffer dy, AnyBuffer saved, AnyBuffer mean, AnyBuffer rstd,
                    AnyBuffer weight, AnyBuffer bias, Out dx, Out dweight, Out dbias,
                    Out workspace, Dims normalized_shape, bool has_weight, bool has_bias, bool rms_scaling) {
  return call_csrc([&] {
    LayerNormBackward a{ref(dy), ref(saved), ref(mean), ref(rstd), sizes(normalized_shape),
                        ref(weight, has_weight), ref(bias, has_bias), false, rms_scaling};
    a.dx = data(dx);
    a.dweight = data(dweight);
    a.dbias = data(dbias);
    run_with_workspace(device, a, workspace, layer_norm_backward_check,
                       layer_norm_backward_workspace_size, layer_norm_backward);
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<float>("eps")
      .template Attr<bool>("has_weight").template Attr<bool>("has_bias")
      .template Attr<bool>("rms_scaling");
};
const auto kBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<bool>("has_weight")
      .template Attr<bool>("has_bias").template Attr<bool>("rms_scaling");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_OP(layer_norm);

// The forward's argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_layer_norm_check(
    const fusedlayers::xla_binding::TracedTensor* x,
    const fusedlayers::xla_binding::TracedTensor* weight,
    const fusedlayers::xla_binding::TracedTensor* bias, const int64_t* normalized_shape,
    int64_t normalized_ndim, float eps, bool rms_scaling, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    layer_norm_forward_check({ref(x), {normalized_shape, normalized_ndim}, ref(weight),
                              ref(bias), eps, rms_scaling});
  }, msg, msg_size);
}
