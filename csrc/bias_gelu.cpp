// CPU bias + GELU epilogue: a row per task; dbias summed per fixed chunk of rows into the
// workspace, then over chunks in chunk order (thread-count invariant).
#include "bias_gelu.h"

#include <algorithm>
#include <cmath>

#include "cpu_types.h"

namespace fusedlayers {
namespace {

constexpr int64_t kMaxChunks = 64;

int64_t num_chunks(int64_t rows) { return std::max<int64_t>(1, std::min(rows, kMaxChunks)); }

void check_sizes(const char* op, int64_t rows, int64_t cols) {
  if (rows < 0) fail(std::string(op) + ": rows must be >= 0, got " + std::to_string(rows));
  if (cols < 0) fail(std::string(op) + ": cols must be >= 0, got " + std::to_string(cols));
}

template <typename A> constexpr A kSqrt1_2 = A(0.70710678118654752440);
template <typename A> constexpr A kSqrt2OverPi = A(0.79788456080286535588);
template <typename A> constexpr A kInvSqrt2Pi = A(0.39894228040143267794);
template <typename A> constexpr A kCoeff = A(0.044715);

template <typename A>
A gelu(A u, GeluApprox approx) {
  if (approx == GeluApprox::kTanh) {
    const A inner = kSqrt2OverPi<A> * (u + kCoeff<A> * u * u * u);
    return A(0.5) * u * (A(1) + std::tanh(inner));
  }
  return A(0.5) * u * (A(1) + std::erf(u * kSqrt1_2<A>));
}

template <typename A>
A gelu_grad(A u, GeluApprox approx) {
  if (approx == GeluApprox::kTanh) {
    const A u2 = u * u;
    const A t = std::tanh(kSqrt2OverPi<A> * (u + kCoeff<A> * u2 * u));
    const A dinner = kSqrt2OverPi<A> * (A(1) + A(3) * kCoeff<A> * u2);
    return A(0.5) * (A(1) + t) + A(0.5) * u * (A(1) - t * t) * dinner;
  }
  const A cdf = A(0.5) * (A(1) + std::erf(u * kSqrt1_2<A>));
  const A pdf = kInvSqrt2Pi<A> * std::exp(A(-0.5) * u * u);
  return cdf + u * pdf;
}

}  // namespace

void bias_gelu_forward_cpu(const void* h, const void* bias, void* pre, void* y, int64_t rows,
                           int64_t cols, GeluApprox approx, DType dtype,
                           const ParallelFor& parallel_for) {
  check_sizes("bias_gelu", rows, cols);
  if (rows == 0 || cols == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* hp = static_cast<const T*>(h);
    const T* bp = static_cast<const T*>(bias);
    T* prep = static_cast<T*>(pre);
    T* yp = static_cast<T*>(y);
    const int64_t grain = std::max<int64_t>(1, 4096 / cols);
    parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = r * cols, e = (r + 1) * cols, k = 0; j < e; ++j, ++k) {
          A u = cpu::to_acc(hp[j]);
          if (bp) u += cpu::to_acc(bp[k]);
          // The unfused layer rounds the linear output before GELU; do the same so the saved
          // pre-activation and y agree with it.
          const T pre_t = cpu::from_acc<T>(u);
          prep[j] = pre_t;
          yp[j] = cpu::from_acc<T>(gelu<A>(cpu::to_acc(pre_t), approx));
        }
      }
    });
  });
}

size_t bias_gelu_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype) {
  check_sizes("bias_gelu_backward", rows, cols);
  const size_t acc_bytes = dtype == DType::kFloat64 ? 8 : 4;
  return static_cast<size_t>(num_chunks(rows)) * static_cast<size_t>(cols) * acc_bytes;
}

void bias_gelu_backward_cpu(const void* dy, const void* pre, void* dpre, void* dbias,
                            void* workspace, int64_t rows, int64_t cols, GeluApprox approx,
                            DType dtype, const ParallelFor& parallel_for) {
  check_sizes("bias_gelu_backward", rows, cols);
  if (dbias && !workspace) fail("bias_gelu_backward: workspace is null");
  if (cols == 0) return;
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    const T* dyp = static_cast<const T*>(dy);
    const T* prep = static_cast<const T*>(pre);
    T* dprep = static_cast<T*>(dpre);
    A* partial = static_cast<A*>(workspace);  // [chunk][cols]
    const int64_t chunks = num_chunks(rows);
    const int64_t per_chunk = (rows + chunks - 1) / chunks;
    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pb = dbias ? partial + c * cols : nullptr;
        if (pb) std::fill(pb, pb + cols, A(0));
        const int64_t rend = std::min(rows, (c + 1) * per_chunk);
        for (int64_t r = c * per_chunk; r < rend; ++r) {
          for (int64_t j = r * cols, e = (r + 1) * cols, k = 0; j < e; ++j, ++k) {
            const T d = cpu::from_acc<T>(cpu::to_acc(dyp[j]) *
                                         gelu_grad<A>(cpu::to_acc(prep[j]), approx));
            dprep[j] = d;
            // dbias sums the rounded dpre, as the unfused Linear's bias gradient does.
            if (pb) pb[k] += cpu::to_acc(d);
          }
        }
      }
    });
    if (!dbias) return;
    T* dbp = static_cast<T*>(dbias);
    parallel_for(cols, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        A s = 0;
        for (int64_t c = 0; c < chunks; ++c) s += partial[c * cols + j];  // fixed order
        dbp[j] = cpu::from_acc<T>(s);
      }
    });
  });
}

}  // namespace fusedlayers
