// CPU FP8 quantization: 128x128 tiles in parallel, each staged in float32, then each 1x128
// block's or the tile's amax and its values (x's rows and x^T's, each by its scaling), in loops the compiler
// vectorizes (every target clone). A value is fp8.h's rule computed from the exact product: x * s
// in double is exact (24 + 24 significant bits), and rounding it once to the format's grid (to
// nearest even, saturating) is what fp8::quantize does with the float product and its residual,
// so the bits are the CUDA kernels'.
#include <algorithm>
#include <cstring>

#include "fp8/fp8.h"
#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

using cpu::bits_of;

// fp8.h's encoding constants of a format, and the two powers of two encode_exact needs.
template <Fp8Format F>
struct Format {
  static constexpr int kMan = fp8::mantissa_bits(F), kBias = fp8::exponent_bias(F);
  static constexpr uint64_t kMaxCode = fp8::max_code(F);
  // the smallest normal, 2^(1 - bias), and the multiplier 2^(man + bias - 1) that puts the
  // subnormal step at 1
  static constexpr double kMinNormal = F == Fp8Format::kE4M3 ? 0x1p-6 : 0x1p-14;
  static constexpr double kSubnormalScale = F == Fp8Format::kE4M3 ? 0x1p9 : 0x1p16;
};

FUSEDLAYERS_INLINE uint64_t bits64(double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  return u;
}

// The code of the exact product d (finite): its magnitude rounded to nearest even on the
// format's grid and saturated, with d's sign. Normals: the double's exponent and mantissa bits
// rounded at the format's last mantissa bit, the exponent rebiased (a carry into the exponent
// is the next binade's code); subnormals: d scaled so that the step is 1, rounded to an integer
// by adding 2^52 (whose ulp is 1) and reading the low bits.
template <Fp8Format F>
FUSEDLAYERS_INLINE uint8_t encode_exact(double d) {
  using Fmt = Format<F>;
  constexpr int kDrop = 52 - Fmt::kMan;
  const uint64_t u = bits64(d), au = u & 0x7fffffffffffffffull;
  const uint64_t rounded = (au + ((1ull << (kDrop - 1)) - 1) + ((au >> kDrop) & 1)) >> kDrop;
  const uint64_t normal = rounded - (uint64_t(1023 - Fmt::kBias) << Fmt::kMan);
  double a;
  std::memcpy(&a, &au, 8);
  const uint64_t sub = bits64(a * Fmt::kSubnormalScale + 0x1p52) - bits64(0x1p52);
  const uint64_t code = std::min(a < Fmt::kMinNormal ? sub : normal, Fmt::kMaxCode);
  return uint8_t(code | ((u >> 56) & 0x80));
}

// max |x| over n values as bits: unsigned order is float order for |x|, NaN above Inf, so a NaN
// is kept as fp8.h's amax keeps it.
FUSEDLAYERS_CPU_CLONES uint32_t amax_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, bits_of(x[i]) & 0x7fffffffu);
  return m;
}

// m[i] = max(m[i], |x[i]|'s bits): the columns' amaxes, a row at a time.
FUSEDLAYERS_CPU_CLONES void column_amax_bits(const float* x, uint32_t* m, int64_t n) {
  for (int64_t i = 0; i < n; ++i) m[i] = std::max(m[i], bits_of(x[i]) & 0x7fffffffu);
}

// n values with one multiplier s (a NaN s: a block with a NaN or Inf, every code 0x7F).
template <Fp8Format F>
FUSEDLAYERS_CPU_CLONES void quantize_row(const float* x, float s, int64_t n, uint8_t* q) {
  if (s != s) {
    std::memset(q, 0x7f, size_t(n));
    return;
  }
  const double sd = s;
  for (int64_t i = 0; i < n; ++i) q[i] = encode_exact<F>(double(x[i]) * sd);
}

// n values of a row, value i with its column's multiplier s[i].
template <Fp8Format F>
FUSEDLAYERS_CPU_CLONES void quantize_row_by_column(const float* x, const float* s, int64_t n,
                                                   uint8_t* q) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t code = encode_exact<F>(double(x[i]) * double(s[i]));
    q[i] = s[i] != s[i] ? uint8_t(0x7f) : code;
  }
}

