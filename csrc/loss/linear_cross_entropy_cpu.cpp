// CPU row pass of linear + cross-entropy (math: linear_cross_entropy.h): each row of a chunk is
// staged in the accumulation type with its bias and softcap applied, reduced (max, then the sums
// of z and of exponentials in one pass, over cpu::lane_sum's lanes) and, for gradients, written
// back as du. The loops are compiled per ISA (FUSEDLAYERS_CPU_CLONES) and vectorize: float's exp
// is cpu::exp_approx (libm's is a scalar call), softcap's tanh stays libm's. Rows run in
// parallel; dbias's column sums run over columns in parallel, each column summing its rows in
// order.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "activation/cpu_gelu.h"
#include "util/cpu_types.h"
#include "loss/linear_cross_entropy.h"

namespace fusedlayers {
namespace {

using cpu::from_acc;
using cpu::to_acc;

int64_t target_at(const LinearCrossEntropyChunk& c, int64_t row) {
  return c.target_int32 ? static_cast<const int32_t*>(c.target)[row]
                        : static_cast<const int64_t*>(c.target)[row];
}

// Before the parallel pass: an error thrown on a worker thread of a framework's pool (TF's, XLA's)
// would end the process instead of failing the op.
void check_targets(const LinearCrossEntropyChunk& c) {
  for (int64_t row = c.row0; row < c.row0 + c.rows; ++row) {
    const int64_t t = target_at(c, row);
    if (t != c.ignore_index && (t < 0 || t >= c.vocab))
      arg_error("linear_cross_entropy", "target must be in [0, " + std::to_string(c.vocab) +
                                            ") or ignore_index, got " + std::to_string(t));
  }
}

// z = softcap(logits + bias) in A.
template <typename T, typename A, bool kCap>
FUSEDLAYERS_CPU_CLONES void stage_row(const T* __restrict logits, const T* __restrict bias, A cap,
                                      A* __restrict z, int64_t v) {
  for (int64_t j = 0; j < v; ++j) {
    const A u = to_acc(logits[j]) + (bias ? A(to_acc(bias[j])) : A(0));
    z[j] = kCap ? cap * std::tanh(u / cap) : u;
  }
}

// (max, sum of z, sum of exp(z - max)) of a staged row; NaN passes through the exponentials.
template <typename A>
FUSEDLAYERS_CPU_CLONES void row_stats(const A* __restrict z, int64_t v, A* stats) {
  A lanes[cpu::kLanes];
  for (A& m : lanes) m = -INFINITY;
  int64_t i = 0;
  for (; i + cpu::kLanes <= v; i += cpu::kLanes)
    for (int k = 0; k < cpu::kLanes; ++k) lanes[k] = std::max(lanes[k], z[i + k]);
  A m = -INFINITY;
  for (A l : lanes) m = std::max(m, l);
  for (; i < v; ++i) m = std::max(m, z[i]);
  const std::pair<A, A> sums = cpu::lane_sum2<A>(v, [&](int64_t j) FUSEDLAYERS_LAMBDA_INLINE {
    return std::pair<A, A>(z[j], cpu::exp_approx<true>(z[j] - m));
  });
  stats[0] = m, stats[1] = sums.first, stats[2] = sums.second;
}

// du = scale (p (1 + 2 z_loss lse) - eps / V) (times softcap's slope), p = exp(z - lse); the
// target's term is the caller's.
template <typename T, typename A, bool kCap>
FUSEDLAYERS_CPU_CLONES void grad_row(const A* __restrict z, T* __restrict du, int64_t v, A pz,
                                     A lse, A off, A cap) {
  for (int64_t j = 0; j < v; ++j) {
    A d = pz * cpu::exp_approx<true>(z[j] - lse) - off;
    if (kCap) d *= A(1) - (z[j] / cap) * (z[j] / cap);
    du[j] = from_acc<T>(d);
  }
}

template <typename T, typename A, bool kCap>
void chunk_rows(const LinearCrossEntropyChunk& c, int64_t begin, int64_t end) {
  const cpu::IeeeSubnormals ieee;
  const int64_t v = c.vocab;
  const A eps = A(c.label_smoothing), cap = A(c.softcap), zl = A(c.z_loss);
  const A* scale = static_cast<const A*>(c.grad_scale);
  const T* bias = static_cast<const T*>(c.bias);
  cpu::Row<A> z(static_cast<size_t>(v));
  for (int64_t r = begin; r < end; ++r) {
    const int64_t row = c.row0 + r;
    const int64_t t = target_at(c, row);
    const T* logits = static_cast<const T*>(c.logits) + r * v;
    T* du_row = static_cast<T*>(c.du) + r * v;
    A& loss = static_cast<A*>(c.loss)[row];
    if (t == c.ignore_index) {
      loss = 0;
      if (scale)
        for (int64_t j = 0; j < v; ++j) du_row[j] = from_acc<T>(A(0));
      continue;
    }
    // Without gradients, rows already in A with nothing to apply are read where they are (the
    // gradient pass reads the staged copy: du may be the logits).
    const A* zr = reinterpret_cast<const A*>(logits);
    if (!std::is_same_v<T, A> || bias || kCap || scale) {
      stage_row<T, A, kCap>(logits, bias, cap, z.data(), v);
      zr = z.data();
    }
    A stats[3];
    row_stats<A>(zr, v, stats);
    const A m = stats[0], sum = stats[1], lse = m + std::log(stats[2]);
    const A zt = zr[t];  // before du, which may be the logits, is written
    loss = (1 - eps) * (lse - zt) + eps * (lse - sum / A(v)) + zl * lse * lse;
    if (!scale) continue;
    const A s = scale[c.per_row_scale ? row : 0], pz = s * (1 + 2 * zl * lse),
            off = s * eps / A(v);
    grad_row<T, A, kCap>(z.data(), du_row, v, pz, lse, off, cap);
    A dt = pz * cpu::exp_approx<true>(zt - lse) - off - s * (1 - eps);
    if (kCap) dt *= A(1) - (zt / cap) * (zt / cap);
    du_row[t] = from_acc<T>(dt);
  }
}

}  // namespace

void linear_cross_entropy_chunk_cpu(const LinearCrossEntropyChunk& c,
                                    const ParallelFor& parallel_for) {
  check_targets(c);
  cpu::dispatch(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    parallel_for(c.rows, 1, [&](int64_t b, int64_t e) {
      c.softcap > 0 ? chunk_rows<T, A, true>(c, b, e) : chunk_rows<T, A, false>(c, b, e);
    });
    if (!c.dbias_acc || !c.grad_scale) return;
    A* acc = static_cast<A*>(c.dbias_acc);
    const T* du = static_cast<const T*>(c.du);
    parallel_for(c.vocab, 1024, [&](int64_t b, int64_t e) {
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t j = b; j < e; ++j) acc[j] += to_acc(du[r * c.vocab + j]);
    });
  });
}

void linear_cross_entropy_dbias_cpu(const void* acc, void* dbias, int64_t vocab, DType dtype) {
  cpu::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    for (int64_t j = 0; j < vocab; ++j)
      static_cast<T*>(dbias)[j] = from_acc<T>(static_cast<const A*>(acc)[j]);
  });
}

}  // namespace fusedlayers
