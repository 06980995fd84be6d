// CPU row normalization (math and dtypes: norm.h): rows split over tasks for the forward and
// dx; dgamma/dbeta summed per fixed chunk of rows into the workspace, then over chunks in chunk
// order, so results are thread-count invariant. Rows run in target clones (cpu_types.h).
// With a residual, each task adds a block of rows into h (still in cache) and runs the norm's
// row loops on it; a float32 residual under 16-bit x runs them in float32, x converted. The
// backward adds dh to dx in a pass of its own over each chunk.
#include "util/cpu_vec.h"  // first: it includes the intrinsics before cpu_types.h
#include "norm/norm.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

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

// gamma = weight + offset in the accumulation type, 1 where weight is absent.
template <typename P, typename A>
cpu::Row<A> gamma_or_one(const void* weight, int64_t cols, float offset) {
  cpu::Row<A> g = cpu::param_or<P, A>(weight, cols, A(1));
  if (weight && offset != 0)
    for (A& v : g) v += A(offset);
  return g;
}

// Calls fn(T{}, P{}) for the input storage type T and the parameter storage type P (x's, or
// float32: norm_param_dtype_ok, checked by norm_forward / norm_backward).
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

// The forward's per-call arguments: gamma/beta in A (1 and 0 where absent); mean may be null.
template <typename T, typename A>
struct ForwardArgs {
  const T* x;
  const A* g;
  const A* b;
  T* y;
  A* mean;
  A* rstd;
  int64_t cols;
  A eps;
  NormMode mode;
};

// Rows [begin, end): y = (x - shift) * rstd * gamma + beta, with shift the mean (0 but for
// kLayer), and each row's rstd and (where mean is not null) mean. Cols: the column loops
// (cpu_vec.h); buf holds cols values where they stage a row.
template <typename Cols, typename T, typename A>
FUSEDLAYERS_INLINE void forward_rows_with(const ForwardArgs<T, A>& a, A* buf, int64_t begin,
                                          int64_t end) {
  const int64_t cols = a.cols;
  const A* g = a.g;
  const A* b = a.b;
  for (int64_t r = begin; r < end; ++r) {
    const auto* v = Cols::row(a.x + r * cols, buf, cols);
    // The moments of d = x - s, s the mean of the first (up to) kLanes values, in one pass:
    // mean = s + mean(d), var = mean(d^2) - mean(d)^2. Sums of deviations round at their own
    // scale, not the mean's (rows at 100 std: 1 ulp of the mean where a plain float sum was off
    // ~2), and with s near the mean, mean(d)^2 is small beside var, so the subtraction cancels
    // nothing; where it is not (the row's start unlike the rest), the same moments around that
    // mean, a second pass over the row (in L1), correct both. One pass fewer than always taking
    // the second: the forward is bound by memory, and each pass delays the next row's loads.
    A s = A(0);
    const int64_t head = std::min<int64_t>(cols, cpu::kLanes);
    for (int64_t j = 0; j < head; ++j) s += cpu::Scalar::load(v + j);
    s /= A(head);
    A mu = A(0), var;
    if (a.mode == NormMode::kRms) {
      var = Cols::template sum<A>(cols, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
              const auto x = decltype(io)::load(v + j);
              return x * x;
            }) / A(cols);
    } else {
      const auto [sd, sd2] =
          Cols::template sum2<A>(cols, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
            const auto d = decltype(io)::load(v + j) - s;
            return std::make_pair(d, d * d);
          });
      const A md = sd / A(cols);
      mu = s + md;
      var = sd2 / A(cols) - md * md;
      if (md * md > A(0.25) * var) {  // more than a bit of var would cancel
        const auto [se, se2] =
            Cols::template sum2<A>(cols, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
              const auto e = decltype(io)::load(v + j) - mu;
              return std::make_pair(e, e * e);
            });
        const A me = se / A(cols);
        mu += me;
        var = se2 / A(cols) - me * me;
      }
    }
    const A rs = A(1) / cpu::sqrt_of(var + a.eps);
    const A shift = a.mode == NormMode::kLayer ? mu : A(0);
    T* yr = a.y + r * cols;
    Cols::each(cols, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
      using IO = decltype(io);
      IO::store((IO::load(v + j) - shift) * rs * IO::load(g + j) + IO::load(b + j), yr + j);
    });
    if (a.mean) a.mean[r] = mu;
    a.rstd[r] = rs;
  }
}

