// CPU mixture-of-experts routing (math: moe.h): the route is one counting sort of the pairs
// (serial: a pass over T * k integers); the scatter and gather run in parallel over tokens, a
// token's rows staged in the accumulation type.
#include <cstring>
#include <vector>

#include "util/cpu_types.h"
#include "moe/moe.h"

namespace fusedlayers {
namespace {

template <typename I>
bool routed(I e, int64_t num_experts) {
  return e >= 0 && static_cast<int64_t>(e) < num_experts;
}

// Calls fn(T{}, W{}): T the storage type of `dtype`, W the weights' (T where absent).
template <typename Fn>
void dispatch_weights(DType dtype, const TensorRef& weights, Fn&& fn) {
  cpu::dispatch(dtype, [&](auto t) {
    using T = decltype(t);
    if (weights.defined && weights.dtype != dtype)
      fn(T{}, float{});
    else
      fn(T{}, T{});
  });
}

int64_t grain_tokens(const MoeShape& s) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, s.hidden * s.top_k));
}

template <typename I>
void route(const I* idx, const MoeRoute& a, const MoeShape& s) {
  const int64_t E = s.num_experts, n = s.pairs();
  std::vector<int64_t> next(E + 1, 0);  // bucket E: pairs that reach no expert
  for (int64_t p = 0; p < n; ++p) ++next[routed(idx[p], E) ? idx[p] : E];
  int64_t start = 0;
  for (int64_t e = 0; e <= E; ++e) {
    const int64_t count = next[e];
    next[e] = start;
    start += count;
    if (e < E) a.offsets[e] = static_cast<int32_t>(start);
  }
  for (int64_t p = 0; p < n; ++p)
    a.row_index[p] = static_cast<int32_t>(next[routed(idx[p], E) ? idx[p] : E]++);
}

template <typename T, typename W, typename I>
void scatter(const MoeScatter& a, const MoeShape& s, const ParallelFor& parallel_for) {
  using A = typename cpu::Acc<T>::type;
  const int64_t H = s.hidden, k = s.top_k, n = s.pairs(), E = s.num_experts;
  const T* in = static_cast<const T*>(a.in.data);
  const T* ys = a.ys.defined ? static_cast<const T*>(a.ys.data) : nullptr;
  const W* w = a.weights.defined ? static_cast<const W*>(a.weights.data) : nullptr;
  const I* idx = static_cast<const I*>(a.top_k_index.data);
  const int32_t* rows = static_cast<const int32_t*>(a.row_index.data);
  T* out = static_cast<T*>(a.out);
  W* dw = ys ? static_cast<W*>(a.dweights) : nullptr;
  parallel_for(s.tokens, grain_tokens(s), [&](int64_t begin, int64_t end) {
    cpu::Row<A> x_buf(H), y_buf(H), scaled(H);
    for (int64_t t = begin; t < end; ++t) {
      const A* x = cpu::staged(in + t * H, x_buf.data(), H);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = t * k + j, r = rows[p];
        if (dw) dw[p] = cpu::from_acc<W>(0);
        if (r < 0 || r >= n) continue;
        T* dst = out + r * H;
        if (!routed(idx[p], E)) {
          std::memset(static_cast<void*>(dst), 0, H * sizeof(T));
          continue;
        }
        if (!w) {
          std::memcpy(static_cast<void*>(dst), in + t * H, H * sizeof(T));
          continue;
        }
        const A wt = static_cast<A>(cpu::to_acc(w[p]));
        for (int64_t i = 0; i < H; ++i) scaled[i] = wt * x[i];
        cpu::store(scaled.data(), dst, H);
        if (dw) {
          const A* y = cpu::staged(ys + r * H, y_buf.data(), H);
          dw[p] = cpu::from_acc<W>(cpu::lane_sum<A>(H, [&](int64_t i) { return y[i] * x[i]; }));
        }
      }
    }
  });
}

template <typename T, typename W, typename I>
void gather(const MoeGather& a, const MoeShape& s, const ParallelFor& parallel_for) {
  using A = typename cpu::Acc<T>::type;
  const int64_t H = s.hidden, k = s.top_k, n = s.pairs(), E = s.num_experts;
  const T* in = static_cast<const T*>(a.in.data);
  const W* w = a.weights.defined ? static_cast<const W*>(a.weights.data) : nullptr;
  const I* idx = static_cast<const I*>(a.top_k_index.data);
  const int32_t* rows = static_cast<const int32_t*>(a.row_index.data);
  T* out = static_cast<T*>(a.out);
  parallel_for(s.tokens, grain_tokens(s), [&](int64_t begin, int64_t end) {
    cpu::Row<A> acc(H), buf(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = t * k + j, r = rows[p];
        if (r < 0 || r >= n || !routed(idx[p], E)) continue;
        const A wt = w ? static_cast<A>(cpu::to_acc(w[p])) : A(1);
        const A* y = cpu::staged(in + r * H, buf.data(), H);
        for (int64_t i = 0; i < H; ++i) acc[i] += wt * y[i];
      }
      cpu::store(acc.data(), out + t * H, H);
    }
  });
}

}  // namespace

void moe_route_cpu(const MoeRoute& a, const MoeShape& s) {
  dispatch_index(a.top_k_index.type, [&](auto i) {
    route(static_cast<const decltype(i)*>(a.top_k_index.data), a, s);
  });
}

void moe_scatter_cpu(const MoeScatter& a, const MoeShape& s, const ParallelFor& parallel_for) {
  dispatch_weights(a.in.dtype, a.weights, [&](auto t, auto w) {
    dispatch_index(a.top_k_index.type, [&](auto i) {
      scatter<decltype(t), decltype(w), decltype(i)>(a, s, parallel_for);
    });
  });
}

void moe_gather_cpu(const MoeGather& a, const MoeShape& s, const ParallelFor& parallel_for) {
  dispatch_weights(a.in.dtype, a.weights, [&](auto t, auto w) {
    dispatch_index(a.top_k_index.type, [&](auto i) {
      gather<decltype(t), decltype(w), decltype(i)>(a, s, parallel_for);
    });
  });
}

}  // namespace fusedlayers
