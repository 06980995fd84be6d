// CPU row normalization (math and dtypes: norm.h): rows split over tasks for the forward and dx; dgamma/dbeta summed per fixed
// chunk of rows into the workspace, then over chunks in chunk order, so results are thread-count
// invariant. Rows run in target clones (cpu_types.h).
#include "norm.h"

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

// gamma = weight + offset in the accumulation type, 1 where weight is absent.
template <typename P, typename A>
cpu::Row<A> gamma_or_one(const void* weight, int64_t cols, float offset) {
  cpu::Row<A> g = cpu::param_or<P, A>(weight, cols, A(1));
  if (weight && offset != 0)
    for (A& v : g) v += A(offset);
  return g;
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

// Rows [begin, end): y = (x - shift) * rstd * gamma + beta, with shift the mean (0 but for
// kLayer), and each row's rstd and (where mean is not null) mean. g and b are gamma/beta in A
// (1 and 0 where absent); buf holds cols values for staging a 16-bit row.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void forward_rows(const T* x, const A* g, const A* b, T* y, A* mean,
                                         A* rstd, A* buf, int64_t begin, int64_t end,
                                         int64_t cols, A eps, NormMode mode) {
  for (int64_t r = begin; r < end; ++r) {
    const A* v = cpu::staged(x + r * cols, buf, cols);
    T* yr = y + r * cols;
    // The mean as x[0] + mean(x - x[0]): the sum then rounds at the scale of the deviations,
    // not of the mean (rows at 100 std: 1 ulp of the mean where a plain float sum was off ~2).
    const A x0 = v[0];
    const A mu = mode == NormMode::kRms
                     ? A(0)
                     : x0 + cpu::lane_sum<A>(cols, [&](int64_t j) { return v[j] - x0; }) / A(cols);
    const A var = cpu::lane_sum<A>(cols, [&](int64_t j) {
                    const A dev = v[j] - mu;
                    return dev * dev;
                  }) / A(cols);
    const A rs = A(1) / std::sqrt(var + eps);
    const A shift = mode == NormMode::kLayer ? mu : A(0);
    if constexpr (cpu::kStaged<T>) {  // in the staging buffer (v is buf), converted in one pass
      for (int64_t j = 0; j < cols; ++j) buf[j] = (v[j] - shift) * rs * g[j] + b[j];
      cpu::store(buf, yr, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j)
        yr[j] = cpu::from_acc<T>((v[j] - shift) * rs * g[j] + b[j]);
    }
    if (mean) mean[r] = mu;
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
  bool saved_is_output;
  NormMode mode;
};

// The centred backward's first pass over n columns: sum(dy * gamma) and sum(dy * gamma * xhat),
// and, kParams, dy * xhat and dy added into pg and pb. A function of its own, not inlined, for
// its __restrict parameters (the partials never alias the rows), which GCC honours only on a
// function it compiles as such: inlined, the lane sums stayed in memory, a store and reload
// per add (perf), since the stores into pg might have been into them.
template <bool kParams, typename S, typename A>
FUSEDLAYERS_CPU_CLONES std::pair<A, A> centred_sums(const S* __restrict dy,
                                                    const S* __restrict x,
                                                    const A* __restrict g, A* __restrict pg,
                                                    A* __restrict pb, A mu, A rs, int64_t n) {
  return cpu::lane_sum2<A>(n, [&](int64_t j) {
    const A dyj = cpu::to_acc(dy[j]), xhj = (cpu::to_acc(x[j]) - mu) * rs;
    if constexpr (kParams) {
      pg[j] += dyj * xhj;
      pb[j] += dyj;
    }
    return std::pair<A, A>(dyj * g[j], dyj * g[j] * xhj);
  });
}

// Rows [begin, end): dx, and dy * xhat and dy added into pg and pb (when not null) in row order.
// buf holds 3 rows of cols values, row_stride apart.
template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void backward_rows(const BackwardArgs<T, A>& a, A* pg, A* pb, A* buf,
                                          int64_t begin, int64_t end) {
  const int64_t cols = a.cols;
  const bool centred = a.mode == NormMode::kLayer;
  const A* g = a.g;
  const A* b = a.b;
  const int64_t stride = cpu::row_stride<A>(cols);
  A* d = buf;            // dy
  A* xh = d + stride;    // xhat
  A* gd = xh + stride;   // dy * gamma, then dx
  // float16 columns per staged block: whole rows up to 1024 (docs/DESIGN.md, "CPU loops").
  constexpr int64_t kStageBlock = 512;
  const int64_t bc = cpu::kStaged<T> && cols > 2 * kStageBlock ? kStageBlock : cols;
  // n values at src as the loops read them: converted into buf for float16, src itself else.
  const auto block_of = [](const T* src, A* buf, int64_t n) {
    if constexpr (cpu::kStaged<T>) {
      cpu::load(src, buf, n);
      return static_cast<const A*>(buf);
    } else {
      return src;
    }
  };
  for (int64_t r = begin; r < end; ++r) {
    const A rs = a.rstd[r];
    if (centred && !a.saved_is_output) {
      // The common case in two passes over the row, xhat and dy * gamma recomputed in each:
      // the same values as the general path below. float16 is converted into d and xh (and dx
      // goes out through gd) in blocks of `bc` columns, L1-sized for wide rows: re-converting
      // a block costs less than re-reading a row staged in float, twice the bytes, from L2.
      // A row's sums add its blocks' lane sums in block order.
      const T* dyr = a.dy + r * cols;
      const T* xr = a.saved + r * cols;
      const A mu = a.mean[r];
      A sum_gd = 0, sum_gdx = 0;
      for (int64_t c0 = 0; c0 < cols; c0 += bc) {
        const int64_t n = std::min(bc, cols - c0);
        const auto dyb = block_of(dyr + c0, d, n), xb = block_of(xr + c0, xh, n);
        const auto [s_gd, s_gdx] =
            pg ? centred_sums<true>(dyb, xb, g + c0, pg + c0, pb + c0, mu, rs, n)
               : centred_sums<false>(dyb, xb, g + c0, pg, pb, mu, rs, n);
        sum_gd += s_gd;
        sum_gdx += s_gdx;
      }
      const A mg = sum_gd / A(cols), mgx = sum_gdx / A(cols);
      T* dxr = a.dx + r * cols;
      for (int64_t c0 = 0; c0 < cols; c0 += bc) {
        const int64_t n = std::min(bc, cols - c0);
        const auto dyb = block_of(dyr + c0, d, n), xb = block_of(xr + c0, xh, n);
        const A* gb = g + c0;
        for (int64_t j = 0; j < n; ++j) {
          const A xhj = (cpu::to_acc(xb[j]) - mu) * rs;
          const A dxj = rs * (cpu::to_acc(dyb[j]) * gb[j] - mg - xhj * mgx);
          if constexpr (cpu::kStaged<T>)
            gd[j] = dxj;
          else
            dxr[c0 + j] = cpu::from_acc<T>(dxj);
        }
        if constexpr (cpu::kStaged<T>) cpu::store(gd, dxr + c0, n);
      }
      continue;
    }
    cpu::load(a.dy + r * cols, d, cols);
    cpu::load(a.saved + r * cols, xh, cols);
    const A mu = a.saved_is_output || a.mode == NormMode::kRms ? A(0) : a.mean[r];
    for (int64_t j = 0; j < cols; ++j) gd[j] = d[j] * g[j];
    // No mean subtracted: dx needs rstd * mean(g * x); summed on raw x (xh still holds it), since
    // mean(g * xhat) + mean * rstd * mean(g) cancels for rows far from zero.
    const A mgx_raw =
        centred
            ? A(0)
            : cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j] * xh[j]; }) / A(cols);
    if (pg && !centred) {  // dgamma = sum dy * x * rstd, before xh is xhat
      for (int64_t j = 0; j < cols; ++j) pg[j] += d[j] * xh[j] * rs;
    }
    if (a.saved_is_output) {
      for (int64_t j = 0; j < cols; ++j) xh[j] = (xh[j] - b[j]) / g[j];
    } else {
      // kKerasRmsScaling's dx multiplies x - mean by the large rstd * mean(g * x): re-centre
      // it by its own residual, so the rounding of the stored mean does not enter it.
      const A c = a.mode != NormMode::kKerasRmsScaling
                      ? A(0)
                      : cpu::lane_sum<A>(cols, [&](int64_t j) { return xh[j] - mu; }) / A(cols);
      for (int64_t j = 0; j < cols; ++j) xh[j] = (xh[j] - mu - c) * rs;
    }
    const A mg = cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j]; }) / A(cols);
    const A mgx = cpu::lane_sum<A>(cols, [&](int64_t j) { return gd[j] * xh[j]; }) / A(cols);
    if (pg && centred) {
      for (int64_t j = 0; j < cols; ++j) pg[j] += d[j] * xh[j];
      for (int64_t j = 0; j < cols; ++j) pb[j] += d[j];
    }
    // kLayer: dx = rstd (g - mean(g) - xhat mean(g xhat)); the others: see norm.h.
    const A k_mean = centred ? mg : A(0);
    const A k_xhat = centred ? mgx : rs * mgx_raw;
    for (int64_t j = 0; j < cols; ++j) gd[j] = rs * (gd[j] - k_mean - xh[j] * k_xhat);
    cpu::store(gd, a.dx + r * cols, cols);
  }
}

}  // namespace