template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void forward_rows(const ForwardArgs<T, A>& a, A* buf, int64_t begin,
                                         int64_t end) {
  forward_rows_with<cpu::ScalarColumns>(a, buf, begin, end);
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
// and, kParams, dy * xhat and dy added into pg and pb.
template <typename Cols, bool kParams, typename T, typename A>
FUSEDLAYERS_INLINE std::pair<A, A> centred_sums_with(const T* __restrict dy,
                                                     const T* __restrict x,
                                                     const A* __restrict g, A* __restrict pg,
                                                     A* __restrict pb, A mu, A rs, int64_t n) {
  return Cols::template sum2<A>(n, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
    using IO = decltype(io);
    const auto dyj = IO::load(dy + j), xhj = (IO::load(x + j) - mu) * rs;
    const auto gd = dyj * IO::load(g + j);
    if constexpr (kParams) {
      IO::store(IO::load(pg + j) + dyj * xhj, pg + j);
      IO::store(IO::load(pb + j) + dyj, pb + j);
    }
    return std::make_pair(gd, gd * xhj);
  });
}

// The same, column by column, in a function of its own, not inlined, for its __restrict
// parameters (the partials never alias the rows), which GCC honours only on a function it
// compiles as such: inlined, the lane sums stayed in memory, a store and reload per add (perf),
// since the stores into pg might have been into them.
template <bool kParams, typename T, typename A>
FUSEDLAYERS_CPU_CLONES std::pair<A, A> centred_sums(const T* __restrict dy,
                                                    const T* __restrict x,
                                                    const A* __restrict g, A* __restrict pg,
                                                    A* __restrict pb, A mu, A rs, int64_t n) {
  return centred_sums_with<cpu::ScalarColumns, kParams>(dy, x, g, pg, pb, mu, rs, n);
}

// The common case, kLayer from the saved input, rows [begin, end) in two passes over each row,
// xhat and dy * gamma recomputed in each: dx, and dy * xhat and dy added into pg and pb (when
// not null) in row order. Cols: the column loops (cpu_vec.h).
template <typename Cols, typename T, typename A>
FUSEDLAYERS_INLINE void centred_rows_with(const BackwardArgs<T, A>& a, A* pg, A* pb,
                                          int64_t begin, int64_t end) {
  const int64_t cols = a.cols;
  const A* g = a.g;
  const auto sums = [&](const T* dy, const T* x, A mu, A rs) FUSEDLAYERS_LAMBDA_INLINE {
    if constexpr (std::is_same_v<Cols, cpu::ScalarColumns>)
      return pg ? centred_sums<true>(dy, x, g, pg, pb, mu, rs, cols)
                : centred_sums<false>(dy, x, g, pg, pb, mu, rs, cols);
    else  // Floats accumulators stay in registers without an outlined function
      return pg ? centred_sums_with<Cols, true>(dy, x, g, pg, pb, mu, rs, cols)
                : centred_sums_with<Cols, false>(dy, x, g, pg, pb, mu, rs, cols);
  };
  for (int64_t r = begin; r < end; ++r) {
    const T* dy = a.dy + r * cols;
    const T* x = a.saved + r * cols;
    const A mu = a.mean[r], rs = a.rstd[r];
    const auto [sum_gd, sum_gdx] = sums(dy, x, mu, rs);
    const A mg = sum_gd / A(cols), mgx = sum_gdx / A(cols);
    T* dx = a.dx + r * cols;
    Cols::each(cols, [&](auto io, int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
      using IO = decltype(io);
      const auto xhj = (IO::load(x + j) - mu) * rs;
      IO::store(rs * (IO::load(dy + j) * IO::load(g + j) - mg - xhj * mgx), dx + j);
    });
  }
}

template <typename T, typename A>
FUSEDLAYERS_CPU_CLONES void centred_rows(const BackwardArgs<T, A>& a, A* pg, A* pb,
                                         int64_t begin, int64_t end) {
  centred_rows_with<cpu::ScalarColumns>(a, pg, pb, begin, end);
}

