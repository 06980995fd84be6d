// CPU layer norm: rows split over tasks for the forward and dx; dgamma/dbeta summed per fixed
// chunk of rows into the workspace, then over chunks in chunk order, so results are thread-count
// invariant. Rows run in target clones (cpu_types.h).
#include "layer_norm.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_types.h"

// No multiply-add contraction in the FMA clones: the rows then give the same bits on every
// CPU, and cancellations the math makes exact stay exact (dy * gamma - mean(dy * gamma) is 0 for
// one column, as the unfused layer gives).
#pragma GCC optimize("fp-contract=off")

namespace fusedlayers {
namespace {

void check_sizes(const char* op, int64_t rows, int64_t cols) {
  if (rows < 0) fail(std::string(op) + ": rows must be >= 0, got " + std::to_string(rows));
  if (cols < 1) fail(std::string(op) + ": cols must be >= 1, got " + std::to_string(cols));
}

void check_param_dtype(const char* op, DType dtype, DType param_dtype) {
  const bool half = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  if (param_dtype != dtype && !(half && param_dtype == DType::kFloat32))
    fail(std::string(op) + ": gamma/beta dtype must be " + dtype_name(dtype) +
         (half ? " or float32" : "") + ", got " + dtype_name(param_dtype));
}

// Calls fn(T{}, P{}) for the input storage type T and the parameter storage type P.
template <typename Fn>
void dispatch2(DType dtype, DType param_dtype, Fn&& fn) {
  cpu::dispatch(dtype, [&](auto t) {
    if (param_dtype == dtype) {
      fn(t, t);
    } else {
      fn(t, float{});
    }
  });
}

// Rows [begin, end): y = (x - shift) * rstd * gamma + beta, with shift the mean (0 for
// scale-only), and each row's mean and rstd. g and b are gamma/beta in A (1 and 0 where absent);
// buf holds cols values for staging a 16-bit row.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void forward_rows(const T* x, const A* g, const A* b, T* y, A* mean,
                                         A* rstd, A* buf, int64_t begin, int64_t end,
                                         int64_t cols, A eps, bool subtract_mean) {
  for (int64_t r = begin; r < end; ++r) {
    const A* v = cpu::staged(x + r * cols, buf, cols);
    T* yr = y + r * cols;
    const A mu = cpu::lane_sum<A>(cols, [&](int64_t j) { return v[j]; }) / A(cols);
    const A var = cpu::lane_sum<A>(cols, [&](int64_t j) {
                    const A dev = v[j] - mu;
                    return dev * dev;
                  }) / A(cols);
    const A rs = A(1) / std::sqrt(var + eps);
    const A shift = subtract_mean ? mu : A(0);
    for (int64_t j = 0; j < cols; ++j) yr[j] = cpu::from_acc<T>((v[j] - shift) * rs * g[j] + b[j]);
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// The backward's per-call inputs: dy, the saved input x (or output y), the row statistics,
// gamma/beta in A (1 and 0 where absent) and dx.
template <typename T, typename A>
struct BackwardArgs {
  const T* dy;
  const T* saved;
  const A* mean;
  const A* rstd;
  const A* g;
  const A* b;
  T* dx;
  int64_t cols;
  bool saved_is_output, subtract_mean;
};

// Rows [begin, end): dx, and dy * xhat and dy added into pg and pb (when not null) in row order.
// buf holds 3 * cols values.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void backward_rows(const BackwardArgs<T, A>& a, A* pg, A* pb, A* buf,
                                          int64_t begin, int64_t end) {
  const int64_t cols = a.cols;
  const bool subtract_mean = a.subtract_mean;
  const A* g = a.g;
  const A* b = a.b;
  A* d = buf;           // dy
  A* xh = d + cols;     // xhat
  A* gd = xh + cols;    // dy * gamma, then dx
  for (int64_t r = begin; r < end; ++r) {
    const A rs = a.rstd[r];
    if (subtract_mean && !a.saved_is_output) {
      // The common case in two passes over the row, xhat and dy * gamma recomputed in each:
      // the same values, sums and order as the general path below, so the same bits.
      const T* xr = a.saved + r * cols;
      const T* dyr = a.dy + r * cols;
      const A mu = a.mean[r];
      const auto [sum_gd, sum_gdx] = cpu::lane_sum2<A>(cols, [&](int64_t j) {
        const A dyj = cpu::to_acc(dyr[j]), xhj = (cpu::to_acc(xr[j]) - mu) * rs;
        if (pg) {
          pg[j] += dyj * xhj;
          pb[j] += dyj;
        }
        return std::pair<A, A>(dyj * g[j], dyj * g[j] * xhj);
      });
      const A mg = sum_gd / A(cols), mgx = sum_gdx / A(cols);
      T* dxr = a.dx + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const A xhj = (cpu::to_acc(xr[j]) - mu) * rs;
        dxr[j] = cpu::from_acc<T>(rs * (cpu::to_acc(dyr[j]) * g[j] - mg - xhj * mgx));
      }
      continue;
    }
    cpu::load(a.dy + r * cols, d, cols);
    cpu::load(a.saved + r * cols, xh, cols);
    const A mu = a.saved_is_output ? A(0) : a.mean[r];
    for (int64_t j = 0; j < cols; ++j) gd[j] = d[j] * g[j];
    // Scale-only: dx needs rstd * mean(g * x); summed on raw x (xh still holds it), since
    // mean(g * xhat) + mean * rstd * mean(g) cancels for rows far from zero.
    const A mgx_raw =
        subtract_mean
            ? A(0)
            : cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j] * xh[j]; }) / A(cols);
    if (pg && !subtract_mean) {  // dgamma = sum dy * x * rstd, before xh is xhat
      for (int64_t j = 0; j < cols; ++j) pg[j] += d[j] * xh[j] * rs;
    }
    if (a.saved_is_output) {
      for (int64_t j = 0; j < cols; ++j) xh[j] = (xh[j] - b[j]) / g[j];
    } else {
      // Scale-only dx multiplies xhat by the large rstd * mean(g * x): re-centre x - mean by
      // its own residual, so the rounding of the stored mean does not enter it.
      const A c =
          subtract_mean ? A(0)
                        : cpu::lane_sum<A>(cols, [&](int64_t j) { return xh[j] - mu; }) / A(cols);
      for (int64_t j = 0; j < cols; ++j) xh[j] = (xh[j] - mu - c) * rs;
    }
    const A mg = cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j]; }) / A(cols);
    const A mgx = cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j] * xh[j]; }) / A(cols);
    if (pg && subtract_mean) {
      for (int64_t j = 0; j < cols; ++j) pg[j] += d[j] * xh[j];
      for (int64_t j = 0; j < cols; ++j) pb[j] += d[j];
    }
    // Standard: dx = rstd (g - mean(g) - xhat mean(g xhat)); scale-only: see layer_norm.h.
    const A k_mean = subtract_mean ? mg : A(0);
    const A k_xhat = subtract_mean ? mgx : rs * mgx_raw;
    for (int64_t j = 0; j < cols; ++j) gd[j] = rs * (gd[j] - k_mean - xh[j] * k_xhat);
    cpu::store(gd, a.dx + r * cols, cols);
  }
}

}  // namespace

