// fusedlayers::fp8_quantize for PyTorch: schema and the CPU/CUDA kernel (tensor conversion
// around csrc/fp8/fp8.h, which checks the arguments and owns the scaling rule). Not
// differentiable: a quantized tensor feeds an FP8 GEMM, whose op owns the gradient.
#include "backends/torch/fp8_binding.h"

namespace fusedlayers::torch_binding {
namespace {

Fp8Tensors kernel(const at::Tensor& x_in, c10::string_view scaling, c10::string_view format,
                  bool transpose, bool power_of_2_scales,
                  std::optional<c10::string_view> scaling_t) {
  const char* op = "fp8_quantize";
  check_floating(op, "x", x_in);
  const at::Tensor x = x_in.contiguous();
  Fp8Quantize a;
  a.x = ref(x);
  parse_fp8_target(a, op, scaling, format, power_of_2_scales, scaling_t);
  const RowsCols rc = call_csrc([&] { return fp8_quantize_check(a); });
  at::Tensor workspace;
  Fp8Tensors out = fp8_outputs(a, x.sizes(), rc.rows, rc.cols, transpose, x, workspace);
  const c10::OptionalDeviceGuard guard(x.device());
  call_csrc([&] { fp8_quantize(a, exec_for(x)); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // Layouts and the scaling rule: csrc/fp8/fp8.h. q_t and scale_inv_t are undefined without
  // transpose; scaling_t None: scaling.
  m.def("fp8_quantize(Tensor x, str scaling='1x128', str format='e4m3', bool transpose=False, "
        "bool power_of_2_scales=False, str? scaling_t=None) -> (Tensor q, Tensor scale_inv, "
        "Tensor q_t, Tensor scale_inv_t)");
  impl_devices(m, "fp8_quantize", &kernel);
}

}  // namespace fusedlayers::torch_binding
