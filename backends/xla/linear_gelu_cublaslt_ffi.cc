// XLA FFI handlers fusedlayers_linear_gelu_gemm_{forward,backward}, CUDA only: the whole
// linear_gelu op of csrc/gemm/linear_gelu.h on cuBLASLt, GEMMs and epilogue, as the torch extension
// runs it (with approximate='tanh' the forward is one GEMM with cuBLASLt's GELU epilogue).
// fusedlayers/jax/linear_gelu.py calls them on CUDA in place of XLA's dots around the epilogue
// handlers (linear_gelu.cc). The `workspace` result holds the backward's own workspace, then
// cuBLASLt's (fusedlayers_xla_linear_gelu_gemm_workspace_size). Built into the JAX library of CUDA
// builds only (it links cuBLASLt; _sources.GEMM_SOURCES).
#include "backends/xla/ffi_binding.h"
#include "gemm/linear_gelu.h"

namespace fusedlayers::xla_binding {
namespace {

WeightLayout layout(bool in_out) { return in_out ? WeightLayout::kInOut : WeightLayout::kOutIn; }

// csrc's weight: sizes (out_features, in_features) whatever its layout; a Keras kernel (in_out) is
// stored (in_features, out_features), so its view gets the sizes swapped (`sizes` keeps them).
TensorRef weight_ref(const AnyBuffer& weight, bool in_out, int64_t (&sizes)[2]) {
  TensorRef w = ref(weight);
  if (in_out && w.sizes.size == 2) {
    sizes[0] = w.sizes[1];
    sizes[1] = w.sizes[0];
    w.sizes = {sizes, 2};
  }
  return w;
}

ffi::Error forward(Device& device, AnyBuffer x, AnyBuffer weight, AnyBuffer bias, Out pre, Out y,
                   Out workspace, bool has_bias, bool in_out, std::string_view approximate,
                   bool with_pre) {
  return call_csrc([&] {
    int64_t sizes[2];
    LinearGeluForward a{ref(x), weight_ref(weight, in_out, sizes), layout(in_out),
                        ref(bias, has_bias),
                        parse_gelu_approx("linear_gelu", std::string(approximate)),
                        with_pre ? data(pre) : nullptr, data(y)};
    const GemmSizes s = linear_gelu_forward_check(a);
    linear_gelu_forward(a, s, device.exec(), {nullptr, lt_context(device, workspace, 0)});
  });
}

ffi::Error backward(Device& device, AnyBuffer dy, AnyBuffer x, AnyBuffer weight, AnyBuffer pre,
                    Out dx, Out dweight, Out dbias, Out workspace, bool has_bias, bool in_out,
                    std::string_view approximate) {
  return call_csrc([&] {
    int64_t sizes[2];
    LinearGeluBackward a{ref(dy), ref(x), weight_ref(weight, in_out, sizes), ref(pre),
                         layout(in_out), has_bias,
                         parse_gelu_approx("linear_gelu_backward", std::string(approximate)),
                         data(dx), data(dweight), data(dbias)};
    const GemmSizes s = linear_gelu_backward_check(a);
    const size_t own = (linear_gelu_backward_workspace_size(a, s, device.exec()) + 255) / 256 * 256;
    a.workspace = data(workspace);
    linear_gelu_backward(a, s, device.exec(), {nullptr, lt_context(device, workspace, own)});
  });
}

const auto kForwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<bool>("has_bias").template Attr<bool>("in_out")
      .template Attr<std::string_view>("approximate").template Attr<bool>("with_pre");
};
const auto kBackwardSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<bool>("has_bias").template Attr<bool>("in_out")
      .template Attr<std::string_view>("approximate");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_CUDA_HANDLER(linear_gelu_gemm_forward, ::fusedlayers::xla_binding::forward,
                             ::fusedlayers::xla_binding::kForwardSig);
FUSEDLAYERS_XLA_CUDA_HANDLER(linear_gelu_gemm_backward, ::fusedlayers::xla_binding::backward,
                             ::fusedlayers::xla_binding::kBackwardSig);

// The `workspace` result's bytes for an m x n output of csrc DType `dtype`: cuBLASLt's workspace,
// after the backward's own (256-byte aligned) when `backward`.
FUSEDLAYERS_XLA_EXPORT size_t fusedlayers_xla_linear_gelu_gemm_workspace_size(
    bool backward, int64_t m, int64_t n, int dtype) {
  using namespace fusedlayers;
  try {
    const size_t own = backward ? linear_gelu_backward_workspace_size_cuda(
                                      {m, n, 0}, static_cast<DType>(dtype)) : 0;
    return (own + 255) / 256 * 256 + kCublasLtWorkspaceBytes;
  } catch (const Error&) {
    return kCublasLtWorkspaceBytes;
  }
}
