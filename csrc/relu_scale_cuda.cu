// CUDA ReLU*scale: a grid-stride loop over 16-byte vectors (scalar loop when unaligned), 64-bit
// indices; the same per-element math as relu_scale_cpu.cpp, so results match the CPU bit for bit.
#include <algorithm>

#include "cuda_common.cuh"
#include "relu_scale.h"

namespace fusedlayers {
namespace {

using cuda::Acc;
using cuda::from_acc;
using cuda::to_acc;

template <typename T, typename A>
__device__ __forceinline__ T forward_one(T x, A alpha) {
  const A v = to_acc(x);
  return from_acc<T>((v < A(0) ? A(0) : v) * alpha);  // NaN passes through
}

template <typename T, typename A>
__device__ __forceinline__ T backward_one(T dy, T x, A alpha) {
  const A g = to_acc(dy) * alpha;
  return from_acc<T>(to_acc(x) <= A(0) ? A(0) : g);
}

constexpr int kUnroll = 4;  // vectors in flight per thread: enough loads to cover DRAM latency

// Elements [0, n) as n / N vectors of N, kUnroll of them per thread and step, then the rest one
// by one; grid-stride, 64-bit indices.
template <typename T, int N>
__global__ void relu_scale_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n,
                                          typename Acc<T>::type alpha) {
  using V = cuda::Vec<T, N>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / N;
  int64_t i = start;
  for (; i + (kUnroll - 1) * stride < vectors; i += kUnroll * stride) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = reinterpret_cast<const V*>(x)[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[u].v[k] = forward_one(v[u].v[k], alpha);
      reinterpret_cast<V*>(y)[i + u * stride] = v[u];
    }
  }
  for (; i < vectors; i += stride) {
    V v = reinterpret_cast<const V*>(x)[i];
#pragma unroll
    for (int k = 0; k < N; ++k) v.v[k] = forward_one(v.v[k], alpha);
    reinterpret_cast<V*>(y)[i] = v;
  }
  for (int64_t j = vectors * N + start; j < n; j += stride) y[j] = forward_one(x[j], alpha);
}

template <typename T, int N>
__global__ void relu_scale_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                           T* __restrict__ dx, int64_t n,
                                           typename Acc<T>::type alpha) {
  using V = cuda::Vec<T, N>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / N;
  int64_t i = start;
  for (; i + (kUnroll - 1) * stride < vectors; i += kUnroll * stride) {
    V g[kUnroll], v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      g[u] = reinterpret_cast<const V*>(dy)[i + u * stride];
      v[u] = reinterpret_cast<const V*>(x)[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < N; ++k) g[u].v[k] = backward_one(g[u].v[k], v[u].v[k], alpha);
      reinterpret_cast<V*>(dx)[i + u * stride] = g[u];
    }
  }
  for (; i < vectors; i += stride) {
    const V g = reinterpret_cast<const V*>(dy)[i];
    const V v = reinterpret_cast<const V*>(x)[i];
    V out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = backward_one(g.v[k], v.v[k], alpha);
    reinterpret_cast<V*>(dx)[i] = out;
  }
  for (int64_t j = vectors * N + start; j < n; j += stride)
    dx[j] = backward_one(dy[j], x[j], alpha);
}

constexpr int kThreads = 256;

// A full wave of resident blocks (8 x 256 threads per SM), fewer for small inputs; the
// grid-stride loops do the rest.
int64_t grid_for(int64_t work) {
  const int64_t wanted = (work + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  return std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t(cuda::sm_count()) * 8));
}

}  // namespace

void relu_scale_forward_cuda(const void* x, void* y, int64_t n, double alpha, DType dtype,
                             cudaStream_t stream) {
  if (n < 0) fail("relu_scale: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    constexpr int N = 16 / sizeof(T);
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    if (cuda::aligned(x, 16) && cuda::aligned(y, 16)) {
      relu_scale_forward_kernel<T, N>
          <<<grid_for(n / N + 1), kThreads, 0, stream>>>(xp, yp, n, static_cast<A>(alpha));
    } else {
      relu_scale_forward_kernel<T, 1>
          <<<grid_for(n), kThreads, 0, stream>>>(xp, yp, n, static_cast<A>(alpha));
    }
    cuda::check_launch("relu_scale_forward_kernel");
  });
}

void relu_scale_backward_cuda(const void* dy, const void* x, void* dx, int64_t n, double alpha,
                              DType dtype, cudaStream_t stream) {
  if (n < 0) fail("relu_scale_backward: element count must be >= 0, got " + std::to_string(n));
  if (n == 0) return;
  cuda::dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    constexpr int N = 16 / sizeof(T);
    const T* dyp = static_cast<const T*>(dy);
    const T* xp = static_cast<const T*>(x);
    T* dxp = static_cast<T*>(dx);
    if (cuda::aligned(dy, 16) && cuda::aligned(x, 16) && cuda::aligned(dx, 16)) {
      relu_scale_backward_kernel<T, N>
          <<<grid_for(n / N + 1), kThreads, 0, stream>>>(dyp, xp, dxp, n, static_cast<A>(alpha));
    } else {
      relu_scale_backward_kernel<T, 1>
          <<<grid_for(n), kThreads, 0, stream>>>(dyp, xp, dxp, n, static_cast<A>(alpha));
    }
    cuda::check_launch("relu_scale_backward_kernel");
  });
}

}  // namespace fusedlayers
