// CPU gated activations (math: gated.h): one pass over the rows, each element converted in
// registers (float16 rows staged in float, cpu::kStaged); the activations are cpu_gelu.h's, with
// IEEE subnormals whatever the framework's thread mode (cpu::IeeeSubnormals).
#include "activation/gated.h"

#include <algorithm>
#include <type_traits>

#include "activation/cpu_gelu.h"
#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

using cpu::to_acc;

template <GatedActivation kAct, typename A>
FUSEDLAYERS_INLINE A activation(A g) {
  if constexpr (kAct == GatedActivation::kSilu) {
    return g * cpu::sigmoid(g);
  } else {
    return cpu::gelu(g, kAct == GatedActivation::kGeluTanh ? GeluApprox::kTanh : GeluApprox::kNone);
  }
}

// act(g) and act'(g).
template <GatedActivation kAct, typename A>
FUSEDLAYERS_INLINE std::pair<A, A> activation_and_grad(A g) {
  if constexpr (kAct == GatedActivation::kSilu) {
    const A s = cpu::sigmoid(g);
    return {g * s, s * (A(1) + g * (A(1) - s))};
  } else {
    const GeluApprox approx =
        kAct == GatedActivation::kGeluTanh ? GeluApprox::kTanh : GeluApprox::kNone;
    return {cpu::gelu(g, approx), cpu::gelu_grad(g, approx)};
  }
}

template <GatedActivation kAct, typename T, typename A>
FUSEDLAYERS_CPU_CLONES void forward_row(const T* __restrict g, const T* __restrict u,
                                        T* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    y[j] = cpu::from_acc<T>(activation<kAct>(A(to_acc(g[j]))) * A(to_acc(u[j])));
}

template <GatedActivation kAct, typename T, typename A>
FUSEDLAYERS_CPU_CLONES void backward_row(const T* __restrict dy, const T* __restrict g,
                                         const T* __restrict u, T* __restrict dg,
                                         T* __restrict du, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const A d = to_acc(dy[j]);
    const std::pair<A, A> act = activation_and_grad<kAct>(A(to_acc(g[j])));
    du[j] = cpu::from_acc<T>(d * act.first);
    dg[j] = cpu::from_acc<T>(d * A(to_acc(u[j])) * act.second);
  }
}

// Rows per parallel task: about 16K elements, so small inputs stay on one thread.
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

void check_sizes(const char* pass, int64_t rows, int64_t cols, int64_t gs, int64_t us) {
  if (rows < 0 || cols < 0 || (rows > 1 && (gs < cols || us < cols)))
    fail(std::string(pass) + ": bad sizes " + std::to_string(rows) + " x " + std::to_string(cols) +
         " (row strides " + std::to_string(gs) + ", " + std::to_string(us) + ")");
}

}  // namespace

void gated_forward_cpu(const void* gate, int64_t gs, const void* up, int64_t us, void* y,
                       int64_t rows, int64_t cols, GatedActivation act, DType dtype,
                       const ParallelFor& parallel_for) {
  check_sizes("gated_forward_cpu", rows, cols, gs, us);
  if (rows * cols == 0) return;
  cpu::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename cpu::Acc<T>::type;
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* out = static_cast<T*>(y);
    with_activation(act, [&](auto act_tag) {
      constexpr GatedActivation kAct = decltype(act_tag)::value;
      parallel_for(rows, grain(cols), [&](int64_t begin, int64_t end) {
        const cpu::IeeeSubnormals ieee;
        if constexpr (cpu::kStaged<T>) {
          cpu::Row<A> buf(static_cast<size_t>(3 * cpu::row_stride<A>(cols)));
          A* gf = buf.data();
          A* uf = gf + cpu::row_stride<A>(cols);
          A* yf = uf + cpu::row_stride<A>(cols);
          for (int64_t r = begin; r < end; ++r) {
            cpu::load(g + r * gs, gf, cols);
            cpu::load(u + r * us, uf, cols);
            forward_row<kAct, A, A>(gf, uf, yf, cols);
            cpu::store(yf, out + r * cols, cols);
          }
        } else {
          for (int64_t r = begin; r < end; ++r)
            forward_row<kAct, T, A>(g + r * gs, u + r * us, out + r * cols, cols);
        }
      });
    });
  });
}

void gated_backward_cpu(const void* dy, const void* gate, int64_t gs, const void* up, int64_t us,
                        void* dgate, void* dup, int64_t rows, int64_t cols, GatedActivation act,
                        DType dtype, const ParallelFor& parallel_for) {
  check_sizes("gated_backward_cpu", rows, cols, gs, us);
  if (rows * cols == 0) return;
  cpu::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename cpu::Acc<T>::type;
    const T* d = static_cast<const T*>(dy);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* dg = static_cast<T*>(dgate);
    T* du = static_cast<T*>(dup);
    with_activation(act, [&](auto act_tag) {
      constexpr GatedActivation kAct = decltype(act_tag)::value;
      parallel_for(rows, grain(cols), [&](int64_t begin, int64_t end) {
        const cpu::IeeeSubnormals ieee;
        if constexpr (cpu::kStaged<T>) {
          const int64_t s = cpu::row_stride<A>(cols);
          cpu::Row<A> buf(static_cast<size_t>(5 * s));
          A *df = buf.data(), *gf = df + s, *uf = gf + s, *dgf = uf + s, *duf = dgf + s;
          for (int64_t r = begin; r < end; ++r) {
            cpu::load(d + r * cols, df, cols);
            cpu::load(g + r * gs, gf, cols);
            cpu::load(u + r * us, uf, cols);
            backward_row<kAct, A, A>(df, gf, uf, dgf, duf, cols);
            cpu::store(dgf, dg + r * cols, cols);
            cpu::store(duf, du + r * cols, cols);
          }
        } else {
          for (int64_t r = begin; r < end; ++r)
            backward_row<kAct, T, A>(d + r * cols, g + r * gs, u + r * us, dg + r * cols,
                                     du + r * cols, cols);
        }
      });
    });
  });
}

}  // namespace fusedlayers
