// fusedlayers::fp8_quantize for PyTorch: schema and the CPU/CUDA kernel (tensor conversion
// around csrc/fp8/fp8.h, which checks the arguments and owns the scaling rule). Not
// differentiable: a quantized tensor feeds an FP8 GEMM, whose op owns the gradient.
#include "backends/torch/torch_binding.h"
#include "fp8/fp8.h"

namespace fusedlayers::torch_binding {
namespace {

using Quantized = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// A scale_inv buffer of `sizes`: 1x128's [blocks, rows] buffer viewed as [rows, blocks]
// (column-major), 128x128's padded rows cut to their tiles (the padding zeroed), a tensorwise
// scale 0-d.
at::Tensor scale_buffer(const Fp8ScaleSizes& sizes, Fp8Scaling scaling,
                        const at::TensorOptions& f32) {
  switch (scaling) {
    case Fp8Scaling::kTensorwise: return at::empty({}, f32);
    case Fp8Scaling::kBlock1x128: return at::empty({sizes.dim0, sizes.dim1}, f32).t();
    case Fp8Scaling::kBlock128x128:
      return at::zeros({sizes.dim0, sizes.ld}, f32).narrow(1, 0, sizes.dim1);
  }
  return {};
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
  at::Tensor scale_inv =
      scale_buffer(fp8_scale_sizes(a.scaling, rc.rows, rc.cols, false), a.scaling, f32);
  at::Tensor q_t, scale_inv_t, amax;
  if (transpose) {
    q_t = at::empty({rc.cols, rc.rows}, x.options().dtype(fp8));
    scale_inv_t =
        scale_buffer(fp8_scale_sizes(a.scaling, rc.rows, rc.cols, true), a.scaling, f32);
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
  return {q, scale_inv, q_t, scale_inv_t};
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
