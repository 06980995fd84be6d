// CPU FP8 quantization: 128-row stripes in parallel; per stripe, each 1x128 block's or 128x128
// tile's amax, then its values, with fp8.h's scalar rules (the CUDA kernels' bits).
#include <algorithm>
#include <vector>

#include "fp8/fp8.h"
#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

using cpu::to_acc;

template <typename T>
void quantize_stripes(const Fp8Quantize& a, const T* x, int64_t rows, int64_t cols,
                      const ParallelFor& parallel_for) {
  const Fp8Format f = a.format;
  const bool pow2 = a.power_of_2_scales;
  const int64_t stripes = (rows + kFp8Block - 1) / kFp8Block;
  const int64_t col_blocks = (cols + kFp8Block - 1) / kFp8Block;
  const int64_t ld = fp8_scale_sizes(a.scaling, rows, cols, false).ld;
  const int64_t ld_t = fp8_scale_sizes(a.scaling, rows, cols, true).ld;
  const float tensor_s = a.scaling == Fp8Scaling::kTensorwise ? fp8::multiplier(*a.amax, f, pow2)
                                                              : 0.f;
  parallel_for(stripes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> col_s(a.q_t ? kFp8Block : 0);
    for (int64_t stripe = begin; stripe < end; ++stripe) {
      const int64_t r0 = stripe * kFp8Block, r1 = std::min(rows, r0 + kFp8Block);
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t c0 = cb * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
        float tile_s = tensor_s;
        if (a.scaling == Fp8Scaling::kBlock128x128) {
          float amax = 0.f;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c) amax = fp8::amax_step(amax, to_acc(x[r * cols + c]));
          tile_s = fp8::multiplier(amax, f, pow2);
          a.scale_inv[stripe * ld + cb] = 1.f / tile_s;
          if (a.q_t) a.scale_inv_t[cb * ld_t + stripe] = 1.f / tile_s;
        }
        for (int64_t r = r0; r < r1; ++r) {
          const T* xr = x + r * cols;
          float s = tile_s;
          if (a.scaling == Fp8Scaling::kBlock1x128) {
            float amax = 0.f;
            for (int64_t c = c0; c < c1; ++c) amax = fp8::amax_step(amax, to_acc(xr[c]));
            s = fp8::multiplier(amax, f, pow2);
            a.scale_inv[cb * rows + r] = 1.f / s;
          }
          for (int64_t c = c0; c < c1; ++c) a.q[r * cols + c] = fp8::quantize(to_acc(xr[c]), s, f);
        }
        if (!a.q_t) continue;
        // x^T's rows: the columns c0..c1 over this stripe's rows
        for (int64_t c = c0; c < c1; ++c) {
          float s = tile_s;
          if (a.scaling == Fp8Scaling::kBlock1x128) {
            float amax = 0.f;
            for (int64_t r = r0; r < r1; ++r) amax = fp8::amax_step(amax, to_acc(x[r * cols + c]));
            s = fp8::multiplier(amax, f, pow2);
            a.scale_inv_t[stripe * cols + c] = 1.f / s;
          }
          col_s[c - c0] = s;
        }
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c)
            a.q_t[c * rows + r] = fp8::quantize(to_acc(x[r * cols + c]), col_s[c - c0], f);
      }
    }
  });
}

}  // namespace

void fp8_quantize_cpu(const Fp8Quantize& a, int64_t rows, int64_t cols,
                      const ParallelFor& parallel_for) {
  cpu::dispatch(a.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x.data);
    if (a.scaling == Fp8Scaling::kTensorwise) {
      // pass 1: the tensor's amax (max is exact: the split does not change it)
      const int64_t n = rows * cols;
      std::vector<float> part(std::max<int64_t>(1, (n + 65535) / 65536), 0.f);
      parallel_for(int64_t(part.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          float amax = 0.f;
          for (int64_t i = p * 65536; i < std::min(n, (p + 1) * 65536); ++i)
            amax = fp8::amax_step(amax, to_acc(x[i]));
          part[p] = amax;
        }
      });
      float amax = 0.f;
      for (float p : part) amax = fp8::amax_step(amax, p);
      *a.amax = amax;
      const float s = fp8::multiplier(amax, a.format, a.power_of_2_scales);
      *a.scale_inv = 1.f / s;
      if (a.scale_inv_t) *a.scale_inv_t = 1.f / s;
    }
    if (rows * cols > 0) quantize_stripes(a, x, rows, cols, parallel_for);
  });
}

}  // namespace fusedlayers
