// CPU ReLU*scale: one pass, element-wise, parallel over blocks of whole mask words; branch-free
// selects so the loops vectorize.
#include "relu_scale.h"

#include <algorithm>

#include "cpu_types.h"

namespace fusedlayers {
namespace {
constexpr int64_t kGrainWords = 1024;  // 32K elements per task
}

void relu_scale_forward_cpu(const void* x, void* y, uint32_t* mask, int64_t n, double alpha,
                            DType dtype, const ParallelFor& parallel_for) {
  if (n < 0) fail("relu_scale: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    const A a = static_cast<A>(alpha);
    parallel_for(relu_scale_mask_words(n), kGrainWords, [&](int64_t w_begin, int64_t w_end) {
      const int64_t end = std::min(n, w_end * 32);
      if (mask) {  // before y: y may alias x
        for (int64_t w = w_begin; w < w_end; ++w) {
          const int64_t e = std::min<int64_t>(32, n - w * 32);
          uint32_t word = 0;
          for (int64_t j = 0; j < e; ++j)
            word |= uint32_t(!(cpu::to_acc(xp[w * 32 + j]) <= A(0))) << j;
          mask[w] = word;
        }
      }
      for (int64_t i = w_begin * 32; i < end; ++i) {
        const A v = cpu::to_acc(xp[i]);
        // v < 0 is false for NaN, so NaN passes through as in torch.relu.
        yp[i] = cpu::from_acc<T>((v < A(0) ? A(0) : v) * a);
      }
    });
  });
}

void relu_scale_backward_cpu(const void* dy, const uint32_t* mask, void* dx, int64_t n,
                             double alpha, DType dtype, const ParallelFor& parallel_for) {
  if (n < 0) fail("relu_scale_backward: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* dyp = static_cast<const T*>(dy);
    T* dxp = static_cast<T*>(dx);
    const A a = static_cast<A>(alpha);
    parallel_for(relu_scale_mask_words(n), kGrainWords, [&](int64_t w_begin, int64_t w_end) {
      for (int64_t w = w_begin; w < w_end; ++w) {
        const uint32_t word = mask[w];
        const int64_t e = std::min<int64_t>(32, n - w * 32);
        for (int64_t j = 0; j < e; ++j) {
          const A g = cpu::to_acc(dyp[w * 32 + j]) * a;
          dxp[w * 32 + j] = cpu::from_acc<T>((word >> j) & 1u ? g : A(0));
        }
      }
    });
  });
}

}  // namespace fusedlayers
