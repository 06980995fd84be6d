// Autocast for the fusedlayers ops, registered to the AutocastCPU / AutocastCUDA dispatch keys in
// C++, with the policy of the native op each one replaces (ATen's autocast_mode.cpp):
//   linear_gelu: the autocast dtype, on CPU and CUDA, like linear;
//   layer_norm:  float32 on CUDA, like layer_norm; untouched on the CPU, where ATen registers none;
//   relu_scale:  untouched, like relu (no kernel: the autocast keys fall through).
// cached_cast casts only float32/float16/bfloat16 tensors of the autocast device (float64 stays
// float64, as for the native ops) and reuses the cast of a leaf weight within an autocast region.
// Deciding this in Python instead costs host time on every call and is a graph break for Dynamo.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "backends/torch/binding.h"

namespace fusedlayers {
namespace torch_binding {
namespace {

using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <c10::DeviceType Device>
at::Tensor linear_gelu_autocast(const at::Tensor& input, const at::Tensor& weight,
                                const OptTensor& bias, c10::string_view approximate) {
  static const auto fwd =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view)>(
          "linear_gelu");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(Device));
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(Device);
  return fwd.call(at::autocast::cached_cast(dtype, input, Device),
                  at::autocast::cached_cast(dtype, weight, Device),
                  at::autocast::cached_cast(dtype, bias, Device), approximate);
}

Tensor3 layer_norm_autocast_cuda(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                 const OptTensor& weight, const OptTensor& bias, double eps,
                                 bool memory_efficient, bool subtract_mean) {
  static const auto fwd =
      op<Tensor3(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&, const OptTensor&,
                 double, bool, bool)>("layer_norm");
  constexpr auto kCUDA = c10::DeviceType::CUDA;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return fwd.call(at::autocast::cached_cast(at::kFloat, input, kCUDA), normalized_shape,
                  at::autocast::cached_cast(at::kFloat, weight, kCUDA),
                  at::autocast::cached_cast(at::kFloat, bias, kCUDA), eps, memory_efficient,
                  subtract_mean);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedlayers, AutocastCPU, m) {
  m.impl("linear_gelu", &linear_gelu_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(fusedlayers, AutocastCUDA, m) {
  m.impl("linear_gelu", &linear_gelu_autocast<c10::DeviceType::CUDA>);
  m.impl("layer_norm", &layer_norm_autocast_cuda);
}

}  // namespace torch_binding
}  // namespace fusedlayers
