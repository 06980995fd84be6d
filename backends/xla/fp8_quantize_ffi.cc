// XLA FFI handler fusedlayers_fp8_quantize on csrc/fp8/fp8.h, which checks the arguments and owns
// the scaling rule. Results in csrc's storage layouts (fusedlayers/jax/fp8.py presents them as
// torch's binding does): q (x's shape), scale_inv ([blocks, rows] for 1x128, [row tiles, padded
// column tiles] for 128x128, one value for tensorwise), q_t and scale_inv_t (empty without
// transpose; scale_inv_t in scaling_t's storage), and `amax`, one float32 of workspace for
// tensorwise scaling (else empty).
#include "backends/xla/ffi_binding.h"
#include "fp8/fp8.h"

namespace fusedlayers::xla_binding {
namespace {

ffi::DataType element_type(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? ffi::DataType::F8E4M3FN : ffi::DataType::F8E5M2;
}

ffi::Error quantize(Device& device, AnyBuffer x, Out q, Out scale_inv, Out q_t, Out scale_inv_t,
                    Out amax, std::string_view scaling, std::string_view format, bool transpose,
                    bool power_of_2_scales, std::string_view scaling_t) {
  return call_csrc([&] {
    const char* op = "fp8_quantize";
    Fp8Quantize a;
    a.x = ref(x);
    a.format = parse_fp8_format(op, std::string(format));
    a.scaling = parse_fp8_scaling(op, std::string(scaling));
    a.scaling_t = parse_fp8_scaling(op, std::string(scaling_t), "scaling_t");
    a.power_of_2_scales = power_of_2_scales;
    if (q->element_type() != element_type(a.format) ||
        (transpose && q_t->element_type() != element_type(a.format)))
      fail("fp8_quantize: the q results' dtype is not the format's");
    fp8_quantize_check(a);
    a.q = static_cast<uint8_t*>(data(q));
    a.scale_inv = static_cast<float*>(data(scale_inv));
    if (transpose) {
      a.q_t = static_cast<uint8_t*>(data(q_t));
      a.scale_inv_t = static_cast<float*>(data(scale_inv_t));
    }
    if (a.scaling == Fp8Scaling::kTensorwise) a.amax = static_cast<float*>(data(amax));
    fp8_quantize(a, device.exec());
  });
}

const auto kSig = [](auto b) {
  return std::move(b).template Arg<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Ret<AnyBuffer>().template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>().template Attr<std::string_view>("scaling")
      .template Attr<std::string_view>("format").template Attr<bool>("transpose")
      .template Attr<bool>("power_of_2_scales").template Attr<std::string_view>("scaling_t");
};

}  // namespace
}  // namespace fusedlayers::xla_binding

FUSEDLAYERS_XLA_HANDLERS(fp8_quantize, ::fusedlayers::xla_binding::quantize,
                         ::fusedlayers::xla_binding::kSig);

// The op's argument checks for a trace (ffi_binding.h, TracedTensor).
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_fp8_quantize_check(
    const fusedlayers::xla_binding::TracedTensor* x, const char* scaling, const char* format,
    const char* scaling_t, char* msg, size_t msg_size) {
  using namespace fusedlayers;
  using namespace fusedlayers::xla_binding;
  return check_for_trace(
      [&] {
        Fp8Quantize a;
        a.x = ref(x);
        a.format = parse_fp8_format("fp8_quantize", format);
        a.scaling = parse_fp8_scaling("fp8_quantize", scaling);
        a.scaling_t = parse_fp8_scaling("fp8_quantize", scaling_t, "scaling_t");
        fp8_quantize_check(a);
      },
      msg, msg_size);
}

// csrc's scale_inv storage for `scaling` of values rows x cols (or of their transpose): dims
// {dim0, dim1} and the stored row length ld in out[0..2] (fp8_scale_sizes); 1 for an unknown
// scaling.
FUSEDLAYERS_XLA_EXPORT int fusedlayers_xla_fp8_scale_sizes(const char* scaling, int64_t rows,
                                                           int64_t cols, bool transposed,
                                                           int64_t* out) {
  using namespace fusedlayers;
  try {
    const Fp8ScaleSizes s =
        fp8_scale_sizes(parse_fp8_scaling("fp8_quantize", scaling), rows, cols, transposed);
    out[0] = s.dim0;
    out[1] = s.dim1;
    out[2] = s.ld;
    return 0;
  } catch (const Error&) {
    return 1;
  }
}
