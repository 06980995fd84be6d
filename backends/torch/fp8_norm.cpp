// fusedlayers::fp8_norm_forward for PyTorch: schema and the CPU/CUDA kernel (tensor conversion
// around csrc/fp8/fp8_norm.h, which checks the arguments and owns the math). Not differentiable
// itself: fusedlayers.torch.fp8_norm's autograd function runs the add+norm backward ops for y's
// (and h's) gradient; the FP8 outputs feed FP8 GEMMs, whose autograd functions own theirs.
#include "backends/torch/fp8_binding.h"
#include "fp8/fp8_norm.h"

namespace fusedlayers::torch_binding {
namespace {

using Tensor8 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                           at::Tensor, at::Tensor, at::Tensor>;

Tensor8 forward_kernel(const at::Tensor& x_in, const OptTensor& residual_in,
                       at::IntArrayRef normalized_shape, const OptTensor& weight_in,
                       const OptTensor& bias_in, double eps, bool rms, bool zero_centered,
                       c10::string_view scaling, c10::string_view format, bool transpose,
                       bool power_of_2_scales) {
  const NormMode mode = rms ? NormMode::kRms : NormMode::kLayer;
  const char* op = fp8_norm_name(mode);
  check_tensors(op, "x", x_in,
                {{"residual", &residual_in}, {"weight", &weight_in}, {"bias", &bias_in}});
  const at::Tensor x = x_in.contiguous();
  const OptTensor residual = contiguous(residual_in);
  const OptTensor weight = contiguous(weight_in), bias = contiguous(bias_in);
  Fp8NormForward a;
  a.norm = AddNormForward{mode, ref(x), ref(residual), sizes(normalized_shape), ref(weight),
                          ref(bias), eps, zero_centered};
  parse_fp8_target(a.out, op, scaling, format, power_of_2_scales);
  const RowsCols rc = call_csrc([&] { return fp8_norm_forward_check(a); });
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor h = residual ? at::empty(residual->sizes(), residual->options()) : at::Tensor();
  at::Tensor mean = mode == NormMode::kLayer ? stats(x, normalized_shape) : at::Tensor();
  at::Tensor rstd = stats(x, normalized_shape);
  a.norm.y = y.data_ptr();
  a.norm.h = h.defined() ? h.data_ptr() : nullptr;
  a.norm.mean = mean.defined() ? mean.data_ptr() : nullptr;
  a.norm.rstd = rstd.data_ptr();
  at::Tensor workspace;
  auto [q, scale_inv, q_t, scale_inv_t] =
      fp8_outputs(a.out, x.sizes(), rc.rows, rc.cols, transpose, x, workspace);
  const c10::OptionalDeviceGuard guard(x.device());  // kernels get no guard from the dispatcher
  call_csrc([&] { fp8_norm_forward(a, rc, exec_for(x)); });
  return {y, h, mean, rstd, q, scale_inv, q_t, scale_inv_t};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // y = the RMSNorm (rms) or LayerNorm of x (or of h = x + residual in residual's dtype) in x's
  // dtype, its statistics (mean: LayerNorm only) of x's leading shape, and y quantized to FP8 as
  // fp8_quantize quantizes it (q_t and scale_inv_t: y^T's, with transpose). h and mean are
  // undefined where they do not apply.
  m.def("fp8_norm_forward(Tensor x, Tensor? residual, SymInt[] normalized_shape, "
        "Tensor? weight, Tensor? bias, float eps, bool rms, bool zero_centered=False, "
        "str scaling='1x128', str format='e4m3', bool transpose=False, "
        "bool power_of_2_scales=False) -> (Tensor y, Tensor h, Tensor mean, Tensor rstd, "
        "Tensor q, Tensor scale_inv, Tensor q_t, Tensor scale_inv_t)");
  impl_devices(m, "fp8_norm_forward", &forward_kernel);
}

}  // namespace fusedlayers::torch_binding