template <typename T, Fp8Format F>
void quantize_stripes(const Fp8Quantize& a, const T* x, int64_t rows, int64_t cols,
                      const ParallelFor& parallel_for) {
  const bool pow2 = a.power_of_2_scales;
  const int64_t stripes = (rows + kFp8Block - 1) / kFp8Block;
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
  const int64_t ld = fp8_scale_sizes(a.scaling, rows, cols, false).ld;
  const int64_t ld_t = fp8_scale_sizes(a.scaling_t, rows, cols, true).ld;
  // the tile's amax scales x's rows (128x128) or x^T's (scaling_t 128x128)
  const bool tile_amax = a.scaling == Fp8Scaling::kBlock128x128 ||
                         (a.q_t && a.scaling_t == Fp8Scaling::kBlock128x128);
  const float tensor_s = a.scaling == Fp8Scaling::kTensorwise ? fp8::multiplier(*a.amax, F, pow2)
                                                              : 0.f;
  parallel_for(stripes * col_blocks, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t kB = kFp8Block;
    cpu::Row<float> tile(static_cast<size_t>(kB * kB)), col_s(static_cast<size_t>(kB));
    cpu::Row<uint32_t> col_max(static_cast<size_t>(kB));
    cpu::Row<uint8_t> codes(a.q_t ? static_cast<size_t>(kB * kB) : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t stripe = t / col_blocks, cb = t % col_blocks;
      const int64_t r0 = stripe * kB, nr = std::min(rows - r0, kB);
      const int64_t c0 = cb * kB, nc = std::min(cols - c0, kB);
      for (int64_t i = 0; i < nr; ++i) cpu::load(x + (r0 + i) * cols + c0, &tile[i * kB], nc);
      float tile_s = tensor_s;
      if (tile_amax) {
        uint32_t m = 0;
        for (int64_t i = 0; i < nr; ++i) m = std::max(m, amax_bits(&tile[i * kB], nc));
        tile_s = fp8::multiplier(cpu::float_of(m), F, pow2);
        if (a.scaling == Fp8Scaling::kBlock128x128) a.scale_inv[stripe * ld + cb] = 1.f / tile_s;
        if (a.q_t) a.scale_inv_t[cb * ld_t + stripe] = 1.f / tile_s;
      }
      for (int64_t i = 0; i < nr; ++i) {
        float s = tile_s;
        if (a.scaling == Fp8Scaling::kBlock1x128) {
          s = fp8::multiplier(cpu::float_of(amax_bits(&tile[i * kB], nc)), F, pow2);
          a.scale_inv[cb * rows + r0 + i] = 1.f / s;
        }
        quantize_row<F>(&tile[i * kB], s, nc, a.q + (r0 + i) * cols + c0);
      }
      if (!a.q_t) continue;
      // x^T's rows: the tile's columns over its rows, quantized a row of x at a time into
      // codes, then written transposed
      std::fill(col_s.begin(), col_s.end(), tile_s);
      if (a.scaling_t == Fp8Scaling::kBlock1x128) {
        std::fill(col_max.begin(), col_max.end(), 0u);
        for (int64_t i = 0; i < nr; ++i) column_amax_bits(&tile[i * kB], col_max.data(), nc);
        for (int64_t j = 0; j < nc; ++j) {
          col_s[j] = fp8::multiplier(cpu::float_of(col_max[j]), F, pow2);
          a.scale_inv_t[stripe * cols + c0 + j] = 1.f / col_s[j];
        }
      }
      for (int64_t i = 0; i < nr; ++i)
        quantize_row_by_column<F>(&tile[i * kB], col_s.data(), nc, &codes[i * kB]);
      for (int64_t j = 0; j < nc; ++j) {
        uint8_t* dst = a.q_t + (c0 + j) * rows + r0;
        for (int64_t i = 0; i < nr; ++i) dst[i] = codes[i * kB + j];
      }
    }
  });
}

// The tensor's amax (max is exact: the split does not change it), in chunks staged in float.
template <typename T>
float tensor_amax(const T* x, int64_t n, const ParallelFor& parallel_for) {
  constexpr int64_t kChunk = 65536, kStage = 4096;
  std::vector<uint32_t> part(size_t(std::max<int64_t>(1, (n + kChunk - 1) / kChunk)), 0u);
  parallel_for(int64_t(part.size()), 1, [&](int64_t begin, int64_t end) {
    cpu::Row<float> staged(static_cast<size_t>(kStage));
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = p * kChunk; i < std::min(n, (p + 1) * kChunk); i += kStage) {
        const int64_t len = std::min(kStage, n - i);
        cpu::load(x + i, staged.data(), len);
        part[p] = std::max(part[p], amax_bits(staged.data(), len));
      }
  });
  return cpu::float_of(*std::max_element(part.begin(), part.end()));
}

}  // namespace

void fp8_quantize_cpu(const Fp8Quantize& a, int64_t rows, int64_t cols,
                      const ParallelFor& parallel_for) {
  cpu::dispatch(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      const T* x = static_cast<const T*>(a.x.data);
      if (a.scaling == Fp8Scaling::kTensorwise) {  // pass 1: the amax; pass 2: the values
        *a.amax = tensor_amax(x, rows * cols, parallel_for);
        const float s = fp8::multiplier(*a.amax, a.format, a.power_of_2_scales);
        *a.scale_inv = 1.f / s;
        if (a.scale_inv_t) *a.scale_inv_t = 1.f / s;
      }
      if (rows * cols == 0) return;
      if (a.format == Fp8Format::kE4M3)
        quantize_stripes<T, Fp8Format::kE4M3>(a, x, rows, cols, parallel_for);
      else
        quantize_stripes<T, Fp8Format::kE5M2>(a, x, rows, cols, parallel_for);
    }
  });
}

}  // namespace fusedlayers
