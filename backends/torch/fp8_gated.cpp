// fusedlayers::fp8_gated_forward and fp8_gated_backward for PyTorch: schemas and the CPU/CUDA
// kernels (tensor conversion around csrc/fp8/fp8_gated.h, which checks the arguments and owns
// the math). Not differentiable: their FP8 outputs feed FP8 GEMMs inside fp8_gated_mlp, whose
// autograd function owns the gradient.
#include "backends/torch/fp8_binding.h"
#include "backends/torch/gated_binding.h"
#include "fp8/fp8_gated.h"

namespace fusedlayers::torch_binding {
namespace {

Fp8Tensors forward_kernel(const at::Tensor& gate, const at::Tensor& up,
                          c10::string_view activation, c10::string_view scaling,
                          c10::string_view format, bool transpose, bool power_of_2_scales,
                          std::optional<c10::string_view> scaling_t) {
  const char* op = "fp8_gated_forward";
  check_gated_args(op, gate, up);
  at::Tensor g, u;
  Fp8GatedForward a;
  a.gate = gated_input(gate, g);
  a.up = gated_input(up, u);
  a.activation = call_csrc([&] { return parse_gated_activation(op, std::string(activation)); });
  parse_fp8_target(a.out, op, scaling, format, power_of_2_scales, scaling_t);
  const RowsCols rc = call_csrc([&] { return fp8_gated_forward_check(op, a); });
  at::Tensor workspace;
  Fp8Tensors out = fp8_outputs(a.out, gate.sizes(), rc.rows, rc.cols, transpose, gate, workspace);
  const c10::OptionalDeviceGuard guard(gate.device());
  call_csrc([&] { fp8_gated_forward(a, rc, exec_for(gate)); });
  return out;
}

Fp8Tensors backward_kernel(const at::Tensor& dy_in, const at::Tensor& gate, const at::Tensor& up,
                           c10::string_view activation, c10::string_view scaling,
                           c10::string_view format, bool transpose, bool power_of_2_scales) {
  const char* op = "fp8_gated_backward";
  check_gated_backward_args(op, dy_in, gate, up);
  const at::Tensor dy = dy_in.contiguous();
  at::Tensor g, u;
  Fp8GatedBackward a;
  a.dy = ref(dy);
  a.gate = gated_input(gate, g);
  a.up = gated_input(up, u);
  a.activation = call_csrc([&] { return parse_gated_activation(op, std::string(activation)); });
  parse_fp8_target(a.out, op, scaling, format, power_of_2_scales);
  const RowsCols rc = call_csrc([&] { return fp8_gated_backward_check(op, a); });
  std::vector<int64_t> shape(gate.sizes().begin(), gate.sizes().end());
  if (shape.empty()) shape.push_back(1);
  shape.back() *= 2;  // [dgate | dup]
  at::Tensor workspace;
  Fp8Tensors out = fp8_outputs(a.out, shape, rc.rows, 2 * rc.cols, transpose, dy, workspace);
  const c10::OptionalDeviceGuard guard(dy.device());
  call_csrc([&] { fp8_gated_backward(a, rc, exec_for(dy)); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // The FP8 values (and scales) of act(gate) * up, and of [dgate | dup] along the last dim;
  // layouts as fp8_quantize's. q_t and scale_inv_t are undefined without transpose;
  // scaling_t None: scaling.
  m.def("fp8_gated_forward(Tensor gate, Tensor up, str activation, str scaling='1x128', "
        "str format='e4m3', bool transpose=False, bool power_of_2_scales=False, "
        "str? scaling_t=None) -> (Tensor q, Tensor scale_inv, Tensor q_t, Tensor scale_inv_t)");
  m.def("fp8_gated_backward(Tensor dy, Tensor gate, Tensor up, str activation, "
        "str scaling='1x128', str format='e4m3', bool transpose=False, "
        "bool power_of_2_scales=False) -> (Tensor q, Tensor scale_inv, Tensor q_t, "
        "Tensor scale_inv_t)");
  impl_devices(m, "fp8_gated_forward", &forward_kernel);
  impl_devices(m, "fp8_gated_backward", &backward_kernel);
}

}  // namespace fusedlayers::torch_binding