// float16 rows with the conversions in registers: one function per ISA (cpu_vec.h), the same
// bits as each other and as the float32 loops on staged rows, which they replace (faster:
// docs/DESIGN.md, "CPU loops").
using HalfForward = ForwardArgs<cpu::Half, float>;
using HalfBackward = BackwardArgs<cpu::Half, float>;
#define FUSEDLAYERS_HALF_ROWS(isa, target)                                                     \
  __attribute__((flatten)) target void forward_rows_##isa(const HalfForward& a, float* buf,    \
                                                          int64_t begin, int64_t end) {        \
    forward_rows_with<cpu::VectorColumns<cpu::Half##isa>>(a, buf, begin, end);                 \
  }                                                                                            \
  __attribute__((flatten)) target void centred_rows_##isa(const HalfBackward& a, float* pg,    \
                                                          float* pb, int64_t begin,            \
                                                          int64_t end) {                       \
    centred_rows_with<cpu::VectorColumns<cpu::Half##isa>>(a, pg, pb, begin, end);              \
  }
FUSEDLAYERS_HALF_ROWS(Avx512, FUSEDLAYERS_TARGET_AVX512)
FUSEDLAYERS_HALF_ROWS(F16c, FUSEDLAYERS_TARGET_F16C)
FUSEDLAYERS_HALF_ROWS(Portable, )
#undef FUSEDLAYERS_HALF_ROWS

void forward_rows(const HalfForward& a, float* buf, int64_t begin, int64_t end) {
  static const auto impl =
      cpu::pick_isa(forward_rows_Avx512, forward_rows_F16c, forward_rows_Portable);
  impl(a, buf, begin, end);
}

void centred_rows(const HalfBackward& a, float* pg, float* pb, int64_t begin, int64_t end) {
  static const auto impl =
      cpu::pick_isa(centred_rows_Avx512, centred_rows_F16c, centred_rows_Portable);
  impl(a, pg, pb, begin, end);
}

// The other cases (kRms, kKerasRmsScaling, or xhat from the saved output), rows [begin, end):
// dx, and dy * xhat (or dy * x * rstd) and dy added into pg and pb (when not null) in row
// order. buf holds 3 rows of cols values, row_stride apart.
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
  for (int64_t r = begin; r < end; ++r) {
    const A rs = a.rstd[r];
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

// Rows per block of the add+norm passes: about 16K elements, a block of h stays in L2.
int64_t block_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / cols); }

// out[i] = round_R(a[i] + b[i]) for n values.
template <typename R, typename T, typename U>
FUSEDLAYERS_CPU_CLONES void add_rows(const T* a, const U* b, R* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = cpu::from_acc<R>(cpu::to_acc(a[i]) + cpu::to_acc(b[i]));
}

// The add+norm backward's last step over n values (norm.h): d = the norm's dx in R, then
// dresidual = round_R(d + dh) (dh may be null), and dx = dresidual in T. out_r may alias d.
template <typename T, typename R>
FUSEDLAYERS_CPU_CLONES void finish_dresidual(const R* d, const R* dh, R* out_r, T* dx,
                                             int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const R v = dh ? cpu::from_acc<R>(cpu::to_acc(d[i]) + cpu::to_acc(dh[i])) : d[i];
    if (out_r) out_r[i] = v;
    if (dx) dx[i] = cpu::from_acc<T>(cpu::to_acc(v));
  }
}

}  // namespace

void norm_forward_cpu(const NormForwardArgs& a, const ParallelFor& parallel_for) {
  check_sizes("norm", a.rows, a.cols);
  if (a.rows == 0) return;
  const int64_t cols = a.cols;
  dispatch2(a.dtype, a.param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    using A = typename cpu::Acc<T>::type;
    const cpu::Row<A> g = gamma_or_one<P, A>(a.gamma, cols, a.gamma_offset);
    const cpu::Row<A> b =
        cpu::param_or<P, A>(a.mode == NormMode::kLayer ? a.beta : nullptr, cols, A(0));
    const int64_t grain = block_rows(cols);
    A* mean = static_cast<A*>(a.mean);
    A* rstd = static_cast<A*>(a.rstd);
    const A eps = static_cast<A>(a.eps);
    if (!a.residual) {
      const ForwardArgs<T, A> args{static_cast<const T*>(a.x), g.data(), b.data(),
                                   static_cast<T*>(a.y), mean, rstd, cols, eps, a.mode};
      parallel_for(a.rows, grain, [&](int64_t begin, int64_t end) {
        cpu::Row<A> buf(static_cast<size_t>(cols));
        forward_rows(args, buf.data(), begin, end);
      });
      return;
    }
    // Rows [r, r + n) of each block: h = x + residual, then the norm of h (the args' rows
    // offset to the block's first).
    const auto block = [&](auto r_tag, int64_t r, int64_t n, A* buf, auto* y_block) {
      using R = decltype(r_tag);
      R* h = static_cast<R*>(a.h) + r * cols;
      add_rows(static_cast<const T*>(a.x) + r * cols, static_cast<const R*>(a.residual) + r * cols,
               h, n * cols);
      const ForwardArgs<R, A> args{h, g.data(), b.data(), y_block, mean ? mean + r : nullptr,
                                   rstd + r, cols, eps, a.mode};
      forward_rows(args, buf, 0, n);
    };
    parallel_for(a.rows, grain, [&](int64_t begin, int64_t end) {
      cpu::Row<A> buf(static_cast<size_t>(cols));
      if (a.residual_dtype == a.dtype) {
        for (int64_t r = begin; r < end; r += grain)
          block(T{}, r, std::min(grain, end - r), buf.data(), static_cast<T*>(a.y) + r * cols);
      } else if constexpr (std::is_same_v<A, float>) {  // a float32 residual: y staged in float
        cpu::Row<float> y(static_cast<size_t>(grain * cols));
        for (int64_t r = begin; r < end; r += grain) {
          const int64_t n = std::min(grain, end - r);
          block(float{}, r, n, buf.data(), y.data());
          cpu::store(y.data(), static_cast<T*>(a.y) + r * cols, n * cols);
        }
      }
    });
  });
}