void norm_forward_cpu(const NormForwardArgs& a, const ParallelFor& parallel_for) {
  check_sizes("norm", a.rows, a.cols);
  check_param_dtype("norm", a.dtype, a.param_dtype);
  if (a.rows == 0) return;
  const int64_t cols = a.cols;
  dispatch2(a.dtype, a.param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const cpu::Row<A> g = gamma_or_one<P, A>(a.gamma, cols, a.gamma_offset);
    const cpu::Row<A> b =
        cpu::param_or<P, A>(a.mode == NormMode::kLayer ? a.beta : nullptr, cols, A(0));
    const int64_t grain = std::max<int64_t>(1, 16384 / cols);
    parallel_for(a.rows, grain, [&](int64_t begin, int64_t end) {
      cpu::Row<A> buf(static_cast<size_t>(cols));
      forward_rows(static_cast<const T*>(a.x), g.data(), b.data(), static_cast<T*>(a.y),
                   static_cast<A*>(a.mean), static_cast<A*>(a.rstd), buf.data(), begin, end, cols,
                   static_cast<A>(a.eps), a.mode);
    });
  });
}

size_t norm_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype) {
  check_sizes("norm_backward", rows, cols);
  const size_t acc_bytes = dtype == DType::kFloat64 ? 8 : 4;
  return static_cast<size_t>(cpu::num_chunks(rows, cols)) * 2 * static_cast<size_t>(cols) * acc_bytes;
}

