// CPU layer norm: a row per task for the forward and dx; dgamma/dbeta summed per fixed chunk of
// rows into the workspace, then over chunks in chunk order, so results are thread-count invariant.
#include "layer_norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_types.h"

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
      const A* gp = g.data();
      const A* bp = b.data();
      for (int64_t r = begin; r < end; ++r) {
        const A* v = cpu::staged(static_cast<const T*>(x) + r * cols, buf.data(), cols);
        T* yr = static_cast<T*>(y) + r * cols;
        const A mu = cpu::lane_sum<A>(cols, [&](int64_t j) { return v[j]; }) / A(cols);
        const A var = cpu::lane_sum<A>(cols, [&](int64_t j) {
                        const A dev = v[j] - mu;
                        return dev * dev;
                      }) / A(cols);
        const A rs = A(1) / std::sqrt(var + static_cast<A>(eps));
        const A shift = subtract_mean ? mu : A(0);
        for (int64_t j = 0; j < cols; ++j)
          yr[j] = cpu::from_acc<T>((v[j] - shift) * rs * gp[j] + bp[j]);
        static_cast<A*>(mean)[r] = mu;
        static_cast<A*>(rstd)[r] = rs;
      }
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

    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      std::vector<A> buf(static_cast<size_t>(3 * cols));
      A* d = buf.data();         // dy
      A* xh = d + cols;          // xhat
      A* gd = xh + cols;         // dy * gamma, then dx
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pg = want_params ? partial + c * 2 * cols : nullptr;
        A* pb = want_params ? pg + cols : nullptr;
        if (want_params) std::fill(pg, pg + 2 * cols, A(0));
        const int64_t rend = std::min(rows, (c + 1) * per_chunk);
        for (int64_t r = c * per_chunk; r < rend; ++r) {
          const A rs = static_cast<const A*>(rstd)[r];
          cpu::load(static_cast<const T*>(dy) + r * cols, d, cols);
          cpu::load(static_cast<const T*>(saved) + r * cols, xh, cols);
          const A mu = saved_is_output ? A(0) : static_cast<const A*>(mean)[r];
          for (int64_t j = 0; j < cols; ++j) gd[j] = d[j] * g[j];
          // Scale-only: dx needs rstd * mean(g * x); summed on raw x (xh still holds it), since
          // mean(g * xhat) + mean * rstd * mean(g) cancels for rows far from zero.
          const A mgx_raw =
              subtract_mean ? A(0)
                            : cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j] * xh[j]; }) /
                                  A(cols);
          if (want_params && !subtract_mean) {  // dgamma = sum dy * x * rstd, before xh is xhat
            for (int64_t j = 0; j < cols; ++j) pg[j] += d[j] * xh[j] * rs;
          }
          if (saved_is_output) {
            for (int64_t j = 0; j < cols; ++j) xh[j] = (xh[j] - b[j]) / g[j];
          } else {
            // Scale-only dx multiplies xhat by the large rstd * mean(g * x): re-centre x - mean
            // by its own residual, so the rounding of the stored mean does not enter it.
            const A c = subtract_mean ? A(0)
                                      : cpu::lane_sum<A>(cols, [&](int64_t j) { return xh[j] - mu; }) /
                                            A(cols);
            for (int64_t j = 0; j < cols; ++j) xh[j] = (xh[j] - mu - c) * rs;
          }
          const A mg = cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j]; }) / A(cols);
          const A mgx = cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j] * xh[j]; }) / A(cols);
          if (want_params && subtract_mean) {
            for (int64_t j = 0; j < cols; ++j) pg[j] += d[j] * xh[j];
            for (int64_t j = 0; j < cols; ++j) pb[j] += d[j];
          }
          // Standard: dx = rstd (g - mean(g) - xhat mean(g xhat)); scale-only: see layer_norm.h.
          const A k_mean = subtract_mean ? mg : A(0);
          const A k_xhat = subtract_mean ? mgx : rs * mgx_raw;
          for (int64_t j = 0; j < cols; ++j) gd[j] = rs * (gd[j] - k_mean - xh[j] * k_xhat);
          cpu::store(gd, static_cast<T*>(dx) + r * cols, cols);
        }
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
