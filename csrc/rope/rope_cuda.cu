// CUDA rotary embedding (math: rope.h): one block per token, which stages its cos row and signed
// sines in shared memory (as float) once for all heads of q and k, then rotates N-element units
// of every head: 16-byte vectors where head_dim, rotary_dim, the strides and the pointers allow,
// else one element.
#include <algorithm>

#include "util/cuda_common.cuh"
#include "rope/rope.h"

namespace fusedlayers {
namespace {

using cuda::from_acc;
using cuda::to_acc;
constexpr int kThreads = 128;

template <typename T, typename C, int N, bool kInterleaved>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopePass p) {
  extern __shared__ float smem[];
  const RopeShape& s = p.shape;
  const int64_t tok = blockIdx.x, b = tok / s.seq, pos = tok % s.seq;
  const int r = int(s.rotary_dim), half = r / 2;
  float* c = smem;
  float* sa = c + r;
  float* sb = sa + half;
  const C* cos = static_cast<const C*>(p.cos) + b * p.cs_stride_b + pos * p.cs_stride_s;
  const C* sin = static_cast<const C*>(p.sin) + b * p.cs_stride_b + pos * p.cs_stride_s;
  for (int j = threadIdx.x; j < r; j += blockDim.x) c[j] = to_acc(cos[j]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float sin_a = to_acc(sin[kInterleaved ? 2 * i : i]);
    const float sin_b = to_acc(sin[kInterleaved ? 2 * i + 1 : i + half]);
    sa[i] = p.backward ? sin_b : -sin_a;
    sb[i] = p.backward ? -sin_a : sin_b;
  }
  __syncthreads();
  using V = cuda::Vec<T, N>;
  constexpr int R = kInterleaved && N == 1 ? 2 : N;  // elements of a rotated unit: whole pairs
  // units of a head: the rotated part (half layout: N pairs, a unit at i and one at i + half;
  // interleaved: N elements, N / 2 pairs), then the passed-through part
  const int rot_units = kInterleaved ? r / R : half / N;
  const int units = rot_units + int(s.head_dim - r) / N;
  const int64_t heads = s.q_heads + s.k_heads;
  for (int64_t w = threadIdx.x; w < heads * units; w += blockDim.x) {
    const int64_t hh = w / units;
    const int u = int(w - hh * units);
    const bool is_k = hh >= s.q_heads;
    const int64_t h = is_k ? hh - s.q_heads : hh;
    const RopeView& in = is_k ? p.k_in : p.q_in;
    const RopeView& out = is_k ? p.k_out : p.q_out;
    const T* src = static_cast<const T*>(in.data) + b * in.stride_b + h * in.stride_h +
                   pos * in.stride_s;
    T* dst = static_cast<T*>(out.data) + b * out.stride_b + h * out.stride_h + pos * out.stride_s;
    if (u >= rot_units) {
      const int j = r + (u - rot_units) * N;
      *reinterpret_cast<V*>(dst + j) = *reinterpret_cast<const V*>(src + j);
    } else if (kInterleaved) {
      const int j = u * R;
      T x[R], y[R];
      if constexpr (N == 1) {
        x[0] = src[j];
        x[1] = src[j + 1];
      } else {
        const V v = *reinterpret_cast<const V*>(src + j);
#pragma unroll
        for (int k = 0; k < R; ++k) x[k] = v.v[k];
      }
#pragma unroll
      for (int k = 0; k < R; k += 2) {
        const float xa = to_acc(x[k]), xb = to_acc(x[k + 1]);
        const int i = (j + k) / 2;
        y[k] = from_acc<T>(fmaf(xa, c[j + k], xb * sa[i]));
        y[k + 1] = from_acc<T>(fmaf(xb, c[j + k + 1], xa * sb[i]));
      }
      if constexpr (N == 1) {
        dst[j] = y[0];
        dst[j + 1] = y[1];
      } else {
        V v;
#pragma unroll
        for (int k = 0; k < R; ++k) v.v[k] = y[k];
        *reinterpret_cast<V*>(dst + j) = v;
      }
    } else {
      const int i = u * N;
      const V xa = *reinterpret_cast<const V*>(src + i);
      const V xb = *reinterpret_cast<const V*>(src + i + half);
      V ya, yb;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float a = to_acc(xa.v[k]), bb = to_acc(xb.v[k]);
        ya.v[k] = from_acc<T>(fmaf(a, c[i + k], bb * sa[i + k]));
        yb.v[k] = from_acc<T>(fmaf(bb, c[i + half + k], a * sb[i + k]));
      }
      *reinterpret_cast<V*>(dst + i) = ya;
      *reinterpret_cast<V*>(dst + i + half) = yb;
    }
  }
}

bool views_allow(const RopePass& p, int n) {
  const RopeView* views[] = {&p.q_in, &p.k_in, &p.q_out, &p.k_out};
  for (const RopeView* v : views)
    if (v->stride_b % n || v->stride_h % n || v->stride_s % n || !cuda::aligned(v->data, 16))
      return false;
  const int64_t r = p.shape.rotary_dim;
  return p.shape.head_dim % n == 0 && (p.interleaved ? r : r / 2) % n == 0 && r % n == 0;
}

}  // namespace

void rope_cuda(const RopePass& p, cudaStream_t stream) {
  if (p.dtype == DType::kFloat64) fail("rope: float64 is not supported on CUDA");
  const int64_t tokens = p.shape.batch * p.shape.seq;
  if (tokens == 0 || p.shape.q_heads + p.shape.k_heads == 0) return;
  if (tokens > INT32_MAX) fail("rope: more than 2^31 tokens");
  const size_t smem = size_t(2 * p.shape.rotary_dim) * sizeof(float);
  cuda::dispatch(p.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, double>) {
      cuda::dispatch(p.cs_dtype, [&](auto ct) {
        using C = decltype(ct);
        if constexpr (!std::is_same_v<C, double>) {
          constexpr int kVec = 16 / sizeof(T);
          const bool vec = views_allow(p, kVec);
          auto launch = [&](auto kernel) {
            kernel<<<unsigned(tokens), kThreads, smem, stream>>>(p);
            cuda::check_launch("rope_kernel");
          };
          if (p.interleaved)
            vec ? launch(rope_kernel<T, C, kVec, true>) : launch(rope_kernel<T, C, 1, true>);
          else
            vec ? launch(rope_kernel<T, C, kVec, false>) : launch(rope_kernel<T, C, 1, false>);
        }
      });
    }
  });
}

}  // namespace fusedlayers
