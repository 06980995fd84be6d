// The FP8 GEMM's argument checks, the rules on every device (contract: fp8/fp8_gemm.h). Apart
// from the op's entry point (fp8_gemm_op.cpp) so that a library without csrc's cuBLASLt GEMMs
// (TensorFlow's, which runs the CPU kernel alone) checks by the same rules.
#include "fp8/fp8_gemm.h"

namespace fusedlayers {
namespace {

std::string shape(int64_t d0, int64_t d1) {
  return "[" + std::to_string(d0) + ", " + std::to_string(d1) + "]";
}

// The operand's scale_inv shape against the rule's (fp8.h).
void check_scales(const char* name, const Fp8Operand& o) {
  const Fp8ScaleSizes s = fp8_scale_sizes(o.scaling, o.rows, o.cols, false);
  const int64_t want_rows = o.scaling == Fp8Scaling::kBlock1x128 ? s.dim1 : s.dim0;
  const int64_t want_cols = o.scaling == Fp8Scaling::kBlock1x128 ? s.dim0 : s.dim1;
  if (o.scale_rows != want_rows || o.scale_cols != want_cols)
    arg_error("fp8_gemm", std::string(name) + "_scale_inv of " + name + " " +
                              shape(o.rows, o.cols) + " scaled " + fp8_scaling_name(o.scaling) +
                              " must have shape " +
                              (o.scaling == Fp8Scaling::kTensorwise
                                   ? std::string("[] (one value)")
                                   : shape(want_rows, want_cols)) +
                              ", got " + shape(o.scale_rows, o.scale_cols));
}

}  // namespace

void fp8_scales_from_storage(Fp8Operand& o, const int64_t* dims, int64_t ndim) {
  if (ndim == 0) {
    o.scale_rows = o.scale_cols = 1;
  } else if (ndim == 2 && o.scaling == Fp8Scaling::kBlock1x128) {
    o.scale_rows = dims[1];
    o.scale_cols = dims[0];
  } else if (ndim == 2) {  // 128x128's tiles, their padding cut
    const Fp8ScaleSizes want = fp8_scale_sizes(o.scaling, o.rows, o.cols, false);
    o.scale_rows = dims[0];
    o.scale_cols = dims[1] == want.ld ? want.dim1 : dims[1];
  } else {
    o.scale_rows = o.scale_cols = -1;
  }
}

void fp8_gemm_check(const Fp8Gemm& g) {
  const char* op = "fp8_gemm";
  const int64_t m = g.m(), n = g.n(), k = g.k();
  if (m < 0 || n < 0 || k < 0) arg_error(op, "sizes must not be negative");
  if (g.b.cols != k)
    arg_error(op, "a [m, k] and b [n, k] must share k, got a " + shape(g.a.rows, g.a.cols) +
                      " and b " + shape(g.b.rows, g.b.cols));
  const Fp8Scaling sa = g.a.scaling, sb = g.b.scaling;
  const bool tensorwise = sa == Fp8Scaling::kTensorwise && sb == Fp8Scaling::kTensorwise;
  const bool blockwise = sa == Fp8Scaling::kBlock1x128 &&
                         (sb == Fp8Scaling::kBlock128x128 || sb == Fp8Scaling::kBlock1x128);
  if (!tensorwise && !blockwise)
    arg_error(op, std::string("a's and b's scalings must be tensorwise and tensorwise, 1x128 and "
                              "128x128, or 1x128 and 1x128, got ") +
                      fp8_scaling_name(sa) + " and " + fp8_scaling_name(sb));
  check_scales("a", g.a);
  check_scales("b", g.b);
  if (g.a.format == Fp8Format::kE5M2 && g.b.format == Fp8Format::kE5M2)
    arg_error(op, "a and b cannot both be E5M2 (no FP8 GEMM takes it)");
  if (blockwise && (g.a.format != Fp8Format::kE4M3 || g.b.format != Fp8Format::kE4M3))
    arg_error(op, "blockwise scalings take E4M3 operands, got E5M2");
  if (k <= 0 || k % 16 != 0)
    arg_error(op, "the contracted size k must be a positive multiple of 16, got " +
                      std::to_string(k));
  if (n % 16 != 0)
    arg_error(op, "b's rows n (d's columns) must be a multiple of 16, got " +
                      std::to_string(n));
  if (blockwise && g.fast_accum)
    arg_error(op, "fast_accum takes tensorwise scaling alone (block scales are applied where "
                  "the FP8 accumulators are promoted)");
  if (blockwise && m % 16 != 0)
    arg_error(op, "a's rows m must be a multiple of 16 with block scales, got " +
                      std::to_string(m));
  if (g.bias && g.out_dtype == DType::kFloat32)
    arg_error(op, "a bias needs a bfloat16 or float16 output (FP8 GEMMs add a float32 output's "
                  "bias in no epilogue)");
  if (g.out_dtype == DType::kFloat64)
    arg_error(op, "out_dtype must be float32, float16 or bfloat16, got float64",
              Error::Kind::kType);
}

}  // namespace fusedlayers
