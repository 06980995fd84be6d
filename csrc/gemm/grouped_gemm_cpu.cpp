// The grouped GEMM's CPU kernel (math: grouped_gemm.h): each output row of a group is one task's
// loop, accumulated in the accumulation type in a row buffer, as axpys over B's rows where they
// are contiguous and as dot products where A's and B's k runs are; rounded once on store.
#include <algorithm>
#include <vector>

#include "util/cpu_types.h"
#include "gemm/grouped_gemm.h"

namespace fusedlayers {
namespace {

// The groups' clamped [start, end) rows (grouped_gemm.h: each end at least the one before).
std::vector<int64_t> group_ends(const GroupedProduct& p) {
  std::vector<int64_t> ends(p.groups);
  int64_t end = 0;
  for (int64_t g = 0; g < p.groups; ++g)
    ends[g] = end = std::min<int64_t>(std::max<int64_t>(p.offsets[g], end), p.rows);
  return ends;
}

// One row of D_g: d[j] = sum_{i < kg} A(row, i) B(i, j).
template <typename T, typename A>
void product_row(const T* a, const T* b, T* d, int64_t kg, const GroupedProduct& p, A* acc) {
  std::fill(acc, acc + p.n, A(0));
  if (p.a_k == 1 && p.b_k == 1) {  // both runs over k contiguous
    for (int64_t j = 0; j < p.n; ++j) {
      const T* bj = b + j * p.b_n;
      A sum = 0;
      for (int64_t i = 0; i < kg; ++i)
        sum += static_cast<A>(cpu::to_acc(a[i])) * static_cast<A>(cpu::to_acc(bj[i]));
      acc[j] = sum;
    }
  } else {
    for (int64_t i = 0; i < kg; ++i) {
      const A ai = static_cast<A>(cpu::to_acc(a[i * p.a_k]));
      const T* bi = b + i * p.b_k;
      for (int64_t j = 0; j < p.n; ++j) acc[j] += ai * static_cast<A>(cpu::to_acc(bi[j * p.b_n]));
    }
  }
  for (int64_t j = 0; j < p.n; ++j) d[j] = cpu::from_acc<T>(acc[j]);
}

template <typename T>
void product(const GroupedProduct& p, const ParallelFor& parallel_for) {
  using A = typename cpu::Acc<T>::type;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* d = static_cast<T*>(p.d);
  const std::vector<int64_t> ends = group_ends(p);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.n * p.k + p.n));
  if (p.ragged_m) {  // a task's rows: each row's group by its end
    parallel_for(p.rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<A> acc(p.n);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t g = std::upper_bound(ends.begin(), ends.end(), r) - ends.begin();
        if (g == p.groups) {  // past the last group: zeros
          std::fill(d + r * p.n, d + (r + 1) * p.n, cpu::from_acc<T>(A(0)));
          continue;
        }
        product_row(a + r * p.a_m, b + g * p.k * p.n, d + r * p.n, p.k, p, acc.data());
      }
    });
    return;
  }
  // ragged k (wgrad): a task's rows of every D_g, over its group's rows of A and B
  const int64_t grain_k = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.n * (p.rows + 1) /
                                                                                std::max<int64_t>(
                                                                                    1, p.groups)));
  parallel_for(p.groups * p.m, grain_k, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(p.n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / p.m, i = t % p.m;
      const int64_t start = g ? ends[g - 1] : 0;
      product_row(a + start * p.a_k + i * p.a_m, b + start * p.b_k, d + (g * p.m + i) * p.n,
                  ends[g] - start, p, acc.data());
    }
  });
}

}  // namespace

void grouped_product_cpu(const GroupedProduct& p, DType dtype, const ParallelFor& parallel_for) {
  cpu::dispatch(dtype, [&](auto t) { product<decltype(t)>(p, parallel_for); });
}

}  // namespace fusedlayers
