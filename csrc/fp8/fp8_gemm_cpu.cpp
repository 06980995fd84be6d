// The CPU FP8 GEMM, the reference every device and framework is measured against: both operands
// dequantized to float32 (a as it is, b transposed to k x n), then d's rows in parallel, each
// output a float32 sum over k in order. Blocks of kRows rows x 16 columns of d are summed in
// registers (a row of b loaded once for kRows rows of a), 16 columns at once: vectorized
// without reassociating any sum.
#include <algorithm>
#include <cstring>
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

// o (rows x k) dequantized; transposed: stored k x rows. 16 rows at a time, so that the
// transposed writes fill whole cache lines.
std::vector<float> dequantize(const Fp8Operand& o, int64_t rows, int64_t k, bool transposed,
                              const ParallelFor& parallel_for) {
  std::vector<float> out(size_t(rows * k));
  float lut[256];
  for (int q = 0; q < 256; ++q) lut[q] = fp8::decode(uint8_t(q), o.format);
  parallel_for((rows + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin * 16; r0 < std::min(rows, end * 16); r0 += 16) {
      const int64_t nr = std::min<int64_t>(16, rows - r0);
      for (int64_t c0 = 0; c0 < k; c0 += kFp8Block) {
        const int64_t c1 = std::min(k, c0 + kFp8Block);
        float s[16];
        for (int64_t i = 0; i < nr; ++i) s[i] = scale_of(o, rows, k, r0 + i, c0);
        const uint8_t* q = o.data + r0 * k;
        if (transposed) {
          for (int64_t c = c0; c < c1; ++c)
            for (int64_t i = 0; i < nr; ++i) out[c * rows + r0 + i] = lut[q[i * k + c]] * s[i];
        } else {
          for (int64_t i = 0; i < nr; ++i)
            for (int64_t c = c0; c < c1; ++c) out[(r0 + i) * k + c] = lut[q[i * k + c]] * s[i];
        }
      }
    }
  });
  return out;
}

// A block of d: kRows rows (fewer at the end) by 16 columns (n is a multiple of 16: the op's
// rule), summed in registers as two 8-float vectors a row (GCC's vector extension: AVX
// registers in the AVX2 and AVX-512 clones; a 64-byte type would go through memory in the AVX2
// clone).
constexpr int64_t kRows = 4;
typedef float Vec8 __attribute__((vector_size(32)));

// out[r][j] = sum over p in order of a[i0 + r][p] * bt[p][j0 + j], r < R, j < 16.
template <int64_t R>
FUSEDLAYERS_CPU_CLONES void block_sums(const float* a, const float* bt, int64_t k, int64_t n,
                                       int64_t i0, int64_t j0, float* out) {
  Vec8 lo[R] = {}, hi[R] = {};
  for (int64_t p = 0; p < k; ++p) {
    Vec8 b_lo, b_hi;
    std::memcpy(&b_lo, bt + p * n + j0, sizeof b_lo);
    std::memcpy(&b_hi, bt + p * n + j0 + 8, sizeof b_hi);
    for (int64_t r = 0; r < R; ++r) {
      const float ap = a[(i0 + r) * k + p];
      lo[r] += ap * b_lo;
      hi[r] += ap * b_hi;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(out + r * 16, &lo[r], sizeof lo[r]);
    std::memcpy(out + r * 16 + 8, &hi[r], sizeof hi[r]);
  }
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
      parallel_for((m + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
        float acc[kRows * 16];
        // a strip of 16 columns of b at a time over the range's rows: the strip stays in cache
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
          for (int64_t i0 = begin * kRows; i0 < std::min(m, end * kRows); i0 += kRows) {
            const int64_t rows = std::min(kRows, m - i0);
            switch (rows) {  // the last rows of d: fewer than kRows
              case 4: block_sums<4>(a.data(), bt.data(), k, n, i0, j0, acc); break;
              case 3: block_sums<3>(a.data(), bt.data(), k, n, i0, j0, acc); break;
              case 2: block_sums<2>(a.data(), bt.data(), k, n, i0, j0, acc); break;
              default: block_sums<1>(a.data(), bt.data(), k, n, i0, j0, acc);
            }
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t j = 0; j < 16; ++j) {
                const float v = acc[r * 16 + j];
                d[(i0 + r) * n + j0 + j] =
                    cpu::from_acc<T>(bias ? v + cpu::to_acc(bias[j0 + j]) : v);
              }
          }
        }
      });
    }
  });
}

}  // namespace fusedlayers