size_t norm_backward_workspace_size_cpu(int64_t rows, int64_t cols, DType dtype) {
  check_sizes("norm_backward", rows, cols);
  const size_t acc_bytes = dtype == DType::kFloat64 ? 8 : 4;
  return static_cast<size_t>(cpu::num_chunks(rows, cols)) * 2 * static_cast<size_t>(cols) *
         acc_bytes;
}

void norm_backward_cpu(const NormBackwardArgs& a, const ParallelFor& parallel_for) {
  const int64_t rows = a.rows, cols = a.cols;
  check_sizes("norm_backward", rows, cols);
  const bool want_params = a.dgamma || a.dbeta;
  const bool centred_from_input = a.mode == NormMode::kLayer && !a.saved_is_output;
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
    // The norm's backward over rows [begin, end) of args (pg, pb: this chunk's partials).
    const auto rows_of = [&](const auto& args, A* pg, A* pb, A* buf, int64_t begin, int64_t end) {
      if (centred_from_input)
        centred_rows(args, pg, pb, begin, end);
      else
        backward_rows(args, pg, pb, buf, begin, end);
    };
    const int64_t grain = block_rows(cols);
    parallel_for(chunks, 1, [&](int64_t cbegin, int64_t cend) {
      cpu::Row<A> buf(centred_from_input ? 0 : static_cast<size_t>(3 * cpu::row_stride<A>(cols)));
      const bool staged = a.add && a.residual_dtype != a.dtype;  // float32 h under 16-bit x
      cpu::Row<A> dy_block(staged ? static_cast<size_t>(grain * cols) : 0);
      cpu::Row<A> dx_block(staged ? static_cast<size_t>(grain * cols) : 0);
      for (int64_t c = cbegin; c < cend; ++c) {
        A* pg = want_params ? partial + c * 2 * cols : nullptr;
        A* pb = want_params ? pg + cols : nullptr;
        if (want_params) std::fill(pg, pg + 2 * cols, A(0));
        const int64_t begin = c * per_chunk, end = std::min(rows, (c + 1) * per_chunk);
        if (!staged) {
          rows_of(args, pg, pb, buf.data(), begin, end);
          if (a.add && a.dh)  // dx += dh: on the CPU a second pass over the chunk's dx
            finish_dresidual<T>(args.dx + begin * cols,
                                static_cast<const T*>(a.dh) + begin * cols,
                                args.dx + begin * cols, static_cast<T*>(nullptr),
                                (end - begin) * cols);
          continue;
        }
        if constexpr (std::is_same_v<A, float>) {
          for (int64_t r = begin; r < end; r += grain) {
            const int64_t n = std::min(grain, end - r), off = r * cols;
            cpu::load(args.dy + off, dy_block.data(), n * cols);
            const BackwardArgs<float, float> f{
                dy_block.data(), static_cast<const float*>(a.saved) + off,
                args.mean ? args.mean + r : nullptr, args.rstd + r, g.data(), b.data(),
                dx_block.data(), cols, false, a.mode};
            rows_of(f, pg, pb, buf.data(), 0, n);
            finish_dresidual(dx_block.data(),
                             a.dh ? static_cast<const float*>(a.dh) + off : nullptr,
                             static_cast<float*>(a.dresidual) + off, args.dx + off, n * cols);
          }
        }
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
