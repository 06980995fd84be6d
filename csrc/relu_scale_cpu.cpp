// CPU ReLU*scale: one pass, element-wise, parallel over contiguous blocks; branch-free selects
// so the loops vectorize.
#include "relu_scale.h"

#include "cpu_types.h"

namespace fusedlayers {
namespace {
constexpr int64_t kGrain = 32768;
}

void relu_scale_forward_cpu(const void* x, void* y, int64_t n, double alpha, DType dtype,
                            const ParallelFor& parallel_for) {
  if (n < 0) fail("relu_scale: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    const A a = static_cast<A>(alpha);
    parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A v = cpu::to_acc(xp[i]);
        // v < 0 is false for NaN, so NaN passes through as in torch.relu.
        yp[i] = cpu::from_acc<T>((v < A(0) ? A(0) : v) * a);
      }
    });
  });
}

void relu_scale_backward_cpu(const void* dy, const void* x, void* dx, int64_t n, double alpha,
                             DType dtype, const ParallelFor& parallel_for) {
  if (n < 0) fail("relu_scale_backward: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* dyp = static_cast<const T*>(dy);
    const T* xp = static_cast<const T*>(x);
    T* dxp = static_cast<T*>(dx);
    const A a = static_cast<A>(alpha);
    parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A g = cpu::to_acc(dyp[i]) * a;
        dxp[i] = cpu::from_acc<T>(cpu::to_acc(xp[i]) <= A(0) ? A(0) : g);
      }
    });
  });
}

}  // namespace fusedlayers
