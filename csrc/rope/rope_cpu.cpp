// CPU rotary embedding (math: rope.h): tokens in parallel; per token its cos and sin rows in the
// accumulation type, then every head of q and k rotated (or passed through beyond rotary_dim).
#include "rope/rope.h"

#include <algorithm>

#include "util/cpu_types.h"

namespace fusedlayers {
namespace {

using cpu::to_acc;

// One row: out = rotate(in), pairs (a, b) with sa and sb the signed sines of the pass (forward:
// -sin[a], +sin[b]; backward: +sin[b] at a, -sin[a] at b).
template <bool kInterleaved, typename T, typename A>
FUSEDLAYERS_CPU_CLONES void rotate_row(const T* __restrict in, T* __restrict out,
                                       const A* __restrict c, const A* __restrict sa,
                                       const A* __restrict sb, int64_t rotary, int64_t head_dim) {
  const int64_t half = rotary / 2;
  if constexpr (kInterleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const A xa = to_acc(in[2 * i]), xb = to_acc(in[2 * i + 1]);
      out[2 * i] = cpu::from_acc<T>(xa * c[2 * i] + xb * sa[i]);
      out[2 * i + 1] = cpu::from_acc<T>(xb * c[2 * i + 1] + xa * sb[i]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const A xa = to_acc(in[i]), xb = to_acc(in[i + half]);
      out[i] = cpu::from_acc<T>(xa * c[i] + xb * sa[i]);
      out[i + half] = cpu::from_acc<T>(xb * c[i + half] + xa * sb[i]);
    }
  }
  for (int64_t j = rotary; j < head_dim; ++j) out[j] = in[j];
}

template <typename C, typename A>
A load_acc(const void* p, int64_t i) {
  return A(to_acc(static_cast<const C*>(p)[i]));
}

}  // namespace

void rope_cpu(const RopePass& p, const ParallelFor& parallel_for) {
  const RopeShape& s = p.shape;
  const int64_t tokens = s.batch * s.seq;
  if (tokens == 0 || s.q_heads + s.k_heads == 0 || s.head_dim == 0) return;
  cpu::dispatch(p.dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename cpu::Acc<T>::type;
    const int64_t r = s.rotary_dim, half = r / 2;
    const int64_t grain = std::max<int64_t>(1, 16384 / ((s.q_heads + s.k_heads) * s.head_dim));
    parallel_for(tokens, grain, [&](int64_t begin, int64_t end) {
      // cos, then the signed sines at the pairs' first and second elements
      cpu::Row<A> rows(static_cast<size_t>(r + 2 * half));
      A* c = rows.data();
      A* sa = c + r;
      A* sb = sa + half;
      for (int64_t tok = begin; tok < end; ++tok) {
        const int64_t b = tok / s.seq, q_pos = tok % s.seq;
        const int64_t cs_off = b * p.cs_stride_b + q_pos * p.cs_stride_s;
        cpu::dispatch(p.cs_dtype, [&](auto ct) {
          using C = decltype(ct);
          for (int64_t j = 0; j < r; ++j) c[j] = load_acc<C, A>(p.cos, cs_off + j);
          for (int64_t i = 0; i < half; ++i) {
            const int64_t ia = p.interleaved ? 2 * i : i, ib = p.interleaved ? 2 * i + 1 : i + half;
            const A sin_a = load_acc<C, A>(p.sin, cs_off + ia);
            const A sin_b = load_acc<C, A>(p.sin, cs_off + ib);
            sa[i] = p.backward ? sin_b : -sin_a;
            sb[i] = p.backward ? -sin_a : sin_b;
          }
        });
        for (int which = 0; which < 2; ++which) {
          const RopeView& in = which ? p.k_in : p.q_in;
          const RopeView& out = which ? p.k_out : p.q_out;
          for (int64_t h = 0; h < in.heads; ++h) {
            const T* src = static_cast<const T*>(in.data) + b * in.stride_b + h * in.stride_h +
                           q_pos * in.stride_s;
            T* dst = static_cast<T*>(out.data) + b * out.stride_b + h * out.stride_h +
                     q_pos * out.stride_s;
            if (p.interleaved)
              rotate_row<true>(src, dst, c, sa, sb, r, s.head_dim);
            else
              rotate_row<false>(src, dst, c, sa, sb, r, s.head_dim);
          }
        }
      }
    });
  });
}

}  // namespace fusedlayers