void layer_norm_forward_cpu(const void* x, const void* gamma, const void* beta, void* y,
                            void* mean, void* rstd, int64_t rows, int64_t cols, double eps,
                            bool subtract_mean, DType dtype, DType param_dtype,
                            const ParallelFor& parallel_for) {
  check_sizes("layer_norm", rows, cols);
  check_param_dtype("layer_norm", dtype, param_dtype);
  if (!std::isfinite(eps) || eps < 0) fail("layer_norm: eps must be finite and >= 0");
  if (rows == 0) return;
  dispatch2(dtype, param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const std::vector<A> g = cpu::param_or<P, A>(gamma, cols, A(1));
    const std::vector<A> b = cpu::param_or<P, A>(subtract_mean ? beta : nullptr, cols, A(0));
    const int64_t grain = std::max<int64_t>(1, 16384 / cols);
    parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<A> buf(static_cast<size_t>(cols));
      const T* xp = static_cast<const T*>(x);
      const A *gp = g.data(), *bp = b.data();
      T* yp = static_cast<T*>(y);
      A* mp = static_cast<A*>(mean);
      A* rp = static_cast<A*>(rstd);
      const A e = static_cast<A>(eps);
      forward_rows(xp, gp, bp, yp, mp, rp, buf.data(), begin, end, cols, e, subtract_mean);
    });
  });
}

