// The FP8 quantize op: argument checks, scale shapes, then the kernels (contract: fp8/fp8.h).
#include "fp8/fp8.h"

namespace fusedlayers {

Fp8Format parse_fp8_format(const char* op, const std::string& format) {
  if (format == "e4m3") return Fp8Format::kE4M3;
  if (format == "e5m2") return Fp8Format::kE5M2;
  arg_error(op, "format must be 'e4m3' or 'e5m2', got '" + format + "'");
}

Fp8Scaling parse_fp8_scaling(const char* op, const std::string& scaling, const char* arg) {
  if (scaling == "tensorwise") return Fp8Scaling::kTensorwise;
  if (scaling == "1x128") return Fp8Scaling::kBlock1x128;
  if (scaling == "128x128") return Fp8Scaling::kBlock128x128;
  arg_error(op, std::string(arg) + " must be 'tensorwise', '1x128' or '128x128', got '" +
                    scaling + "'");
}

const char* fp8_scaling_name(Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::kTensorwise: return "tensorwise";
    case Fp8Scaling::kBlock1x128: return "1x128";
    case Fp8Scaling::kBlock128x128: return "128x128";
  }
  return "?";
}

Fp8ScaleSizes fp8_scale_sizes(Fp8Scaling scaling, int64_t rows, int64_t cols, bool transposed) {
  if (transposed) std::swap(rows, cols);
  const auto blocks = [](int64_t n) { return (n + kFp8Block - 1) / kFp8Block; };
  switch (scaling) {
    case Fp8Scaling::kTensorwise: return {1, 1, 1};
    case Fp8Scaling::kBlock1x128: return {blocks(cols), rows, rows};
    case Fp8Scaling::kBlock128x128: return {blocks(rows), blocks(cols), (blocks(cols) + 3) / 4 * 4};
  }
  return {0, 0, 0};
}

void fp8_target_check(const char* op, const Fp8Target& t) {
  if (t.scaling_t != t.scaling &&
      !(t.scaling == Fp8Scaling::kBlock1x128 && t.scaling_t == Fp8Scaling::kBlock128x128))
    arg_error(op, std::string("scaling_t must be scaling ('") + fp8_scaling_name(t.scaling) +
                      "'), or '128x128' with scaling '1x128', got '" +
                      fp8_scaling_name(t.scaling_t) + "'");
}

RowsCols fp8_quantize_check(const Fp8Quantize& a) {
  const char* op = "fp8_quantize";
  fp8_target_check(op, a);
  const Sizes& s = a.x.sizes;
  if (a.x.dtype == DType::kFloat64)
    arg_error(op, "x must be float32, float16 or bfloat16, got float64", Error::Kind::kType);
  if (s.size < 1) arg_error(op, "x must have at least 1 dimension, got a scalar");
  const int64_t cols = s[s.size - 1];
  return {cols == 0 ? 0 : s.numel() / cols, cols};
}

void fp8_quantize(const Fp8Quantize& a, const Exec& exec) {
  const RowsCols rc = fp8_quantize_check(a);
  // no values: no blocks, and a tensorwise scale of 1 (amax 0), which the kernels write
  if (rc.rows * rc.cols == 0 && a.scaling != Fp8Scaling::kTensorwise) return;
  FUSEDLAYERS_ON_DEVICE(exec, fp8_quantize_cpu(a, rc.rows, rc.cols, exec.parallel_for),
                        fp8_quantize_cuda(a, rc.rows, rc.cols, exec.stream));
}

}  // namespace fusedlayers
