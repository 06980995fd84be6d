// CPU layer norm: a row per task for the forward and dx; dgamma/dbeta summed per fixed chunk of
// rows into the workspace, then over chunks in chunk order, so results are thread-count invariant.
#include "layer_norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_types.h"

namespace fusedlayers {
namespace {

constexpr int64_t kMaxChunks = 64;

int64_t num_chunks(int64_t rows) { return std::max<int64_t>(1, std::min(rows, kMaxChunks)); }

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
                            DType dtype, DType param_dtype, const ParallelFor& parallel_for) {
  check_sizes("layer_norm", rows, cols);
  check_param_dtype("layer_norm", dtype, param_dtype);
  if (!std::isfinite(eps) || eps < 0) fail("layer_norm: eps must be finite and >= 0");
  if (rows == 0) return;
  dispatch2(dtype, param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const T* xp = static_cast<const T*>(x);
    const P* gp = static_cast<const P*>(gamma);
    const P* bp = static_cast<const P*>(beta);
    T* yp = static_cast<T*>(y);
    A* meanp = static_cast<A*>(mean);
    A* rstdp = static_cast<A*>(rstd);
    const int64_t grain = std::max<int64_t>(1, 16384 / cols);
    parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * cols;
        T* yr = yp + r * cols;
        A sum = 0;
        for (int64_t j = 0; j < cols; ++j) sum += cpu::to_acc(xr[j]);
        const A mu = sum / static_cast<A>(cols);
        A sq = 0;
        for (int64_t j = 0; j < cols; ++j) {
          const A d = cpu::to_acc(xr[j]) - mu;
          sq += d * d;
        }
        const A rs = A(1) / std::sqrt(sq / static_cast<A>(cols) + static_cast<A>(eps));
        for (int64_t j = 0; j < cols; ++j) {
          A v = (cpu::to_acc(xr[j]) - mu) * rs;
          if (gp) v *= static_cast<A>(cpu::to_acc(gp[j]));
          if (bp) v += static_cast<A>(cpu::to_acc(bp[j]));
          yr[j] = cpu::from_acc<T>(v);
        }
        meanp[r] = mu;
        rstdp[r] = rs;
      }
    });
  });
}

size_t layer_norm_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype) {
  check_sizes("layer_norm_backward", rows, cols);
  const size_t acc_bytes = dtype == DType::kFloat64 ? 8 : 4;
  return static_cast<size_t>(num_chunks(rows)) * 2 * static_cast<size_t>(cols) * acc_bytes;
}

void layer_norm_backward_cpu(const void* dy, const void* saved, const void* mean,
                             const void* rstd, const void* gamma, const void* beta, void* dx,
                             void* dgamma, void* dbeta, void* workspace, int64_t rows,
                             int64_t cols, bool saved_is_output, DType dtype, DType param_dtype,
                             const ParallelFor& parallel_for) {
  check_sizes("layer_norm_backward", rows, cols);
  check_param_dtype("layer_norm_backward", dtype, param_dtype);
  if ((dgamma && !gamma) || (dbeta && !beta))
    fail("layer_norm_backward: dgamma/dbeta requested without gamma/beta");
  const bool want_params = dgamma || dbeta;
  if (want_params && !workspace) fail("layer_norm_backward: workspace is null");
  dispatch2(dtype, param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const T* dyp = static_cast<const T*>(dy);
    const T* sp = static_cast<const T*>(saved);
    const A* meanp = static_cast<const A*>(mean);
    const A* rstdp = static_cast<const A*>(rstd);
    const P* gp = static_cast<const P*>(gamma);
    const P* bp = static_cast<const P*>(beta);
    T* dxp = static_cast<T*>(dx);
    A* partial = static_cast<A*>(workspace);  // [chunk][dgamma | dbeta][cols]
    const int64_t chunks = num_chunks(rows);
    const int64_t per_chunk = (rows + chunks - 1) / chunks;

    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      std::vector<A> xhat(static_cast<size_t>(cols));
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pg = want_params ? partial + c * 2 * cols : nullptr;
        A* pb = want_params ? pg + cols : nullptr;
        if (want_params) std::fill(pg, pg + 2 * cols, A(0));
        const int64_t rend = std::min(rows, (c + 1) * per_chunk);
        for (int64_t r = c * per_chunk; r < rend; ++r) {
          const T* dyr = dyp + r * cols;
          const T* sr = sp + r * cols;
          const A rs = rstdp[r];
          A sum_g = 0, sum_gx = 0;
          for (int64_t j = 0; j < cols; ++j) {
            A xh;
            if (saved_is_output) {
              xh = cpu::to_acc(sr[j]);
              if (bp) xh -= static_cast<A>(cpu::to_acc(bp[j]));
              if (gp) xh /= static_cast<A>(cpu::to_acc(gp[j]));
            } else {
              xh = (cpu::to_acc(sr[j]) - meanp[r]) * rs;
            }
            xhat[j] = xh;
            const A d = cpu::to_acc(dyr[j]);
            const A g = gp ? d * static_cast<A>(cpu::to_acc(gp[j])) : d;
            sum_g += g;
            sum_gx += g * xh;
            if (pg) pg[j] += d * xh;
            if (pb) pb[j] += d;
          }
          const A mg = sum_g / static_cast<A>(cols);
          const A mgx = sum_gx / static_cast<A>(cols);
          T* dxr = dxp + r * cols;
          for (int64_t j = 0; j < cols; ++j) {
            const A d = cpu::to_acc(dyr[j]);
            const A g = gp ? d * static_cast<A>(cpu::to_acc(gp[j])) : d;
            dxr[j] = cpu::from_acc<T>(rs * (g - mg - xhat[j] * mgx));
          }
        }
      }
    });

    if (!want_params) return;
    P* dgp = static_cast<P*>(dgamma);
    P* dbp = static_cast<P*>(dbeta);
    parallel_for(cols, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        A sg = 0, sb = 0;
        for (int64_t c = 0; c < chunks; ++c) {  // fixed order: deterministic
          sg += partial[c * 2 * cols + j];
          sb += partial[c * 2 * cols + cols + j];
        }
        if (dgp) dgp[j] = cpu::from_acc<P>(sg);
        if (dbp) dbp[j] = cpu::from_acc<P>(sb);
      }
    });
  });
}

}  // namespace fusedlayers
