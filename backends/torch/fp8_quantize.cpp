// fusedlayers::fp8_quantize for PyTorch: schema and the CPU/CUDA kernel (tensor conversion
// around csrc/fp8/fp8.h, which checks the arguments and owns the scaling rule). Not
// differentiable: a quantized tensor feeds an FP8 GEMM, whose op owns the gradient.
#include "backends/torch/torch_binding.h"
#include "fp8/fp8.h"

namespace fusedlayers::torch_binding {
namespace {

using Quantized = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// scale_inv of `sizes`, viewed as the contract's layout says: 1x128's [blocks, rows] buffer as
// [rows, blocks] (column-major), the others as they are.
at::Tensor scale_view(const at::Tensor& buffer, Fp8Scaling scaling) {
  return scaling == Fp8Scaling::kBlock1x128 ? buffer.t() : buffer;
}

Quantized kernel(const at::Tensor& x_in, c10::string_view scaling_name,
                 c10::string_view format_name, bool transpose, bool power_of_2_scales) {
  const char* op = "fp8_quantize";
  check_floating(op, "x", x_in);
  const at::Tensor x = x_in.contiguous();
  Fp8Quantize a{ref(x)};
  call_csrc([&] {
    a.format = parse_fp8_format(op, std::string(format_name));
    a.scaling = parse_fp8_scaling(op, std::string(scaling_name));
  });
  a.power_of_2_scales = power_of_2_scales;
  const RowsCols rc = call_csrc([&] { return fp8_quantize_check(a); });
  const auto fp8 = a.format == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(fp8));
  const Fp8ScaleSizes ss = fp8_scale_sizes(a.scaling, rc.rows, rc.cols, false);
  at::Tensor scale_inv = at::empty({ss.dim0, ss.dim1}, f32);
  at::Tensor q_t, scale_inv_t, amax;
  if (transpose) {
    const Fp8ScaleSizes st = fp8_scale_sizes(a.scaling, rc.rows, rc.cols, true);
    q_t = at::empty({rc.cols, rc.rows}, x.options().dtype(fp8));
    scale_inv_t = at::empty({st.dim0, st.dim1}, f32);
    a.q_t = static_cast<uint8_t*>(q_t.data_ptr());
    a.scale_inv_t = scale_inv_t.data_ptr<float>();
  }
  if (a.scaling == Fp8Scaling::kTensorwise) {
    amax = at::empty({1}, f32);
    a.amax = amax.data_ptr<float>();
  }
  a.q = static_cast<uint8_t*>(q.data_ptr());
  a.scale_inv = scale_inv.data_ptr<float>();
  const c10::OptionalDeviceGuard guard(x.device());
  call_csrc([&] { fp8_quantize(a, exec_for(x)); });
  if (a.scaling == Fp8Scaling::kTensorwise) {
    scale_inv = scale_inv.reshape({});
    if (transpose) scale_inv_t = scale_inv_t.reshape({});
  }
  return {q, scale_view(scale_inv, a.scaling), q_t,
          transpose ? scale_view(scale_inv_t, a.scaling) : scale_inv_t};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // Layouts and the scaling rule: csrc/fp8/fp8.h. q_t and scale_inv_t are undefined without
  // transpose.
  m.def("fp8_quantize(Tensor x, str scaling='1x128', str format='e4m3', bool transpose=False, "
        "bool power_of_2_scales=False) -> (Tensor q, Tensor scale_inv, Tensor q_t, "
        "Tensor scale_inv_t)");
  impl_devices(m, "fp8_quantize", &kernel);
}

}  // namespace fusedlayers::torch_binding