void norm_backward_cpu(const NormBackwardArgs& a, const ParallelFor& parallel_for) {
  const int64_t rows = a.rows, cols = a.cols;
  check_sizes("norm_backward", rows, cols);
  check_param_dtype("norm_backward", a.dtype, a.param_dtype);
  const bool want_params = a.dgamma || a.dbeta;
  dispatch2(a.dtype, a.param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const cpu::Row<A> g = gamma_or_one<P, A>(a.gamma, cols, a.gamma_offset);
    const cpu::Row<A> b = cpu::param_or<P, A>(a.beta, cols, A(0));
    A* partial = static_cast<A*>(a.workspace);  // [chunk][dgamma | dbeta][cols]
    const int64_t chunks = cpu::num_chunks(rows, cols);
    const int64_t per_chunk = (rows + chunks - 1) / chunks;

    const BackwardArgs<T, A> args{static_cast<const T*>(a.dy), static_cast<const T*>(a.saved),
                                  static_cast<const A*>(a.mean), static_cast<const A*>(a.rstd),
                                  g.data(), b.data(), static_cast<T*>(a.dx), cols,
                                  a.saved_is_output, a.mode};
    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      cpu::Row<A> buf(static_cast<size_t>(3 * cpu::row_stride<A>(cols)));
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pg = want_params ? partial + c * 2 * cols : nullptr;
        A* pb = want_params ? pg + cols : nullptr;
        if (want_params) std::fill(pg, pg + 2 * cols, A(0));
        const int64_t begin = c * per_chunk, end = std::min(rows, (c + 1) * per_chunk);
        backward_rows(args, pg, pb, buf.data(), begin, end);
      }
    });

    if (!want_params) return;
    P* dgp = static_cast<P*>(a.dgamma);
    P* dbp = static_cast<P*>(a.dbeta);
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
