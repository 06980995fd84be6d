// XLA FFI handlers fusedlayers_add_rms_norm_{forward,backward} and
// fusedlayers_add_layer_norm_{forward,backward} on csrc/norm/add_norm.h, which checks every argument.
// Optional tensors are always operands and count only when their has_<name> attribute is set;
// dresidual is an empty result where h has dy's dtype (dx is then the residual's gradient too).
#include "backends/xla/ffi_binding.h"
#include "norm/add_norm.h"

namespace fusedlayers::xla_binding {
namespace {

void forward(Device& device, NormMode mode, AnyBuffer x, AnyBuffer residual, AnyBuffer weight,
             AnyBuffer bias, bool has_weight, bool has_bias, Out& y, Out& h, void* mean,
             Out& rstd, Dims normalized_shape, float eps, bool zero_centered) {
  AddNormForward a{mode, ref(x), ref(residual), sizes(normalized_shape), ref(weight, has_weight),
                   ref(bias, has_bias), eps, zero_centered};
  const RowsCols rc = add_norm_forward_check(a);
  a.y = data(y);
  a.h = data(h);
  a.mean = mean;
  a.rstd = data(rstd);
  add_norm_forward(a, rc, device.exec());
}

void backward(Device& device, NormMode mode, AnyBuffer dy, AnyBuffer dh, bool has_dh, AnyBuffer h,
              const TensorRef& mean, AnyBuffer rstd, AnyBuffer weight, AnyBuffer bias,
              bool has_weight, bool has_bias, Out& dx, Out& dresidual, void* dweight,
              void* dbias, Out& workspace, Dims normalized_shape, bool zero_centered) {
  AddNormBackward a{mode, ref(dy), ref(dh, has_dh), ref(h), mean, ref(rstd),
                    sizes(normalized_shape), ref(weight, has_weight), ref(bias, has_bias),
                    zero_centered};
  a.dx = data(dx);
  a.dresidual = dresidual->element_count() ? data(dresidual) : nullptr;
  a.dweight = dweight;
  a.dbias = dbias;
  run_with_workspace(device, a, workspace, add_norm_backward_check,
                     add_norm_backward_workspace_size, add_norm_backward);
}

ffi::Error rms_forward(Device& device, AnyBuffer x, AnyBuffer residual, AnyBuffer weight, Out y,
                       Out h, Out rstd, Dims normalized_shape, float eps, bool has_weight,
                       bool zero_centered) {
  return call_csrc([&] {
    forward(device, NormMode::kRms, x, residual, weight, weight, has_weight, false, y, h,
            nullptr, rstd, normalized_shape, eps, zero_centered);
  });
}

ffi::Error rms_backward(Device& device, AnyBuffer dy, AnyBuffer dh, AnyBuffer h, AnyBuffer rstd,
                        AnyBuffer weight, Out dx, Out dresidual, Out dweight, Out workspace,
                        Dims normalized_shape, bool has_dh, bool has_weight, bool zero_centered) {
  return call_csrc([&] {
    backward(device, NormMode::kRms, dy, dh, has_dh, h, TensorRef{}, rstd, weight, weight,
             has_weight, false, dx, dresidual, data(dweight), nullptr, workspace,
             normalized_shape, zero_centered);
  });
}

ffi::Error layer_forward(Device& device, AnyBuffer x, AnyBuffer residual, AnyBuffer weight,
                         AnyBuffer bias, Out y, Out h, Out mean, Out rstd, Dims normalized_shape,
                         float eps, bool has_weight, bool has_bias) {
  return call_csrc([&] {
    forward(device, NormMode::kLayer, x, residual, weight, bias, has_weight, has_bias, y, h,
            data(mean), rstd, normalized_shape, eps, false);
  });
}

ffi::Error layer_backward(Device& device, AnyBuffer dy, AnyBuffer dh, AnyBuffer h,
                          AnyBuffer mean, AnyBuffer rstd, AnyBuffer weight, AnyBuffer bias,
                          Out dx, Out dresidual, Out dweight, Out dbias, Out workspace,
                          Dims normalized_shape, bool has_dh, bool has_weight, bool has_bias) {
  return call_csrc([&] {
    backward(device, NormMode::kLayer, dy, dh, has_dh, h, ref(mean), rstd, weight, bias,
             has_weight, has_bias, dx, dresidual, data(dweight), data(dbias), workspace,
             normalized_shape, false);
  });
}

const auto kRmsForwardSig = [](auto b) {
  return std::move(b)
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<float>("eps")
      .template Attr<bool>("has_weight").template Attr<bool>("zero_centered");
};
const auto kRmsBackwardSig = [](auto b) {
  return std::move(b)
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<bool>("has_dh")
      .template Attr<bool>("has_weight").template Attr<bool>("zero_centered");
};
const auto kLayerForwardSig = [](auto b) {
  return std::move(b)
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<float>("eps")
      .template Attr<bool>("has_weight").template Attr<bool>("has_bias");
};
const auto kLayerBackwardSig = [](auto b) {
  return std::move(b)
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<Dims>("normalized_shape").template Attr<bool>("has_dh")
      .template Attr<bool>("has_weight").template Attr<bool>("has_bias");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_HANDLERS(add_rms_norm_forward, ::fusedlayers::xla_binding::rms_forward,
                         ::fusedlayers::xla_binding::kRmsForwardSig);
FUSEDLAYERS_XLA_HANDLERS(add_rms_norm_backward, ::fusedlayers::xla_binding::rms_backward,
                         ::fusedlayers::xla_binding::kRmsBackwardSig);
FUSEDLAYERS_XLA_HANDLERS(add_layer_norm_forward, ::fusedlayers::xla_binding::layer_forward,
                         ::fusedlayers::xla_binding::kLayerForwardSig);
FUSEDLAYERS_XLA_HANDLERS(add_layer_norm_backward, ::fusedlayers::xla_binding::layer_backward,
                         ::fusedlayers::xla_binding::kLayerBackwardSig);

// The forwards' argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_add_rms_norm_check(
    const fusedlayers::xla_binding::TracedTensor* x,
    const fusedlayers::xla_binding::TracedTensor* residual,
    const fusedlayers::xla_binding::TracedTensor* weight, const int64_t* normalized_shape,
    int64_t normalized_ndim, float eps, bool zero_centered, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    add_norm_forward_check({NormMode::kRms, ref(x), ref(residual),
                            {normalized_shape, normalized_ndim}, ref(weight), TensorRef{}, eps,
                            zero_centered});
  }, msg, msg_size);
}

FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_add_layer_norm_check(
    const fusedlayers::xla_binding::TracedTensor* x,
    const fusedlayers::xla_binding::TracedTensor* residual,
    const fusedlayers::xla_binding::TracedTensor* weight,
    const fusedlayers::xla_binding::TracedTensor* bias, const int64_t* normalized_shape,
    int64_t normalized_ndim, float eps, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace([&] {
    add_norm_forward_check({NormMode::kLayer, ref(x), ref(residual),
                            {normalized_shape, normalized_ndim}, ref(weight), ref(bias), eps,
                            false});
  }, msg, msg_size);
}
