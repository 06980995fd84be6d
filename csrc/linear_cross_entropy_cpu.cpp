// CPU row pass of linear + cross-entropy (math: linear_cross_entropy.h): each row of a chunk is
// staged in the accumulation type with its bias and softcap applied, reduced (max, sum, sum of
// exponentials), and, for gradients, written back as du. Rows run in parallel; dbias's column
// sums run over columns in parallel, each column summing its rows in order.
#include <cmath>
#include <string>

#include "cpu_gelu.h"
#include "cpu_types.h"
#include "linear_cross_entropy.h"

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

template <typename T, typename A>
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
    A m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < v; ++j) {
      A u = to_acc(logits[j]) + (bias ? to_acc(bias[j]) : A(0));
      if (cap > 0) u = cap * std::tanh(u / cap);
      z[j] = u;
      m = std::max(m, u);
      sum += u;
    }
    A se = 0;
    for (int64_t j = 0; j < v; ++j) se += std::exp(z[j] - m);
    const A lse = m + std::log(se);
    loss = (1 - eps) * (lse - z[t]) + eps * (lse - sum / A(v)) + zl * lse * lse;
    if (!scale) continue;
    const A s = scale[c.per_row_scale ? row : 0], pz = s * (1 + 2 * zl * lse),
            off = s * eps / A(v);
    for (int64_t j = 0; j < v; ++j) {
      A du = pz * std::exp(z[j] - lse) - off - (j == t ? s * (1 - eps) : A(0));
      if (cap > 0) du *= 1 - (z[j] / cap) * (z[j] / cap);
      du_row[j] = from_acc<T>(du);
    }
  }
}

}  // namespace

void linear_cross_entropy_chunk_cpu(const LinearCrossEntropyChunk& c,
                                    const ParallelFor& parallel_for) {
  check_targets(c);
  cpu::dispatch(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename cpu::Acc<T>::type;
    parallel_for(c.rows, 1, [&](int64_t b, int64_t e) { chunk_rows<T, A>(c, b, e); });
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
