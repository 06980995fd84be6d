// The CPU FP8 GEMM, the reference every device and framework is measured against: both operands
// dequantized to float32 (a as it is, b transposed to k x n), then d's rows in parallel, each
// output a float32 sum over k in order (the inner loop runs over d's columns, so it vectorizes
// without reassociating any sum).
#include <algorithm>
#include <vector>

#include "fp8/fp8_gemm.h"
#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

// The scale_inv of operand o's value (row, col) (fp8.h's layouts; rows: o's row count).
float scale_of(const Fp8Operand& o, int64_t rows, int64_t cols, int64_t row, int64_t col) {
  const int64_t ld = fp8_scale_sizes(o.scaling, rows, cols, false).ld;
  switch (o.scaling) {
    case Fp8Scaling::kTensorwise: return o.scale_inv[0];
    case Fp8Scaling::kBlock1x128: return o.scale_inv[(col / kFp8Block) * rows + row];
    case Fp8Scaling::kBlock128x128:
      return o.scale_inv[(row / kFp8Block) * ld + col / kFp8Block];
  }
  return 0.f;
}

// o (rows x k) dequantized; transposed: stored k x rows.
std::vector<float> dequantize(const Fp8Operand& o, int64_t rows, int64_t k, bool transposed,
                              const ParallelFor& parallel_for) {
  std::vector<float> out(size_t(rows * k));
  float lut[256];
  for (int q = 0; q < 256; ++q) lut[q] = fp8::decode(uint8_t(q), o.format);
  parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c0 = 0; c0 < k; c0 += kFp8Block) {
        const float s = scale_of(o, rows, k, r, c0);
        for (int64_t c = c0; c < std::min(k, c0 + kFp8Block); ++c)
          out[transposed ? c * rows + r : r * k + c] = lut[o.data[r * k + c]] * s;
      }
  });
  return out;
}

// y += alpha x over n values.
FUSEDLAYERS_CPU_CLONES void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += alpha * x[j];
}

}  // namespace

void fp8_gemm_cpu(const Fp8Gemm& g, const ParallelFor& parallel_for) {
  const int64_t m = g.m(), n = g.n(), k = g.k();
  const std::vector<float> a = dequantize(g.a, m, k, false, parallel_for);
  const std::vector<float> bt = dequantize(g.b, n, k, true, parallel_for);
  cpu::dispatch(g.out_dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      T* d = static_cast<T*>(g.d);
      const T* bias = static_cast<const T*>(g.bias);
      parallel_for(m, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(static_cast<size_t>(n));
        for (int64_t i = begin; i < end; ++i) {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t p = 0; p < k; ++p) axpy(a[i * k + p], bt.data() + p * n, acc.data(), n);
          for (int64_t j = 0; j < n; ++j)
            d[i * n + j] = cpu::from_acc<T>(bias ? acc[j] + cpu::to_acc(bias[j]) : acc[j]);
        }
      });
    }
  });
}

}  // namespace fusedlayers
