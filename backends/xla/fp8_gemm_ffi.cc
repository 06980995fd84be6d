// XLA FFI handler fusedlayers_fp8_gemm on csrc/fp8/fp8_gemm.h, which checks the arguments and owns
// the math: d = dequant(a) dequant(b)^T (+ bias), d's dtype that of the `d` result. The scales
// come in csrc's storage layouts (fp8_quantize_ffi.cc's results); the `workspace` result is
// cuBLASLt's on CUDA (fusedlayers_xla_fp8_gemm_workspace_size), empty on the CPU.
#include "backends/xla/ffi_binding.h"
#include "fp8/fp8_gemm.h"

namespace fusedlayers::xla_binding {
namespace {

Fp8Format format_of(const char* name, const AnyBuffer& t) {
  switch (t.element_type()) {
    case ffi::DataType::F8E4M3FN: return Fp8Format::kE4M3;
    case ffi::DataType::F8E5M2: return Fp8Format::kE5M2;
    default: arg_error("fp8_gemm", std::string(name) + " must be float8_e4m3fn or float8_e5m2");
  }
}

// The operand o of data [rows, cols] and its scales in csrc's storage (fp8_scales_from_storage).
Fp8Operand operand(const char* name, const AnyBuffer& q, const AnyBuffer& scale_inv,
                   std::string_view scaling) {
  Fp8Operand o;
  o.format = format_of(name, q);
  o.scaling = parse_fp8_scaling("fp8_gemm", std::string(scaling));
  const Dims d = q.dimensions(), s = scale_inv.dimensions();
  if (d.size() != 2) arg_error("fp8_gemm", std::string(name) + " must be 2-D");
  if (scale_inv.element_type() != ffi::DataType::F32)
    arg_error("fp8_gemm", std::string(name) + "_scale_inv must be float32");
  o.rows = d[0];
  o.cols = d[1];
  o.data = static_cast<const uint8_t*>(q.untyped_data());
  o.scale_inv = static_cast<const float*>(scale_inv.untyped_data());
  fp8_scales_from_storage(o, s.begin(), static_cast<int64_t>(s.size()));
  return o;
}

ffi::Error gemm(Device& device, AnyBuffer a, AnyBuffer a_scale_inv, AnyBuffer b,
                AnyBuffer b_scale_inv, AnyBuffer bias, Out d, Out workspace,
                std::string_view a_scaling, std::string_view b_scaling, bool has_bias,
                bool fast_accum) {
  return call_csrc([&] {
    Fp8Gemm g;
    g.a = operand("a", a, a_scale_inv, a_scaling);
    g.b = operand("b", b, b_scale_inv, b_scaling);
    g.out_dtype = ref(*d).dtype;
    g.d = data(d);
    g.fast_accum = fast_accum;
    if (has_bias) {
      if (bias.element_count() != static_cast<size_t>(g.n()) || ref(bias).dtype != g.out_dtype)
        arg_error("fp8_gemm", "bias must be [n] of d's dtype");
      g.bias = bias.untyped_data();
    }
    fp8_gemm_check(g);
    fp8_gemm(g, device.exec(), lt_context(device, workspace, 0));
  });
}

const auto kSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Attr<std::string_view>("a_scaling").template Attr<std::string_view>("b_scaling")
      .template Attr<bool>("has_bias").template Attr<bool>("fast_accum");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_HANDLERS(fp8_gemm, ::fusedlayers::xla_binding::gemm,
                         ::fusedlayers::xla_binding::kSig);

// The op's argument checks for a trace: a [m, k] and b [n, k] by their dims and formats ("e4m3",
// "e5m2"), their scales by the shapes the caller holds, d's dtype (csrc's DType) and the bias
// (absent: not defined).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_fp8_gemm_check(
    const int64_t* a_dims, int64_t a_ndim, const char* a_format, const int64_t* a_scale,
    int64_t a_scale_ndim, const char* a_scaling, const int64_t* b_dims, int64_t b_ndim,
    const char* b_format, const int64_t* b_scale, int64_t b_scale_ndim, const char* b_scaling,
    int64_t out_dtype, const fusedlayers::xla_binding::TracedTensor* bias, bool fast_accum,
    char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace(
      [&] {
        const char* op = "fp8_gemm";
        if (a_ndim != 2 || b_ndim != 2)
          arg_error(op, "a and b must be 2-D, got " + std::to_string(a_ndim) + "-D and " +
                            std::to_string(b_ndim) + "-D");
        const auto make = [&](const int64_t* dims, const char* format, const int64_t* scale,
                              int64_t scale_ndim, const char* scaling) {
          Fp8Operand o;
          o.format = parse_fp8_format(op, format);
          o.scaling = parse_fp8_scaling(op, scaling);
          o.rows = dims[0];
          o.cols = dims[1];
          o.scale_rows = scale_ndim == 2 ? scale[0] : scale_ndim == 0 ? 1 : -1;
          o.scale_cols = scale_ndim == 2 ? scale[1] : scale_ndim == 0 ? 1 : -1;
          return o;
        };
        Fp8Gemm g;
        g.a = make(a_dims, a_format, a_scale, a_scale_ndim, a_scaling);
        g.b = make(b_dims, b_format, b_scale, b_scale_ndim, b_scaling);
        g.out_dtype = static_cast<DType>(out_dtype);
        if (bias->defined) {
          const TensorRef t = ref(bias);
          if (t.sizes.size != 1 || t.sizes[0] != g.n())
            arg_error(op, "bias must have shape [" + std::to_string(g.n()) + "]");
          g.bias = &g;  // present (its values are not read by the check)
        }
        g.fast_accum = fast_accum;
        fp8_gemm_check(g);
      },
      msg, msg_size);
}

// cuBLASLt's workspace bytes of the `workspace` result on CUDA (0 in builds without CUDA).
FUSEDLAYERS_XLA_EXPORT size_t fusedlayers_xla_fp8_gemm_workspace_size() {
#ifdef FUSEDLAYERS_WITH_CUDA
  return fusedlayers::kCublasLtWorkspaceBytes;
#else
  return 0;
#endif
}