size_t layer_norm_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype) {
  check_sizes("layer_norm_backward", rows, cols);
  const size_t acc_bytes = dtype == DType::kFloat64 ? 8 : 4;
  return static_cast<size_t>(cpu::num_chunks(rows, cols)) * 2 * static_cast<size_t>(cols) * acc_bytes;
}

void layer_norm_backward_cpu(const void* dy, const void* saved, const void* mean,
                             const void* rstd, const void* gamma, const void* beta, void* dx,
                             void* dgamma, void* dbeta, void* workspace, int64_t rows,
                             int64_t cols, bool saved_is_output, bool subtract_mean, DType dtype,
                             DType param_dtype, const ParallelFor& parallel_for) {
  check_sizes("layer_norm_backward", rows, cols);
  check_param_dtype("layer_norm_backward", dtype, param_dtype);
  if ((dgamma && !gamma) || (dbeta && !beta))
    fail("layer_norm_backward: dgamma/dbeta requested without gamma/beta");
  if (saved_is_output && !subtract_mean)
    fail("layer_norm_backward: saved_is_output needs subtract_mean");
  if (dbeta && !subtract_mean) fail("layer_norm_backward: no beta without subtract_mean");
  const bool want_params = dgamma || dbeta;
  if (want_params && !workspace) fail("layer_norm_backward: workspace is null");
  dispatch2(dtype, param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const std::vector<A> g = cpu::param_or<P, A>(gamma, cols, A(1));
    const std::vector<A> b = cpu::param_or<P, A>(beta, cols, A(0));
    A* partial = static_cast<A*>(workspace);  // [chunk][dgamma | dbeta][cols]
    const int64_t chunks = cpu::num_chunks(rows, cols);
    const int64_t per_chunk = (rows + chunks - 1) / chunks;

    const BackwardArgs<T, A> args{static_cast<const T*>(dy), static_cast<const T*>(saved),
                                  static_cast<const A*>(mean), static_cast<const A*>(rstd),
                                  g.data(), b.data(), static_cast<T*>(dx), cols,
                                  saved_is_output, subtract_mean};
    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      std::vector<A> buf(static_cast<size_t>(3 * cols));
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pg = want_params ? partial + c * 2 * cols : nullptr;
        A* pb = want_params ? pg + cols : nullptr;
        if (want_params) std::fill(pg, pg + 2 * cols, A(0));
        const int64_t begin = c * per_chunk, end = std::min(rows, (c + 1) * per_chunk);
        backward_rows(args, pg, pb, buf.data(), begin, end);
      }
    });

    if (!want_params) return;
    P* dgp = static_cast<P*>(dgamma);
    P* dbp = static_cast<P*>(dbeta);
    parallel_for(cols, 1024, [&](int64_t begin, int64_t end) {
      if (dgp)
        cpu::sum_chunks(partial, chunks, 2 * cols, begin, end,
                        [&](int64_t j, A sum) { dgp[j] = cpu::from_acc<P>(sum); });
      if (dbp)
        cpu::sum_chunks(partial + cols, chunks, 2 * cols, begin, end,
                        [&](int64_t j, A sum) { dbp[j] = cpu::from_acc<P>(sum); });
    });
  });
}

}  // namespace fusedlayers
