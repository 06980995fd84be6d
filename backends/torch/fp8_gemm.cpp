// fusedlayers::fp8_gemm for PyTorch: schema and the CPU/CUDA kernel (tensor conversion around
// csrc/fp8/fp8_gemm.h, which checks the arguments and owns the math). Not differentiable: the
// FP8 linear layer's autograd function calls it for each of its three GEMMs.
#include "backends/torch/torch_binding.h"
#include "fp8/fp8_gemm.h"

namespace fusedlayers::torch_binding {
namespace {

// "[d0, d1, ...]": shapes in messages, formatted here rather than by streaming an IntArrayRef.
std::string shape_str(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

Fp8Format format_of(const char* arg, const at::Tensor& t) {
  const at::ScalarType s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat8_e4m3fn || s == at::kFloat8_e5m2, "fusedlayers.fp8_gemm: ",
                   arg, " must be torch.float8_e4m3fn or torch.float8_e5m2, got ",
                   c10::toString(s));
  return s == at::kFloat8_e4m3fn ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

// The scale buffer csrc reads for `scale_inv` (checked by csrc against the rule's shape) in
// fp8_quantize's layout (csrc/fp8/fp8.h): as fp8_quantize returns it, or copied to it.
at::Tensor scale_buffer(const char* name, const at::Tensor& scale_inv, Fp8Scaling scaling,
                        const at::Tensor& like) {
  TORCH_CHECK_TYPE(scale_inv.scalar_type() == at::kFloat, "fusedlayers.fp8_gemm: ", name,
                   "_scale_inv must be float32, got ", c10::toString(scale_inv.scalar_type()));
  check_same_device("fp8_gemm", (std::string(name) + "_scale_inv").c_str(), scale_inv, "a", like);
  if (scale_inv.dim() != 2) return scale_inv.contiguous();
  switch (scaling) {
    case Fp8Scaling::kTensorwise: return scale_inv.contiguous();
    case Fp8Scaling::kBlock1x128: return scale_inv.t().contiguous();  // [blocks, rows]
    case Fp8Scaling::kBlock128x128: {
      const int64_t ld = (scale_inv.size(1) + 3) / 4 * 4;  // rows padded to 4 floats
      if (scale_inv.stride(1) == 1 && (scale_inv.size(0) <= 1 || scale_inv.stride(0) == ld))
        return scale_inv;
      return at::zeros({scale_inv.size(0), ld}, scale_inv.options())
          .narrow(1, 0, scale_inv.size(1))
          .copy_(scale_inv);
    }
  }
  return scale_inv;
}

// The shape csrc checks: a 2-D scale_inv's, [1, 1] for one value, else [-1, -1] (no match).
std::pair<int64_t, int64_t> scale_shape(const at::Tensor& scale_inv) {
  if (scale_inv.dim() == 2) return {scale_inv.size(0), scale_inv.size(1)};
  if (scale_inv.numel() == 1) return {1, 1};
  return {-1, -1};
}

at::Tensor kernel(const at::Tensor& a_in, const at::Tensor& a_scale_inv,
                  c10::string_view a_scaling, const at::Tensor& b_in,
                  const at::Tensor& b_scale_inv, c10::string_view b_scaling,
                  at::ScalarType out_dtype, const OptTensor& bias_in, bool fast_accum) {
  const char* op = "fp8_gemm";
  call_csrc([&] {
    if (a_in.dim() != 2 || b_in.dim() != 2)
      arg_error(op, "a and b must be 2-D, got " + std::to_string(a_in.dim()) + "-D and " +
                        std::to_string(b_in.dim()) + "-D");
  });
  check_same_device(op, "b", b_in, "a", a_in);
  TORCH_CHECK_TYPE(out_dtype == at::kFloat || out_dtype == at::kHalf ||
                       out_dtype == at::kBFloat16,
                   "fusedlayers.fp8_gemm: out_dtype must be float32, float16 or bfloat16, got ",
                   c10::toString(out_dtype));
  Fp8Gemm g;
  g.a.format = format_of("a", a_in);
  g.b.format = format_of("b", b_in);
  call_csrc([&] {
    g.a.scaling = parse_fp8_scaling(op, std::string(a_scaling));
    g.b.scaling = parse_fp8_scaling(op, std::string(b_scaling));
  });
  g.a.rows = a_in.size(0);
  g.b.rows = b_in.size(0);
  g.a.cols = a_in.size(1);
  g.b.cols = b_in.size(1);
  std::tie(g.a.scale_rows, g.a.scale_cols) = scale_shape(a_scale_inv);
  std::tie(g.b.scale_rows, g.b.scale_cols) = scale_shape(b_scale_inv);
  g.out_dtype = to_dtype(out_dtype);
  g.fast_accum = fast_accum;
  at::Tensor bias;
  if (bias_in) {
    check_same_device(op, "bias", *bias_in, "a", a_in);
    call_csrc([&] {
      if (bias_in->dim() != 1 || bias_in->size(0) != g.n())
        arg_error(op, "bias must have shape [" + std::to_string(g.n()) + "], got " +
                          shape_str(bias_in->sizes()));
    });
    bias = bias_in->to(out_dtype).contiguous();
    g.bias = bias.data_ptr();
  }
  call_csrc([&] { fp8_gemm_check(g); });
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const at::Tensor sa = scale_buffer("a", a_scale_inv, g.a.scaling, a);
  const at::Tensor sb = scale_buffer("b", b_scale_inv, g.b.scaling, a);
  at::Tensor d = at::empty({g.m(), g.n()}, a.options().dtype(out_dtype));
  g.a.data = static_cast<const uint8_t*>(a.data_ptr());
  g.b.data = static_cast<const uint8_t*>(b.data_ptr());
  g.a.scale_inv = sa.data_ptr<float>();
  g.b.scale_inv = sb.data_ptr<float>();
  g.d = d.data_ptr();
  const c10::OptionalDeviceGuard guard(a.device());
  call_csrc([&] { fp8_gemm(g, exec_for(a), lt_context(a)); });
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlayers, m) {
  // d = dequant(a) dequant(b)^T (+ bias): a [m, k], b [n, k] FP8 as fp8_quantize writes them
  // (scale_inv in its layouts), d [m, n] of out_dtype. Rules: csrc/fp8/fp8_gemm.h.
  m.def("fp8_gemm(Tensor a, Tensor a_scale_inv, str a_scaling, Tensor b, Tensor b_scale_inv, "
        "str b_scaling, ScalarType out_dtype, Tensor? bias=None, "
        "bool fast_accum=False) -> Tensor");
  impl_devices(m, "fp8_gemm", &kernel);
}

}  // namespace fusedlayers::torch_binding
